"""The files a deployment of one served spec needs, all derived from the version's own evidence:

- serve.sh: the vLLM command with the measured arguments (pipelines/deploy/spec.py says where each came from);
- prometheus.yml: a scrape config for the server (its job named after the model) that loads the alert rules;
- alert-rules.yml: multiwindow burn-rate alerts (page, ticket) on the SLOs, errors and latency over the same limits
  `quantize watch` holds the version to (pipelines/deploy/slo.py), a page on any corrupted request (NaN logits), a ticket on
  overload (admission rejections), a ticket per capacity figure outside the envelope over one window (pipelines/deploy/limits.py:
  the tighter of the policy's production SLO and the load test's own figure x tolerance), a page when the target is down;
- alert-rules.test.yml: `promtool test rules` input that must fire each alert and must not (pipelines/deploy/rule_tests.py);
- grafana-dashboard.json: a dashboard of the same figures, each panel with its limit as a threshold line;
- spec.json: the served spec, the limits and where each came from.

The Prometheus files are checked by Prometheus' own `promtool check config|rules` and `promtool test rules` in the tests
(Debian's prometheus package).
"""

from __future__ import annotations

import json
import shlex
import stat
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from pipelines.bounds import MiB
from pipelines.deploy.limits import FigureLimit, limits
from pipelines.deploy.promql import duration, error_rates, job_name, selector
from pipelines.deploy.rule_tests import rule_tests
from pipelines.deploy.slo import HEALTH_FIGURES, SLO_FIGURES, health_rules, slo_rules, slos
from pipelines.deploy.spec import ServedSpec
from pipelines.errors import InputError
from pipelines.files.atomic import atomic_dir, folder_mode
from pipelines.files.jsonio import parse_json_strict
from pipelines.files.run_input import read_regular
from pipelines.schema import FrozenModel
from pipelines.serve.serving import VLLM_SERVER_MODULE
from pipelines.serve.vllm_series import (
    ADMISSION_REJECTIONS,
    CORRUPTED_REQUESTS,
    COUNTERS,
    GAUGES,
    GROUPED_COUNTERS,
    HISTOGRAMS,
    RESIDENT_MEMORY,
)

SERVE_SCRIPT, PROMETHEUS_CONFIG, ALERT_RULES, ALERT_TESTS, DASHBOARD, SPEC_FILE = (
    "serve.sh", "prometheus.yml", "alert-rules.yml", "alert-rules.test.yml", "grafana-dashboard.json", "spec.json")
DEPLOY_FILES = (SERVE_SCRIPT, PROMETHEUS_CONFIG, ALERT_RULES, ALERT_TESTS, DASHBOARD, SPEC_FILE)
WRITTEN_BY = "quantize deploy"
MAX_SPEC_BYTES = 16 * MiB  # an earlier spec.json, read back only for its written_by


class DeploySettings(FrozenModel):
    """How the deployment is reached and watched (not measured: the operator's choice)."""

    metrics_target: str = "localhost:8000"  # HOST:PORT Prometheus scrapes (its `instance` label; `quantize watch --url` names it)
    port: int = 8000
    scrape_interval_s: int = 15
    window_s: int = 300
    alert_for_s: int = 60


def figure_queries(spec: ServedSpec, window_s: int) -> dict[str, str]:
    """PromQL for each watched figure but the error rate (error_rates) over one window, as `quantize watch` computes it."""
    w, sel = duration(window_s), selector(spec)

    return {
        "ttft_p95_s": quantile(0.95, "ttft", sel, w),
        "itl_p95_s": quantile(0.95, "itl", sel, w),
        "kv_cache_usage": f"max(max_over_time({GAUGES['kv_cache_usage']}{sel}[{w}]))",
        "preemptions": f"sum(increase({COUNTERS['preemptions']}{sel}[{w}]))",
        "waiting_p95": f"max(quantile_over_time(0.95, {GAUGES['waiting']}{sel}[{w}]))",
        "memory_bytes": f"max(max_over_time({RESIDENT_MEMORY}{sel}[{w}]))",
    }


