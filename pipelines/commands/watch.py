"""`quantize watch --url URL [--version NAME@ALIAS] [--window 5m] [--windows N] [--prometheus URL] [--json]`: a deployed vLLM
server's metrics, window by window, against the envelope its version was promoted on (docs/watch.md).

Exit 0: every window within the envelope (or no --version: the figures alone); 1: a window breached it; 2: any error."""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

from pipelines.canary.client import API_KEY_ENV
from pipelines.commands.args import duration_arg, int_arg
from pipelines.console.output import emit, progress, say, table
from pipelines.console.redact import without_credentials
from pipelines.deploy.spec import served_spec
from pipelines.errors import EXIT_ERROR, EXIT_OK, EXIT_REJECTED, InputError
from pipelines.registry.store import open_registry
from pipelines.settings import current as current_settings
from pipelines.watch.exposition import metrics_url
from pipelines.watch.report import WatchReport, WindowReport
from pipelines.watch.session import WatchSettings, check_out_folder, default_folder, finish, watch
from pipelines.watch.shadow import read_sample, shadow_report

MAX_WINDOWS = 10_000


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("watch", description="Read a deployed vLLM server's metrics window by window and hold each figure to "
                                   "the envelope its registry version was promoted on (exit 0 within, 1 breach, 2 error).")
    parser.add_argument("--url", required=True, help="the vLLM server: its base URL, e.g. http://127.0.0.1:8000, or its metrics page, "
                        "http://127.0.0.1:8000/metrics (with --prometheus: the target as Prometheus scrapes it)")
    parser.add_argument("--version", metavar="NAME@ALIAS", default=None,
                        help="the registry version deployed there (verified first); without it, the figures alone and exit 0")
    parser.add_argument("--served-name", default=None, help="the model name the server serves, when deployed under another than the "
                        "model's (quantize deploy --served-name)")
    parser.add_argument("--window", type=duration_arg(1, 86_400), default=300.0, metavar="DURATION", help="window length (default: 5m)")
    parser.add_argument("--windows", type=int_arg(1, MAX_WINDOWS), default=1, help="windows to watch (default: 1)")
    parser.add_argument("--sample-every", type=duration_arg(0.2, 3600), default=None, metavar="DURATION",
                        help="how often gauges are sampled in a live window (default: window/30, 1 s to 15 s)")
    parser.add_argument("--prometheus", metavar="URL", default=None,
                        help="read the last N windows from this Prometheus server's HTTP API instead of the live page")
    parser.add_argument("--timeout", type=duration_arg(0.1, 600), default=10.0, metavar="DURATION",
                        help="the longest one read of the page (or one Prometheus query) may take (default: 10s)")
    parser.add_argument("--rollback-after", type=int_arg(1, MAX_WINDOWS), default=None, metavar="N",
                        help="after N consecutive breaching windows, move --version's alias to the previous version that verifies")
    parser.add_argument("--shadow", type=Path, default=None, metavar="SAMPLE.jsonl",
                        help="replay these production prompts against the version and its 16-bit baseline, paired (docs/watch.md)")
    parser.add_argument("--shadow-items", type=int_arg(1, 100_000), default=200, help="prompts replayed at most (default: 200)")
    parser.add_argument("--out", type=Path, default=None, help="folder for watch.json and watch.png (default: artifacts/watch/<stamp>)")
    parser.add_argument("--registry", metavar="PATH", type=Path, default=None,
                        help="registry database (default: $QUANTGATE_REGISTRY or artifacts/registry.db)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.set_defaults(handler=_watch)


def _watch(args: argparse.Namespace) -> int:
    _check_options(args)
    if args.prometheus is None:
        args.url = metrics_url(args.url)  # the page read live, whichever of the server's URLs was given
    registry = open_registry(args.registry) if args.version else None
    # The runtime is compared where it can be read: a server on this machine (a remote one runs on its own host's).
    spec = served_spec(args.version, registry=registry, served_name=args.served_name,
                       check_runtime=_on_this_machine(args.url)) if args.version else None
    if spec is not None:
        spec.require_envelope()
        progress(f"{spec.model} v{spec.version} verified; holding {without_credentials(args.url)} to the envelope it was promoted on")
    settings = WatchSettings(url=args.url, window_s=args.window, windows=args.windows, timeout_s=args.timeout, prometheus=args.prometheus,
                             sample_every_s=args.sample_every or min(15.0, max(1.0, args.window / 30)), rollback_after=args.rollback_after,
                             api_key=os.environ.get(API_KEY_ENV) or None)
    out = args.out or default_folder(current_settings().artifacts_dir, spec)
    check_out_folder(out)  # before the watch, not after it
    if args.shadow is not None:
        check_out_folder(out / "shadow")  # the replay's server logs
    report, raw = watch(settings, spec, registry=registry, on_window=_window_line)
    if args.shadow is not None and spec is not None and registry is not None:
        gate = registry.show(spec.model, spec.version).gate
        assert gate is not None  # served_spec refuses a version without gate evidence
        progress(f"shadow: replaying {args.shadow} against {spec.model} v{spec.version} and its 16-bit baseline")
        report.shadow = shadow_report(spec, gate, args.shadow, max_items=args.shadow_items, logs=out / "shadow")
    finish(report, raw, spec, out)
    emit(report.document(), as_json=args.json, render=lambda _: _render(report))
    if report.verdict == "invalid":
        progress(f"window(s) {', '.join(map(str, report.invalid_windows))} held figures no server can produce: not judged, exit 2")
        return EXIT_ERROR
    return EXIT_REJECTED if report.verdict == "breach" else EXIT_OK


def _on_this_machine(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_options(args: argparse.Namespace) -> None:
    if args.rollback_after is not None:
        if args.version is None or "@" not in args.version or args.version.rpartition("@")[2].isdigit():
            raise InputError("needs --version NAME@ALIAS: a rollback moves an alias", field="--rollback-after")
        if args.rollback_after > args.windows:
            raise InputError(f"{args.rollback_after} consecutive windows cannot breach in {args.windows} (--windows)", field="--rollback-after")
    if args.shadow is not None and args.version is None:
        raise InputError("needs --version: the shadow replay serves that version and its 16-bit baseline", field="--shadow")
    if args.sample_every is not None and args.sample_every > args.window:
        raise InputError(f"samples every {args.sample_every:g} s in a window of {args.window:g} s", field="--sample-every")
    if args.shadow is not None:
        read_sample(args.shadow, args.shadow_items)  # a bad sample is refused before anything is resolved or watched


def _window_line(window: WindowReport, total: int) -> None:
    f = window.figures
    state = f"BREACH ({', '.join(window.breached)})" if window.breached else ("within" if window.verdicts else "figures")
    if window.invalid:
        state = "INVALID, not judged" + (f"; BREACH ({', '.join(window.breached)})" if window.breached else "")
    progress(f"window {window.index}/{total}: {f.requests:g} requests, TTFT p95 {_s(f.ttft_p95_s)}, ITL p95 {_s(f.itl_p95_s)}, "
             f"KV peak {_pct(f.kv_cache_usage)}, {f.preemptions:g} preemptions, waiting p95 {_n(f.waiting_p95)}: {state}")
    if window.canary is not None:
        progress(f"window {window.index}/{total}: canary: {window.canary.summary()} ({window.canary.wall_s:.1f} s)")


ROWS = [
    ("requests", "requests finished", "n"), ("requests_per_s", "requests / s", "n"), ("ttft_p50_s", "TTFT p50", "s"),
    ("ttft_p95_s", "TTFT p95", "s"), ("ttft_p99_s", "TTFT p99", "s"), ("itl_p95_s", "ITL p95", "s"), ("itl_p99_s", "ITL p99", "s"),
    ("e2e_p50_s", "end-to-end p50", "s"), ("e2e_p95_s", "end-to-end p95", "s"), ("tpot_p95_s", "TPOT p95", "s"),
    ("generation_tokens_per_s", "generation tokens / s", "n"), ("error_rate", "error rate", "%"), ("errors", "errors", "n"),
    ("aborts", "aborts", "n"), ("http_5xx", "HTTP 5xx", "n"),
    ("admission_rejections", "admission rejections (503, overload)", "n"), ("corrupted_requests", "corrupted requests (NaN logits)", "n"),
    ("kv_cache_usage", "KV cache peak", "%"),
    ("kv_cache_usage_mean", "KV cache mean", "%"), ("prefix_cache_hit_rate", "prefix cache hit rate", "%"),
    ("preemptions", "preemptions", "n"), ("running_mean", "running (mean)", "n"), ("running_max", "running (max)", "n"),
    ("waiting_mean", "waiting (mean)", "n"), ("waiting_p95", "waiting (p95)", "n"), ("waiting_max", "waiting (max)", "n"),
    ("batch_tokens_p50", "batch tokens p50", "n"), ("batch_tokens_p95", "batch tokens p95", "n"), ("memory_bytes", "API server RSS", "b"),
]
MAX_WINDOW_COLUMNS = 6


def _render(report: WatchReport) -> None:
    shown = report.windows[-MAX_WINDOW_COLUMNS:]
    limits = {limit.figure: limit for limit in report.limits}
    overall = {v.figure: v for v in report.overall.verdicts} if report.overall else {}
    columns = ["figure", "limit", *[f"window {w.index}" for w in shown], "all windows", "verdict"]
    rows = []
    for key, label, unit in ROWS:
        limit = limits.get(key)
        cells = [_format(getattr(w.figures, key), unit) + (" !" if key in w.breached else "") for w in shown]
        verdict = overall.get(key)
        rows.append([label, _format(limit.limit, unit) if limit else "-", *cells,
                     _format(getattr(report.overall.figures, key), unit) if report.overall else "-",
                     _verdict(key, shown, verdict.verdict if verdict else "")])
    who = f"{report.version['model']} v{report.version['version']} ({report.version['reference']})" if report.version else "no version given"
    say(table(f"quantize watch {report.url}: {who}, windows of {report.window_s:g} s ('!': breach)", columns, rows))
    for limit in report.limits:
        say(f"limit {limit.figure}: {limit.source}")
    for item in report.recommendations:
        check = "fits" if item.planner.fits else "does NOT fit"
        say(f"recommendation ({item.kind}): {item.text} [planner: {check}; {item.planner.detail}]")
    for note in report.recommendation_notes:
        say(f"note: {note}")
    if report.rollback is not None:
        moved = report.rollback
        where = f"-> v{moved.to_version}" if moved.moved else "not moved"
        say(f"rollback: {moved.model}@{moved.alias} v{moved.from_version} {where}: {moved.reason}")
        for skipped in moved.skipped:
            say(f"  skipped v{skipped.version}: {skipped.why}")
    for window in report.windows:
        if window.canary is not None and not window.canary.healthy:
            say(f"canary window {window.index}: {window.canary.summary()}")
            for prompt in window.canary.checks:
                if prompt.disagrees:
                    say(f"  {prompt.id}: {prompt.reason}")
    if report.shadow is not None:
        for line in report.shadow.get("lines", []):
            say(f"shadow: {line}")
    flagged = report.breached_windows or report.invalid_windows
    say(f"verdict: {report.verdict}" + (f" (windows {', '.join(map(str, flagged))})" if flagged else "")
        + f"; report {report.folder}/watch.json" + (f", plot {report.plot}" if report.plot else ""))


def _verdict(key: str, windows: list[WindowReport], overall: str) -> str:
    if any(key in w.breached for w in windows):
        return "BREACH"
    return overall or ""


def _format(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return _s(value)
    if unit == "%":
        return _pct(value)
    if unit == "b":
        return f"{value / 2**20:,.0f} MiB"
    return _n(value)


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _n(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
