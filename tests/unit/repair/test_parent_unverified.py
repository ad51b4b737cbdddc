"""`quantize repair RUN --allow-unverified` reads a run folder no registry vouches for: whatever is damaged, half-written or
foreign in it (gate.json, the artifact's manifest, the registry file) is one InputError naming the file, never an internal
error."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import make_eval_set

from pipelines.artifact import CalibrationRecord, Manifest, PeakMemory, WeightBytes
from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.evaluation.metrics import make_spec
from pipelines.files.hashing import sha256_file
from pipelines.gate.policy import load_policy
from pipelines.gate.schema import GateReport
from pipelines.gate.verdict import PairedItem, SetComparison, decide
from pipelines.recipe import load_recipe
from pipelines.repair.parent import load_parent

RUN = "20261201T000000Z-aggressive-1-abcdef"


def _report(artifact: Path, baseline: Path, eval_set_sha: str) -> GateReport:
    items = [PairedItem(item_id=f"t{i}", baseline=1.0, candidate=0.0 if i < 40 else 1.0, kl=0.3) for i in range(200)]
    comparison = SetComparison(eval_set="tickets", metric=make_spec("exact_match"), items=items, kl_method="top-20 logprobs")
    gate = decide([comparison], load_policy(), "aggressive")
    return GateReport(inputs={"recipe": "aggressive", "artifact": {"path": str(artifact)}, "baseline": {"path": str(baseline)},
                              "eval_sets": {"tickets": eval_set_sha},
                              "policy": {"path": "policies/default.yaml", "sha256": sha256_file(Path("policies/default.yaml"))},
                              "serve": {"max_model_len": 256}}, gate=gate)


@pytest.fixture
def rejected_run(tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A rejected run folder as the runner writes it, known to no registry, under an artifacts root of its own."""
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    eval_set = make_eval_set(tmp_path / "eval_sets", "tickets")
    from pipelines.evaluation import evalsets

    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: [eval_set])
    loaded = load_recipe("aggressive")
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "config.json").write_text("{}")
    manifest = Manifest(
        recipe="aggressive", model_name="m", source_model=str(tiny_llama_dir), input_key="k", recipe_file=str(loaded.path),
        recipe_text=loaded.text, compiled_recipe="",
        calibration=CalibrationRecord(dataset="from-eval-sets: tickets", sha256="x", num_samples=1, seed=0, max_seq_length=8),
        versions={}, source_files={}, artifact_files={"config.json": "0" * 64}, layers={},
        weight_bytes=WeightBytes(before=2, after=1, ratio=0.5), wall_time_s=1.0, peak_memory=PeakMemory(bytes=1), stages={},
    )
    (artifact / "manifest.json").write_text(manifest.model_dump_json())
    run_dir = tmp_path / "runs" / RUN
    run_dir.mkdir(parents=True)
    (run_dir / "gate.json").write_text(_report(artifact, tiny_llama_dir, eval_set.sha256).model_dump_json())
    return run_dir


def _half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _replace_with(make: Callable[[Path], object]) -> Callable[[Path], None]:
    def replace(path: Path) -> None:
        path.unlink()
        make(path)
    return replace


def _edit_gate(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        document = json.loads((run / "gate.json").read_text())
        change(document)
        (run / "gate.json").write_text(json.dumps(document))
    return edit


def _artifact(run: Path) -> Path:
    return run.parents[1] / "artifact"


DAMAGE: dict[str, Callable[[Path], object]] = {
    "no manifest": lambda run: (_artifact(run) / "manifest.json").unlink(),
    "half-written manifest": lambda run: _half(_artifact(run) / "manifest.json"),
    "manifest a fifo": lambda run: _replace_with(os.mkfifo)(_artifact(run) / "manifest.json"),
    "half-written gate.json": lambda run: _half(run / "gate.json"),
    "gate.json a fifo": lambda run: _replace_with(os.mkfifo)(run / "gate.json"),
    "policy record not an object": _edit_gate(lambda document: document["inputs"].update(policy="policies/default.yaml")),
    "policy path not a path": _edit_gate(lambda document: document["inputs"].update(policy={"path": 7})),
    "plan's gpu not an object": _edit_gate(lambda document: (document.update(plan={"gpu": "L4", "max_model_len": 1}),
                                                             document["inputs"]["policy"].update(sha256="0" * 64))),
    "foreign registry file": lambda run: (run.parents[1] / "registry.db").write_bytes(b"not a database" * 100),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_or_foreign_run_is_one_input_error_never_an_internal_one(rejected_run: Path, damage: str) -> None:
    DAMAGE[damage](rejected_run)
    with pytest.raises(InputError) as caught:
        load_parent(RUN, rejected_run.parent, registry_path=rejected_run.parents[1] / "registry.db", allow_unverified=True)
    assert "\n" not in caught.value.one_line()


def test_through_the_command_a_damaged_run_is_one_line_exit_2(rejected_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    DAMAGE["policy record not an object"](rejected_run)
    assert main(["repair", RUN, "--allow-unverified", "--no-loadtest"]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and "inputs.policy: must be a JSON object" in err, err