def quantile(q: float, histogram: str, sel: str, w: str) -> str:
    """The `q` quantile of one of vLLM's histograms (HISTOGRAMS key) over a window, its series summed."""
    return f"histogram_quantile({q}, sum by (le) (rate({HISTOGRAMS[histogram]}_bucket{sel}[{w}])))"


def _rate(counter: str, sel: str, w: str, by: str = "") -> str:
    return f"sum{f' by ({by}) ' if by else ''}(rate({counter}{sel}[{w}]))"


_ALERT_NAMES = {  # the envelope's capacity figures; the SLO figures have burn-rate rules (pipelines/deploy/slo.py)
    "kv_cache_usage": ("KvCacheUsage", "peak KV cache usage"), "preemptions": ("Preemptions", "preemptions"),
    "waiting_p95": ("QueueLength", "p95 of waiting requests"), "memory_bytes": ("Memory", "API server memory"),
}


def alert_rules(spec: ServedSpec, settings: DeploySettings) -> dict[str, Any]:
    """One group: the SLOs' recording rules and burn-rate alerts, corrupted output and overload, a ticket per capacity figure
    outside the envelope over one window, a page when the target is down."""
    envelope = spec.require_envelope()
    labels = {"model": spec.model, "version": str(spec.version), "served_name": spec.served_name}
    rules = slo_rules(spec, labels) + health_rules(spec, settings.window_s, settings.alert_for_s, labels)
    queries = figure_queries(spec, settings.window_s)
    for limit in limits(envelope):
        if limit.figure in SLO_FIGURES or limit.figure in HEALTH_FIGURES:
            continue
        name, words = _ALERT_NAMES[limit.figure]
        rules.append({
            "alert": f"Vllm{name}OutsideEnvelope", "expr": f"{queries[limit.figure]} > {limit.limit:g}", "for": duration(settings.alert_for_s),
            "labels": {**labels, "severity": "ticket", "figure": limit.figure},
            "annotations": {
                "summary": f"{spec.model} v{spec.version}: {words} over {limit.limit:g} in the last {duration(settings.window_s)}",
                "description": f"limit: {limit.source}",
            },
        })
    rules.append({
        "alert": "VllmTargetDown", "expr": f'up{{job="{job_name(spec)}"}} == 0', "for": "1m",
        "labels": {**labels, "severity": "page", "figure": "up"},
        "annotations": {"summary": f"{spec.model} v{spec.version}: Prometheus cannot scrape the vLLM server", "description": "up == 0"},
    })
    return {"groups": [{"name": f"quantgate-{spec.model}-v{spec.version}", "interval": duration(settings.scrape_interval_s),
                        "rules": rules}]}


def prometheus_config(spec: ServedSpec, settings: DeploySettings, rules_file: str = ALERT_RULES) -> dict[str, Any]:
    interval = duration(settings.scrape_interval_s)
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [rules_file],
        "scrape_configs": [{
            "job_name": job_name(spec), "metrics_path": "/metrics", "scrape_interval": interval,
            "static_configs": [{"targets": [settings.metrics_target],
                                "labels": {"model": spec.model, "served_name": spec.served_name,
                                           **({"alias": spec.alias} if spec.alias else {})}}],
        }],
    }


