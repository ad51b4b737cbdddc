"""A watch session: windows of a vLLM server's metrics, each judged against its version's envelope, then tuning
recommendations, an optional rollback after a sustained breach, a plot and the report (watch.json).

Live (default): the server's /metrics is read at the start, every `sample_every_s` (gauges), and at each window's end
(counters and histograms as increases). With a Prometheus URL: the last `windows` windows that ended now, from its HTTP API.

The canary: a version whose bundle holds a golden set (evidence/canary.json, pipelines.canary) has it probed against the
server after each live window (with Prometheus: after the last window, the one that ended now); a probe that disagrees
beyond the recorded tolerance, or gets no answer, breaches its window like any figure. Its requests are served by the
watched server, so the next window's figures count them (24 short greedy requests by default).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field

from pipelines.canary.client import server_root
from pipelines.canary.golden import GoldenSet, golden_path, load_golden
from pipelines.canary.probe import probe_canary
from pipelines.console.output import progress
from pipelines.console.redact import without_credentials
from pipelines.deploy.limits import FigureLimit, limits
from pipelines.deploy.spec import ServedSpec
from pipelines.errors import InputError
from pipelines.files.atomic import storage_error, write_text_atomic
from pipelines.registry.store import Registry
from pipelines.schema import FrozenModel
from pipelines.watch.exposition import scrape, window_between
from pipelines.watch.figures import window_figures
from pipelines.watch.plausible import implausible
from pipelines.watch.plots import write_plot
from pipelines.watch.prometheus import PrometheusWindows, instance_of
from pipelines.watch.recommend import recommendations
from pipelines.watch.report import WatchReport, WindowReport
from pipelines.watch.rollback import roll_back
from pipelines.watch.series import WindowData, merged
from pipelines.watch.verdict import breached, judge

REPORT_FILE, PLOT_FILE = "watch.json", "watch.png"
CANARY = "canary"  # the name a canary breach goes by among a window's breached figures


class WatchSettings(FrozenModel):
    url: str
    window_s: float = Field(gt=0)
    windows: int = Field(ge=1)
    sample_every_s: float = Field(gt=0)
    timeout_s: float = Field(gt=0)
    prometheus: str | None = None
    rollback_after: int | None = Field(default=None, ge=1)
    canary_timeout_s: float = Field(default=60.0, gt=0)
    api_key: str | None = Field(default=None, repr=False, exclude=True)  # the server's key for /v1 (VLLM_API_KEY)


def live_windows(client: httpx.Client, settings: WatchSettings, served_name: str | None) -> Iterator[WindowData]:
    """Consecutive windows of the server's /metrics, read live; a server that serves another model than `served_name` is refused."""
    first = scrape(client, settings.url, settings.timeout_s)
    if served_name is not None and first.model_names and served_name not in first.model_names:
        raise InputError(f"the server serves {', '.join(map(repr, first.model_names))}, not {served_name!r} (the version's served name; "
                         "give --served-name if it was deployed under another)", file=without_credentials(settings.url), field="--url")
    for index in range(1, settings.windows + 1):
        deadline = time.monotonic() + settings.window_s
        samples = []
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(settings.sample_every_s, left))
            samples.append(scrape(client, settings.url, settings.timeout_s))
        last = samples[-1] if samples else scrape(client, settings.url, settings.timeout_s)
        yield window_between(index, first, last, samples or [last], without_credentials(settings.url))
        first = last


def prometheus_windows(client: httpx.Client, settings: WatchSettings) -> Iterator[WindowData]:
    assert settings.prometheus is not None
    source = PrometheusWindows(client, settings.prometheus, instance_of(settings.url), timeout_s=settings.timeout_s)
    yield from source.windows(time.time(), settings.window_s, settings.windows)


def watch(settings: WatchSettings, spec: ServedSpec | None, *, registry: Registry | None,
          on_window: Callable[[WindowReport, int], None] = lambda report, total: None) -> tuple[WatchReport, list[WindowData]]:
    """Watch and judge each window; roll back when told to. Returns the report and the windows' raw data (for `finish`)."""
    envelope = spec.require_envelope() if spec is not None else None
    held = limits(envelope) if envelope is not None else []
    report = WatchReport(url=without_credentials(settings.url), source="prometheus" if settings.prometheus else "metrics",
                         prometheus=without_credentials(settings.prometheus) if settings.prometheus else None,
                         window_s=settings.window_s, envelope=envelope, limits=held, version=_version(spec))
    raw: list[WindowData] = []
    run = 0
    golden = _golden(spec, report)
    with httpx.Client(follow_redirects=False) as client:
        served = spec.served_name if spec is not None else None
        source = prometheus_windows(client, settings) if settings.prometheus else live_windows(client, settings, served)
        for data in source:
            raw.append(data)
            window = _judged(data, held)
            if golden is not None and spec is not None and (not settings.prometheus or data.index == settings.windows):
                window = _with_canary(window, golden, settings, spec.served_name)
            report.windows.append(window)
            on_window(window, settings.windows)
            run = run + 1 if window.breached else 0
            if spec is not None and registry is not None and settings.rollback_after and run >= settings.rollback_after:
                evidence = [_window_evidence(w) for w in report.windows[-run:]]
                report.rollback = roll_back(registry, spec, evidence, url=report.url)
                break
    return report, raw


