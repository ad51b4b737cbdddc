"""MLflow export and the registry's mirror: gate numbers as tags, refusal of unpromoted versions, a real export to a
local store, aliases mirrored, and a failed mirror recorded and retried (tests/integration/test_mlflow_mirror.py runs
the same against a real `mlflow server`)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest
from fakes import promoted
from signed_versions import GATE_REPORT, make_promoted

from pipelines.cli import main
from pipelines.console.redact import without_credentials
from pipelines.errors import InputError
from pipelines.files.hashing import file_hashes
from pipelines.registry.mirror import (
    PENDING_DIR,
    mirror_after,
    mirror_target,
    mirroring_to,
    pending_records,
    retry_pending,
)
from pipelines.registry.mlflow_export import export_to_mlflow, gate_tags

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None,
    reason="mlflow is not installed (optional extra `mlflow`; pip install 'quantgate[mlflow]')",
)

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


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One local MLflow store for the tests that only add to it (creating its tables takes MLflow ~10 s here)."""
    return f"sqlite:///{(tmp_path_factory.mktemp('mlruns') / 'mlflow.db').as_posix()}"


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
def test_export_registers_a_model_version_with_tags_alias_and_files(tmp_path: Path, offline_mlflow, shared_store: str,
                                                                    capsys) -> None:
    from mlflow import MlflowClient

    registry, version = make_promoted(tmp_path)
    uri = shared_store
    result = export_to_mlflow(version, tracking_uri=uri, alias="production", registry=registry)

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exported = client.get_model_version_by_alias("demo-llama", "production")
    assert int(exported.version) == result.model_version and not result.reused
    assert exported.tags["gate.verdict"] == "promoted"
    assert exported.tags["gate.tickets.delta"] == "-1.5" and exported.tags["gate.orders.delta"] == "0.0"
    assert exported.tags["quantgate.artifact_hash"] == version.artifact_hash
    assert client.get_run(result.run_id).data.tags["gate.tickets.flip_rate"] == "0.015"

    # The signed bundle (weights, evidence, model.sig) as the model version's source, the report beside it.
    downloaded = Path(client.download_artifacts(result.run_id, "bundle", str(tmp_path / "download")))
    assert file_hashes(downloaded) == file_hashes(registry.verify_signature(version).bundle)
    assert result.source.endswith("/bundle") and exported.source == result.source
    assert {"bundle", "gate.json", "report.md"} <= {item.path for item in client.list_artifacts(result.run_id)}
    assert (Path(uri.removeprefix("sqlite:///")).parent / "mlflow-artifacts").is_dir()  # beside the store, not ./mlruns

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


def test_credentials_in_urls_are_redacted() -> None:
    text = "API request to https://alice:s3cret@mlflow.example/api failed; retry http://bob@h:5000/x and sqlite:///a.db"
    assert without_credentials(text) == "API request to https://***@mlflow.example/api failed; retry http://***@h:5000/x and sqlite:///a.db"


@needs_mlflow
def test_mirror_follows_the_registrys_aliases_once_per_version(tmp_path: Path, offline_mlflow, shared_store: str,
                                                               monkeypatch, capsys) -> None:
    from mlflow import MlflowClient

    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    registry, first = make_promoted(tmp_path, model="mirror-llama")
    uri = shared_store
    mirror_after(registry, first.model, [first.version], target=uri)
    registry.set_alias(first.model, "champion", first.version, reason="first")
    mirror_after(registry, first.model, target=uri)
    mirror_after(registry, first.model, [first.version], target=uri)  # again: nothing new
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    versions = client.search_model_versions(f"name = '{first.model}'")
    assert len(versions) == 1 and versions[0].tags["quantgate.version"] == str(first.version)
    assert client.get_model_version_by_alias(first.model, "champion").version == versions[0].version
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(">")]  # ours, not MLflow's logging
    assert len(lines) == 3 and all("mirrored to MLflow" in line for line in lines)
    assert "champion -> 1" in lines[-1] and pending_records() == []


@needs_mlflow
def test_a_failed_mirror_is_one_line_a_pending_record_and_retried(tmp_path: Path, offline_mlflow, monkeypatch, capsys) -> None:
    from mlflow import MlflowClient

    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    registry, version = make_promoted(tmp_path)
    blocked = tmp_path / "mlflow"
    blocked.write_text("a file where the store's folder should be")
    uri = f"sqlite:///{(blocked / 'mlflow.db').as_posix()}"
    mirror_after(registry, version.model, [version.version], target=uri)  # never raises
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(">")]
    assert len(err) == 1 and "failed" in err[0] and "quantize registry mirror --retry" in err[0]
    [(path, record)] = pending_records()
    assert path.parent == tmp_path / "artifacts" / PENDING_DIR
    assert (record.model, record.versions, record.tracking) == (version.model, [version.version], uri)

    blocked.unlink()
    blocked.mkdir()
    assert main(["registry", "mirror", "--retry", "--mlflow", uri]) == 0
    assert pending_records() == []
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert [v.tags["quantgate.version"] for v in client.search_model_versions(f"name = '{version.model}'")] == ["1"]


@needs_mlflow
def test_a_mirror_failure_never_prints_credentials(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    registry, version = make_promoted(tmp_path)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    url = f"http://alice:s3cret@127.0.0.1:{port}"
    mirror_after(registry, version.model, [version.version], target=url)
    err = capsys.readouterr().err
    assert "s3cret" not in err and "alice" not in err and f"http://***@127.0.0.1:{port}" in err
    [(path, record)] = pending_records()
    assert "s3cret" not in path.read_text() and record.tracking == f"http://***@127.0.0.1:{port}"
    # A retry without the credentials cannot serve this record: it stays.
    assert retry_pending(None) == ([], []) and len(pending_records()) == 1


def test_the_runs_flag_wins_over_the_setting(monkeypatch) -> None:
    monkeypatch.setenv("QUANTGATE_MLFLOW", "http://setting:5000")
    assert mirror_target() == "http://setting:5000"
    with mirroring_to("http://flag:5000"):
        assert mirror_target() == "http://flag:5000" and mirror_target("http://explicit:5000") == "http://explicit:5000"
    with mirroring_to(None):
        assert mirror_target() == "http://setting:5000"
    monkeypatch.delenv("QUANTGATE_MLFLOW")
    assert mirror_target() is None


@needs_mlflow
def test_a_gate_runs_promotion_is_mirrored(cli, workspace, shared_store: str, offline_mlflow, monkeypatch, capsys) -> None:
    from mlflow import MlflowClient

    monkeypatch.setenv("QUANTGATE_MLFLOW", shared_store)
    version = promoted(cli, workspace, model=workspace.baseline.name)
    assert any(line.startswith(">") and "mirrored to MLflow" in line for line in capsys.readouterr().err.splitlines())
    client = MlflowClient(tracking_uri=shared_store, registry_uri=shared_store)
    [mirrored] = [found for found in client.search_model_versions(f"name = '{version.model}'")  # the store is shared
                  if found.tags["quantgate.artifact_hash"] == version.artifact_hash]
    assert mirrored.tags["quantgate.version"] == str(version.version) and mirrored.tags["gate.verdict"] == "promoted"


def test_a_pending_record_the_disk_will_not_remove_never_reaches_the_exit_code(tmp_path: Path, monkeypatch, capsys) -> None:
    from pipelines.registry import mirror

    record = tmp_path / "pending.json"
    record.write_text("{}")

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    mirror._forget([record])  # no exception: the promotion it follows keeps its exit code
    assert "could not remove the mirrored pending record pending.json" in capsys.readouterr().err