def serve_script(spec: ServedSpec, settings: DeploySettings) -> str:
    environment = "".join(f"export {key}={shlex.quote(value)}\n" for key, value in spec.args.environment().items())
    arguments = " \\\n  ".join(
        [f"--model {shlex.quote(str(spec.folder))}", f"--served-model-name {shlex.quote(spec.served_name)}",
         '--host "${VLLM_HOST:-0.0.0.0}"', f'--port "${{VLLM_PORT:-{settings.port}}}"', " ".join(spec.args.cli_args())])
    sources = "".join(f"#   {key}: {value}\n" for key, value in spec.args.sources.items())
    notes = "".join(f"# note: {note}\n" for note in spec.notes)
    return (
        "#!/bin/sh\n"
        f"# {spec.model} v{spec.version} ({spec.reference}), served as {spec.served_name!r}: written by `{WRITTEN_BY}` from the version's\n"
        f"# verified {'signed bundle' if spec.signed else 'artifact'}. Where each argument came from:\n{sources}{notes}"
        "# vLLM reads its API key from VLLM_API_KEY (set it in the environment, never on a command line). Its statistics stay on\n"
        "# (no --disable-log-stats): the alert rules and `quantize watch` read its /metrics.\n"
        "set -eu\n"
        f"{environment}"
        f'exec "${{VLLM_PYTHON:-python3}}" -m {VLLM_SERVER_MODULE} \\\n  {arguments}\n'
    )


