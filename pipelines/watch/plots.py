"""One PNG of a watch session (matplotlib, Agg): per window, the latency percentiles and the load against their limits; the
KV cache and the queue as sampled; breaching windows shaded. An invalid window (pipelines/watch/plausible.py) is left out."""

from __future__ import annotations

import io
from pathlib import Path

from pipelines.files.atomic import write_bytes_atomic
from pipelines.watch.report import WatchReport


def write_plot(report: WatchReport, path: Path, samples: dict[str, list[tuple[float, float]]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    windows = [window for window in report.windows if not window.invalid]
    origin = windows[0].start if windows else 0.0
    ends = [(window.end - origin) / 60 for window in windows]
    limits = {verdict.figure: verdict.limit for verdict in (report.overall.verdicts if report.overall else [])}
    figure, axes = pyplot.subplots(2, 2, figsize=(11, 7), dpi=90)
    latency, kv, queue, load = axes[0][0], axes[0][1], axes[1][0], axes[1][1]
    for key, label, colour in (("ttft_p95_s", "TTFT p95", "tab:blue"), ("itl_p95_s", "ITL p95", "tab:orange"),
                               ("e2e_p95_s", "end-to-end p95", "tab:gray")):
        values = [getattr(window.figures, key) for window in windows]
        latency.plot(ends, [v if v is not None else float("nan") for v in values], marker="o", color=colour, label=label)
        if key in limits:
            latency.axhline(limits[key], color=colour, linestyle="--", linewidth=1, label=f"{label} limit")
    latency.set_ylabel("seconds")
    latency.set_title("Latency per window", fontsize=9)
    _samples(kv, samples.get("kv_cache_usage", []), origin, "KV cache usage", "tab:purple")
    if "kv_cache_usage" in limits:
        kv.axhline(limits["kv_cache_usage"], color="tab:red", linestyle="--", linewidth=1, label="limit")
    kv.set_ylim(0, 1.05)
    bars = kv.twinx()
    bars.bar(ends, [window.figures.preemptions for window in windows], width=0.15 * max(report.window_s / 60, 0.01), color="tab:red",
             alpha=0.35, label="preemptions / window")
    bars.set_ylabel("preemptions per window")
    kv.set_title("KV cache (sampled) and preemptions", fontsize=9)
    _samples(queue, samples.get("running", []), origin, "running", "tab:green")
    _samples(queue, samples.get("waiting", []), origin, "waiting", "tab:red")
    if "waiting_p95" in limits:
        queue.axhline(limits["waiting_p95"], color="tab:red", linestyle="--", linewidth=1, label="waiting limit (p95)")
    queue.set_title("Requests running / waiting (sampled)", fontsize=9)
    load.plot(ends, [window.figures.generation_tokens_per_s for window in windows], marker="o", color="tab:blue", label="generation tokens/s")
    load.set_ylabel("tokens / s")
    rate = load.twinx()
    rate.plot(ends, [window.figures.error_rate if window.figures.error_rate is not None else float("nan") for window in windows],
              marker="x", color="tab:red", label="error rate")
    rate.set_ylabel("error rate")
    load.set_title("Throughput and errors per window", fontsize=9)
    for panel in (latency, kv, queue, load):
        for window in windows:
            if window.breached:
                panel.axvspan((window.start - origin) / 60, (window.end - origin) / 60, color="tab:red", alpha=0.08)
        panel.set_xlabel("minutes since the watch began")
        panel.grid(True, alpha=0.3)
        if panel.get_legend_handles_labels()[0]:
            panel.legend(fontsize=7, loc="upper left")
    who = f"{report.version['model']} v{report.version['version']}" if report.version else report.url
    figure.suptitle(f"quantize watch: {who}, {len(windows)} window(s) of {report.window_s:g} s: {report.verdict}", fontsize=10)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png")
    pyplot.close(figure)
    write_bytes_atomic(path, image.getvalue())  # never through a symbolic link planted at `path`
    return path


def _samples(axes, points: list[tuple[float, float]], origin: float, label: str, colour: str) -> None:
    if points:
        axes.plot([(at - origin) / 60 for at, _ in points], [value for _, value in points], color=colour, label=label, linewidth=1)
