"""Throughput and TTFT p95 against concurrency, baseline and candidate on the same axes (PNG, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

from pipelines.loadtest.results import ModelFigures

PLOTS = {
    "throughput": ("loadtest-throughput.png", "Output throughput (tokens/s)", lambda level: level.output_throughput),
    "ttft_p95": ("loadtest-ttft-p95.png", "TTFT p95 (ms)", lambda level: level.ttft_ms.p95),
}
STYLE = {"baseline": ("tab:blue", "o"), "candidate": ("tab:orange", "s")}


def write_plots(models: list[ModelFigures], folder: Path, title: str) -> dict[str, str]:
    """One PNG per figure in `folder`; returns {figure: file name}."""
    import matplotlib  # heavy: imported when used

    matplotlib.use("Agg")
    from matplotlib import pyplot  # heavy: imported when used

    written = {}
    for key, (name, label, value) in PLOTS.items():
        figure, axes = pyplot.subplots(figsize=(6, 4), dpi=100)
        for model in models:
            colour, marker = STYLE[model.role]
            levels = [level.concurrency for level in model.levels]
            axes.plot(levels, [value(level) for level in model.levels], marker=marker, color=colour, label=model.role)
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted({level.concurrency for model in models for level in model.levels}))
        axes.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axes.set_xlabel("concurrency (requests in flight)")
        axes.set_ylabel(label)
        axes.set_ylim(bottom=0)
        axes.set_title(f"{label}: {title}", fontsize=9)
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(folder / name)
        pyplot.close(figure)
        written[key] = name
    return written