def dashboard(spec: ServedSpec, settings: DeploySettings) -> dict[str, Any]:
    """A Grafana dashboard (schema 39) of the watched figures, each limit a red threshold."""
    found = {limit.figure: limit for limit in limits(spec.require_envelope())}
    queries = figure_queries(spec, settings.window_s)
    sel, w = selector(spec), duration(settings.window_s)
    finished, reason = GROUPED_COUNTERS["finished"]
    panels = [
        _panel("TTFT p50 / p95 / p99 (s)", "s", [quantile(q, "ttft", sel, w) for q in (0.5, 0.95, 0.99)], found.get("ttft_p95_s")),
        _panel("ITL p95 (s)", "s", [queries["itl_p95_s"]], found.get("itl_p95_s")),
        _panel("End-to-end latency p95 (s)", "s", [quantile(0.95, "e2e", sel, w)], None),
        _panel("Generation tokens / s", "short", [_rate(COUNTERS["generation_tokens"], sel, w)], None),
        _panel("Requests / s by finish reason", "reqps", [_rate(finished, sel, w, by=reason)], None),
        _panel("Error rate: engine (error, abort) and HTTP (5xx)", "percentunit", list(error_rates(spec, settings.window_s)),
               found.get("error_rate")),
        _panel("Corrupted requests (NaN logits) and admission rejections (overload) per window", "short",
               [f"sum(increase({CORRUPTED_REQUESTS}{sel}[{w}]))", f"sum(increase({ADMISSION_REJECTIONS}{sel}[{w}]))"], None),
        _panel("KV cache usage", "percentunit", [f"sum({GAUGES['kv_cache_usage']}{sel})"], found.get("kv_cache_usage")),
        _panel("Preemptions per window", "short", [queries["preemptions"]], found.get("preemptions")),
        _panel("Running / waiting requests", "short", [f"sum({GAUGES['running']}{sel})", f"sum({GAUGES['waiting']}{sel})"],
               found.get("waiting_p95")),
        _panel("Batch size (tokens per step) p50 / p95", "short", [quantile(q, "batch_tokens", sel, w) for q in (0.5, 0.95)], None),
        _panel("Prefix cache hit rate", "percentunit",
               [f"{_rate(COUNTERS['prefix_cache_hits'], sel, w)} / {_rate(COUNTERS['prefix_cache_queries'], sel, w)}"], None),
        _panel("API server memory (RSS)", "bytes", [f"sum({RESIDENT_MEMORY}{sel})"], found.get("memory_bytes")),
    ]
    for index, panel in enumerate(panels):
        panel.update(id=index + 1, gridPos={"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)})
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus"}],
        "title": f"vLLM {spec.served_name}: {spec.model} v{spec.version} against its envelope", "uid": f"quantgate-{spec.model}"[:40],
        "schemaVersion": 39, "version": 1, "editable": True, "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "tags": ["quantgate", "vllm"], "panels": panels,
    }


def _panel(title: str, unit: str, expressions: list[str], limit: FigureLimit | None) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if limit is not None:
        steps.append({"color": "red", "value": limit.limit})
    return {
        "type": "timeseries", "title": title, "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
        "description": f"limit: {limit.source}" if limit is not None else "",
        "targets": [{"expr": expr, "refId": chr(ord("A") + i), "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}}
                    for i, expr in enumerate(expressions)],
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps},
                                     "custom": {"thresholdsStyle": {"mode": "line" if limit is not None else "off"}}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
    }


def dashboard_expressions(document: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard (the tests have Prometheus parse each one)."""
    return [target["expr"] for panel in document.get("panels", []) for target in panel.get("targets", [])]


def spec_document(spec: ServedSpec, settings: DeploySettings) -> dict[str, Any]:
    envelope = spec.require_envelope()
    return {
        "written_by": WRITTEN_BY, "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "spec": spec.model_dump(mode="json"), "settings": settings.model_dump(mode="json"),
        "limits": [limit.model_dump(mode="json") for limit in limits(envelope)],
        "slos": [slo.model_dump(mode="json") for slo in slos(spec)],
    }


def render_files(spec: ServedSpec, settings: DeploySettings) -> dict[str, str]:
    """File name -> content of every deployment file."""
    rules = alert_rules(spec, settings)
    return {
        SERVE_SCRIPT: serve_script(spec, settings),
        PROMETHEUS_CONFIG: yaml.safe_dump(prometheus_config(spec, settings), sort_keys=False, width=1000),
        ALERT_RULES: yaml.safe_dump(rules, sort_keys=False, width=1000),
        ALERT_TESTS: yaml.safe_dump(rule_tests(spec, rules, ALERT_RULES, window_s=settings.window_s, alert_for_s=settings.alert_for_s),
                                    sort_keys=False, width=1000),
        DASHBOARD: json.dumps(dashboard(spec, settings), indent=2) + "\n",
        SPEC_FILE: json.dumps(spec_document(spec, settings), indent=2) + "\n",
    }


def is_deploy_folder(folder: Path) -> bool:
    """Whether `folder` holds only what an earlier `quantize deploy` wrote (then it may be replaced). Its spec.json is read
    through the product's one reader of run-folder files: a link, a FIFO or a device there, or a file over MAX_SPEC_BYTES,
    is refused before it is read."""
    names = {path.name for path in folder.iterdir()}
    if not names:
        return True
    if not names <= set(DEPLOY_FILES) or SPEC_FILE not in names:
        return False
    if any(not _regular(folder / name) for name in names - {SPEC_FILE}):
        return False  # deploy writes files only: a folder or a link under one of its names is someone else's (never removed)
    spec_file = folder / SPEC_FILE
    raw = read_regular(spec_file, SPEC_FILE, MAX_SPEC_BYTES, field="--out")
    try:
        document = parse_json_strict(raw, spec_file)
    except InputError:
        return False
    return isinstance(document, dict) and document.get("written_by") == WRITTEN_BY


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def write_deployment(spec: ServedSpec, settings: DeploySettings, out: Path) -> dict[str, Path]:
    """Every deployment file in `out`, all at once (a folder written aside and renamed into place). An existing `out` is
    replaced only when it is empty or holds an earlier deployment's files, never a folder of anything else."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InputError("not a folder", file=out, field="--out")
    if out.is_dir() and not is_deploy_folder(out):
        raise InputError(f"holds files `{WRITTEN_BY}` did not write; give an empty or new folder", file=out, field="--out")
    contents = render_files(spec, settings)
    with atomic_dir(out) as staging:
        for name, text in contents.items():
            (staging / name).write_text(text)
        (staging / SERVE_SCRIPT).chmod(folder_mode())  # executable, as the umask lets a new folder be
    return {name: out / name for name in contents}
