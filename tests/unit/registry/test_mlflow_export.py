"""MLflow export: gate numbers as tags, refusal of unpromoted versions, and a real export to a local store."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest
from fakes import promote

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.evaluation.metrics import make_spec
from pipelines.files.hashing import file_hashes
from pipelines.gate.policy import DEFAULT_POLICY, load_policy
from pipelines.gate.schema import GateReport
from pipelines.gate.verdict import PairedItem, SetComparison, decide
from pipelines.registry.mlflow_export import export_to_mlflow, gate_tags
from pipelines.registry.store import MANIFEST_FILES_KEY, NewVersion, Registry, Version

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None,
    reason="mlflow is not installed (optional extra `mlflow`; pip install 'quantgate[mlflow]')",
)

def comparison(name: str, lost: int, kl: float | None) -> SetComparison:
    items = [PairedItem(item_id=f"{name}{i}", baseline=1.0, candidate=0.0 if i < lost else 1.0, kl=kl) for i in range(200)]
    return SetComparison(eval_set=name, metric=make_spec("exact_match"), items=items, kl_method="top-20 logprobs" if kl is not None else None)


# tickets: 3 of 200 lost (delta -1.5 points, flip rate 0.015), KL measured; orders: none lost, KL not measured.
GATE_REPORT = GateReport(
    inputs={"artifact": {"hash": "abc"}},
    gate=decide([comparison("tickets", 3, 0.004), comparison("orders", 0, None)], load_policy(DEFAULT_POLICY), "w8a8"),
)


def make_promoted(tmp_path: Path, model: str = "demo-llama") -> tuple[Registry, Version]:
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "model.safetensors").write_bytes(b"int8 weights")
    (artifact / "config.json").write_text("{}")
    (artifact / "manifest.json").write_text(json.dumps({MANIFEST_FILES_KEY: file_hashes(artifact)}))
    (tmp_path / "gate.json").write_text(GATE_REPORT.model_dump_json())
    registry = Registry(tmp_path / "registry.db")
    version = registry.register(NewVersion(
        source_model=model, source_hash="src", artifact_path=artifact, recipe_name="w8a8", recipe_hash="rh",
        gate_path=tmp_path / "gate.json",
    ))
    return registry, promote(registry, version)


def test_gate_tags_carry_verdict_and_per_set_numbers() -> None:
    tags = gate_tags(GATE_REPORT)
    tickets = GATE_REPORT.gate.sets[0]
    assert tags["gate.verdict"] == "promoted"
    assert (tags["gate.tickets.delta"], tags["gate.tickets.ci_low"], tags["gate.tickets.ci_high"]) == (
        "-1.5", str(tickets.ci_low), str(tickets.ci_high))
    assert tags["gate.tickets.flips_right_to_wrong"] == "3" and tags["gate.tickets.kl_mean"] == str(tickets.kl_mean)
    assert tags["gate.tickets.passed"] == "True" and tags["gate.orders.n"] == "200"
    assert "gate.orders.kl_max" not in tags and "gate.orders.mcnemar_p" in tags  # null numbers are left out, not written as "None"
    assert not any("rules" in key or "inputs" in key for key in tags)
    assert gate_tags(None) == {}


def test_only_promoted_versions_are_exported(tmp_path: Path) -> None:
    _, version = make_promoted(tmp_path)
    candidate = version.model_copy(update={"status": "candidate"})
    with pytest.raises(InputError, match="only promoted"):
        export_to_mlflow(candidate, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not (tmp_path / "mlflow.db").exists()


def test_version_tags_carry_the_manifest_hash(tmp_path: Path) -> None:
    from pipelines.files.hashing import sha256_file
    from pipelines.registry.mlflow_export import version_tags

    _, version = make_promoted(tmp_path)
    tags = version_tags(version)
    assert tags["quantgate.manifest_hash"] == sha256_file(Path(version.artifact_path) / "manifest.json")
    assert tags["quantgate.artifact_hash"] == version.artifact_hash


@pytest.mark.parametrize("damage", ["weights", "manifest"])
def test_export_verifies_the_artifact_itself_before_logging_it(tmp_path: Path, damage: str) -> None:
    # A library caller holding a Version from earlier (not through Registry.resolve) is checked too.
    _, version = make_promoted(tmp_path)
    artifact = Path(version.artifact_path)
    if damage == "weights":
        (artifact / "model.safetensors").write_bytes(b"swapped")
    else:
        (artifact / "manifest.json").write_text((artifact / "manifest.json").read_text() + " ")
    with pytest.raises(InputError, match="model.safetensors" if damage == "weights" else "manifest.json changed"):
        export_to_mlflow(version, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not (tmp_path / "mlflow.db").exists()


@pytest.fixture
def offline_mlflow(monkeypatch) -> list:
    """No MLflow settings from the environment, and any attempt to open a network connection recorded."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"):
        monkeypatch.delenv(name, raising=False)
    attempts: list = []
    real_connect = socket.socket.connect

    def guarded_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError("network access attempted during the MLflow export test")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    return attempts


@needs_mlflow
def test_export_registers_a_model_version_with_tags_alias_and_files(tmp_path: Path, offline_mlflow, capsys) -> None:
    from mlflow import MlflowClient

    registry, version = make_promoted(tmp_path)
    uri = f"sqlite:///{(tmp_path / 'mlruns' / 'mlflow.db').as_posix()}"
    result = export_to_mlflow(version, tracking_uri=uri, alias="production")

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exported = client.get_model_version_by_alias("demo-llama", "production")
    assert int(exported.version) == result.model_version and not result.reused
    assert exported.tags["gate.verdict"] == "promoted"
    assert exported.tags["gate.tickets.delta"] == "-1.5" and exported.tags["gate.orders.delta"] == "0.0"
    assert exported.tags["quantgate.artifact_hash"] == version.artifact_hash
    assert client.get_run(result.run_id).data.tags["gate.tickets.flip_rate"] == "0.015"

    downloaded = Path(client.download_artifacts(result.run_id, "artifact", str(tmp_path / "download")))
    assert file_hashes(downloaded) == file_hashes(Path(version.artifact_path))
    assert (tmp_path / "mlruns" / "mlflow-artifacts").is_dir()  # beside the store, not ./mlruns

    # The same version again: the first export is reused; the CLI goes through the same path.
    code = main(["registry", "export-mlflow", "demo-llama", "1", "--tracking-uri", uri, "--alias", "stable",
                 "--registry", str(registry.path), "--json"])
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and again["reused"] and again["model_version"] == result.model_version
    assert len(client.search_model_versions("name = 'demo-llama'")) == 1
    assert int(client.get_model_version_by_alias("demo-llama", "stable").version) == result.model_version
    assert offline_mlflow == []  # no connection attempted
    # MLflow's usage telemetry (off under pytest anyway) is switched off for every export.
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true" and os.environ["DO_NOT_TRACK"] == "true"


@needs_mlflow
def test_export_refuses_a_tampered_artifact(tmp_path: Path, offline_mlflow, capsys) -> None:
    registry, version = make_promoted(tmp_path)
    (Path(version.artifact_path) / "model.safetensors").write_bytes(b"swapped")
    code = main(["registry", "export-mlflow", "demo-llama", "1", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}",
                 "--registry", str(registry.path)])
    assert code == 2 and "model.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "m.db").exists()
