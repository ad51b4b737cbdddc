"""A row from what the runner left: its outcome, the artifact's manifest, gate.json; or a refusal or failure in one line.

The backend's name, version and checkpoint format come from the manifest's `backend` record; a manifest written before
backends were recorded is llm-compressor's, its version in the manifest's versions and its format in config.json.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.artifact import CONFIG_NAME, Manifest, read_config_json, read_manifest
from pipelines.bakeoff.plan import PlannedRow
from pipelines.bakeoff.records import BackendRecord, BakeoffRow, RowStatus, SetBound, SpeedOutcome, SpeedRecord
from pipelines.errors import InputError
from pipelines.gate.schema import GateReport
from pipelines.loadtest.results import PerformanceSummary
from pipelines.recipe import DEFAULT_BACKEND
from pipelines.runs.runner import RunOutcome

DECIDED: frozenset[str] = frozenset({"faster", "slower", "no difference"})
LLM_COMPRESSOR_PACKAGE = "llmcompressor"  # the distribution whose version a manifest from before backends records


def unrun_row(index: int, planned: PlannedRow, status: RowStatus, reason: str, wall_s: float) -> BakeoffRow:
    """A refused or failed row: its one line, nothing measured."""
    return BakeoffRow(index=index, recipe=planned.recipe, recipe_name=_run_name(planned), backend=BackendRecord(name=planned.backend),
                      status=status, reason=reason, wall_s=round(wall_s, 1))


def _run_name(planned: PlannedRow) -> str:
    return planned.loaded.name if planned.loaded is not None else planned.recipe


def row_from_outcome(index: int, planned: PlannedRow, outcome: RunOutcome, *, wall_s: float, peak_before: int) -> BakeoffRow:
    """A gated row. Reading gate.json may raise the product's errors (the caller makes them a failed row)."""
    report = outcome.gate_report()
    manifest = read_manifest(outcome.artifact_dir)
    reused = _reused(report, outcome)
    peak = manifest.peak_memory.bytes if manifest is not None else None
    return BakeoffRow(
        index=index, recipe=planned.recipe, recipe_name=_run_name(planned), backend=backend_record(manifest, planned.backend, outcome.artifact_dir),
        status="passed" if outcome.verdict == "promoted" else "rejected", reason=_first_reason(outcome.reasons), reasons=outcome.reasons,
        weight_bytes=manifest.weight_bytes.after if manifest is not None else None,
        baseline_weight_bytes=manifest.weight_bytes.before if manifest is not None else None,
        bytes_ratio=round(manifest.weight_bytes.ratio, 4) if manifest is not None else None,
        artifact_bytes=folder_bytes(outcome.artifact_dir), speed=speed_record(outcome.performance), sets=set_bounds(report),
        quantize_s=manifest.wall_time_s if manifest is not None else None, quantize_reused=reused, peak_memory_bytes=peak,
        peak_memory_upper_bound=peak is not None and reused is False and _in_process(planned.backend) and peak <= peak_before,
        wall_s=round(wall_s, 1), run_dir=str(outcome.run_dir), artifact_dir=str(outcome.artifact_dir),
    )


def backend_record(manifest: Manifest | None, backend: str, artifact_dir: Path) -> BackendRecord:
    """The manifest's backend record; a manifest written before backends were recorded is llm-compressor's."""
    recorded = manifest.backend if manifest is not None else None
    if recorded is not None:
        return BackendRecord(name=recorded.name, version=recorded.version or None, format=recorded.checkpoint_format)
    version = manifest.versions.get(LLM_COMPRESSOR_PACKAGE) if manifest is not None and backend == DEFAULT_BACKEND else None
    return BackendRecord(name=backend, version=version, format=_quant_method(artifact_dir))


def _in_process(backend: str) -> bool:
    """Whether the backend quantizes in this process (every backend but the default has an environment of its own,
    pipelines/quantize/backends): then its manifest's peak RSS is this process's, which earlier rows may have raised."""
    return backend == DEFAULT_BACKEND


def _quant_method(artifact_dir: Path) -> str | None:
    try:
        quantization = read_config_json(artifact_dir / CONFIG_NAME).get("quantization_config")
    except InputError:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return method if isinstance(method, str) else None


def _reused(report: GateReport, outcome: RunOutcome) -> bool | None:
    """Whether the runner reused an existing artifact instead of quantizing (gate.json's inputs say; else its stages)."""
    recorded = report.inputs.get("quantize_reused")
    if isinstance(recorded, bool):
        return recorded
    return None if "quantize_s" not in outcome.stages else outcome.stages["quantize_s"] == 0.0


def _first_reason(reasons: list[str]) -> str | None:
    if not reasons:
        return None
    return reasons[0] + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else "")


def folder_bytes(folder: Path) -> int | None:
    try:
        return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    except OSError:
        return None


def set_bounds(report: GateReport) -> list[SetBound]:
    return [
        SetBound(eval_set=s.eval_set, unit=s.unit, worst_bound=s.worsening_bound if s.worsening_bound is not None else s.worst_bound,
                 tolerance=s.tolerance, passed=s.passed)
        for s in report.gate.sets
    ]


def speed_record(performance: PerformanceSummary | None) -> SpeedRecord:
    """The load test's throughput conclusion; without an interval nothing is decided, whatever the summary says."""
    if performance is None or performance.throughput_ratio is None:
        return SpeedRecord()
    interval = performance.throughput_interval
    outcome: SpeedOutcome = performance.speed or "inconclusive"
    if outcome in DECIDED and (interval is None or not _decides(outcome, interval)):
        outcome = "inconclusive"
    return SpeedRecord(throughput_ratio=performance.throughput_ratio, interval=interval, outcome=outcome, pairs=performance.pairs,
                       concurrency=performance.deployment_concurrency)


def _decides(outcome: str, interval: list[float]) -> bool:
    """An interval can only say faster when wholly above 1, slower when wholly below."""
    low, high = interval
    return (outcome != "faster" or low > 1.0) and (outcome != "slower" or high < 1.0)
