"""The bake-off's fixtures: a planned bake-off on the gate workspace (tests/fakes.py) and a fake row runner that stands in
for quantize_and_gate: per recipe run name a verdict with its figures (or an exception), the artifact and its
manifest.json written as quantize leaves them, gate.json's report as the runner makes it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fakes import gate_report, gate_settings

from pipelines.artifact import MANIFEST_NAME, BackendRecord, Manifest, PeakMemory, WeightBytes, artifact_file_hashes
from pipelines.bakeoff.plan import BakeoffPlan, plan_bakeoff
from pipelines.bounds import MiB
from pipelines.loadtest.results import PerformanceSummary
from pipelines.recipe import DEFAULT_BACKEND, LoadedRecipe
from pipelines.runs.runner import GateSettings, RunOutcome

BASELINE_BYTES = 4_000_000


class FakeRowRunner:
    """quantize_and_gate's stand-in. `behaviour[run name]`: an exception to raise, or a dict with `verdict` (promoted),
    `bytes` (weight bytes after; the 16-bit model's are BASELINE_BYTES), `speed` ((ratio, (low, high) or None, outcome): the
    load test's headline), `quantize_s`, `peak` (bytes), `reused` (False)."""

    baseline_bytes = BASELINE_BYTES

    def __init__(self, root: Path, behaviour: dict[str, Any]):
        self.root = root
        self.behaviour = behaviour
        self.calls: list[tuple[str, str, GateSettings]] = []

    def __call__(self, loaded: LoadedRecipe, model_dir: Path, settings: GateSettings) -> RunOutcome:
        self.calls.append((loaded.name, loaded.recipe.backend, settings))
        what = self.behaviour.get(loaded.name, {})
        if isinstance(what, BaseException):
            raise what
        verdict = what.get("verdict", "promoted")
        artifact = self._artifact(loaded, model_dir, what)
        run_dir = self.root / "runs" / f"{loaded.name}-{len(self.calls)}"
        report = gate_report(verdict)
        return RunOutcome(
            verdict=verdict, exit_code=report.gate.exit_code, run_dir=run_dir, gate_json=run_dir / "gate.json", report_md=run_dir / "report.md",
            artifact_dir=artifact, reasons=report.gate.reasons, stages={"quantize_s": 0.0 if what.get("reused") else what.get("quantize_s", 3.0)},
            report=report, performance=_performance(*what["speed"]) if "speed" in what else None,
        )

    def _artifact(self, loaded: LoadedRecipe, model_dir: Path, what: dict[str, Any]) -> Path:
        folder = self.root / "candidates" / loaded.name
        folder.mkdir(parents=True, exist_ok=True)
        after = what.get("bytes", 1_000_000)
        (folder / "model.safetensors").write_bytes(b"w" * 64)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "compressed-tensors"}}))
        manifest = Manifest(
            recipe=loaded.name, model_name=model_dir.name, source_model=str(model_dir), input_key="k" * 64, recipe_file=str(loaded.path),
            recipe_text=loaded.text, compiled_recipe="", calibration=None, versions={"llmcompressor": "0.14.0.1"}, source_files={},
            artifact_files=artifact_file_hashes(folder), layers={},
            weight_bytes=WeightBytes(before=BASELINE_BYTES, after=after, ratio=after / BASELINE_BYTES),
            wall_time_s=what.get("quantize_s", 3.0), peak_memory=PeakMemory(bytes=what.get("peak", 900 * MiB)), stages={},
            backend=_backend_record(loaded.recipe.backend),
        )
        (folder / MANIFEST_NAME).write_text(manifest.model_dump_json())
        return folder


def _backend_record(name: str) -> BackendRecord | None:
    """What quantize records for a subprocess backend; llm-compressor's rows are written as manifests from before backends."""
    if name == DEFAULT_BACKEND:
        return None
    return BackendRecord(name=name, version="7.7.0", checkpoint_format={"gptqmodel": "gptq"}.get(name, name), quant_method=name)


def _performance(ratio: float, interval: tuple[float, float] | None, outcome: str) -> PerformanceSummary:
    """The load test's headline as the runner hands it over."""
    return PerformanceSummary(enforced=False, passed=outcome != "slower", target="cpu", deployment_concurrency=8, throughput_ratio=ratio,
                              throughput_interval=list(interval) if interval else None, speed=outcome, pairs=6,  # type: ignore[arg-type]
                              ttft_p95_ratio=1.0, measured_max_num_seqs=None)


@pytest.fixture
def fake_runner(tmp_path: Path) -> Callable[[dict[str, Any]], FakeRowRunner]:
    return lambda behaviour: FakeRowRunner(tmp_path / "fake-runner", behaviour)


@pytest.fixture
def bake(workspace: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The gate workspace with its artifacts root at tmp/artifacts, and `plan(recipes, backends)` planning on its model."""
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(workspace.root / "artifacts"))
    settings = gate_settings(workspace)

    def plan(recipes: list[str], backends: list[str] | None = None) -> BakeoffPlan:
        return plan_bakeoff(recipes, backends or ["llm-compressor", "gptqmodel", "bitsandbytes"], workspace.baseline, settings)

    return SimpleNamespace(workspace=workspace, settings=settings, plan=plan, bakeoffs=workspace.root / "artifacts" / "bakeoffs")