def _judged(data: WindowData, held: list[FigureLimit]) -> WindowReport:
    figures = window_figures(data)
    invalid = implausible(data, figures)
    if invalid:
        progress(f"window {data.index} is invalid, not judged: {'; '.join(invalid[:3])}{' ...' if len(invalid) > 3 else ''}")
    verdicts = judge(figures, held, invalid=bool(invalid))
    return WindowReport(index=data.index, start=data.start, end=data.end, figures=figures, verdicts=verdicts, breached=breached(verdicts),
                        invalid=invalid)


def _golden(spec: ServedSpec | None, report: WatchReport) -> GoldenSet | None:
    """The version's golden set (read from its verified bundle), recorded in the report; None without one."""
    if spec is None:
        return None
    golden = load_golden(spec.folder)
    if golden is None:
        progress(f"{spec.model} v{spec.version}: its bundle holds no golden set (promoted before canaries): no canary probe")
        return None
    report.canary = {"file": str(golden_path(spec.folder)), "prompts": len(golden.prompts),
                     "tolerance": golden.tolerance.model_dump(exclude={"self_checks"})}
    return golden


def _with_canary(window: WindowReport, golden: GoldenSet, settings: WatchSettings, served_name: str) -> WindowReport:
    result = probe_canary(server_root(settings.url), model=served_name, golden=golden, api_key=settings.api_key,
                          timeout_s=settings.canary_timeout_s)
    # An invalid window is never judged (docs/watch.md): the probe is recorded, its failure breaches nothing and so
    # cannot continue a run of breaching windows into a rollback.
    breached = window.breached + ([CANARY] if not result.healthy and not window.invalid else [])
    return window.model_copy(update={"canary": result, "breached": breached})


def _window_evidence(window: WindowReport) -> dict[str, Any]:
    return {"index": window.index, "start": _stamp(window.start), "end": _stamp(window.end), "breached": window.breached,
            "values": {v.figure: v.value for v in window.verdicts if v.verdict == "breach"},
            "limits": {v.figure: v.limit for v in window.verdicts if v.verdict == "breach"},
            **({"canary": window.canary.summary()} if window.canary is not None and not window.canary.healthy else {})}


def finish(report: WatchReport, raw: list[WindowData], spec: ServedSpec | None, out: Path) -> WatchReport:
    """The whole session's figures and verdict, the recommendations; watch.png and watch.json written into `out`."""
    valid = [data for data, window in zip(raw, report.windows, strict=False) if not window.invalid]
    report.overall = _judged(merged(valid), report.limits) if valid else None
    report.breached_windows = [window.index for window in report.windows if window.breached]
    report.invalid_windows = [window.index for window in report.windows if window.invalid]
    report.verdict = ("breach" if report.breached_windows and spec is not None else "invalid" if report.invalid_windows
                      else "figures only" if spec is None else "within")
    if spec is not None:
        found, notes = recommendations(spec, [(w.index, w.start, w.end, w.figures) for w in report.windows if not w.invalid],
                                       next((data.kv for data in reversed(raw) if data.kv is not None), None))
        report.recommendations, report.recommendation_notes = found, notes
    check_out_folder(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise storage_error(error, out) from error
    report.folder = str(out)
    if raw:
        report.plot = str(write_plot(report, out / PLOT_FILE, merged(valid).gauges if valid else {}))
    write_text_atomic(out / REPORT_FILE, json.dumps(report.document(), indent=2) + "\n")
    return report


def check_out_folder(out: Path) -> None:
    """A symbolic link as the report's folder is refused: what is written there must land in the folder named, not elsewhere."""
    if out.is_symlink():
        raise InputError("is a symbolic link: give the folder itself", file=out, field="--out")
    if out.exists() and not out.is_dir():
        raise InputError("is not a folder", file=out, field="--out")


def _version(spec: ServedSpec | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {"model": spec.model, "version": spec.version, "alias": spec.alias, "reference": spec.reference, "served_name": spec.served_name,
            "folder": str(spec.folder), "signed": spec.signed, "recipe": spec.recipe, "notes": spec.notes}


def _stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds")


def default_folder(root: Path, spec: ServedSpec | None) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    who = f"{spec.model}-v{spec.version}" if spec is not None else "server"
    return root / "watch" / f"{stamp}-{who}-{os.getpid()}"
