"""Every consumer verifies the artifact before acting on it, and a tampered one changes nothing.

Consumers: `registry promote`, `registry alias`, `registry rollback`, the job's cached skip, and `gate`
(with a manifest; without one, refused unless --allow-unverified, and then never registered). Each test
damages a weight file or manifest.json and checks exit 2 / InputError naming the file, with the
registry's tables exactly as they were. Also: malformed manifest.json files are exit 2 naming the file,
never a traceback.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import FakeRunner, demo_job, install, make_artifact, make_eval_set, make_gate, make_model, new_version, promote

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.evaluation import evalsets
from pipelines.files.hashing import sha256_file
from pipelines.jobs.job import run_job
from pipelines.registry.store import Registry
from pipelines.runs import runner


def snapshot(db: Path) -> list[str] | None:
    """Every row of every table (None when there is no registry file)."""
    if not db.exists():
        return None
    with sqlite3.connect(db) as connection:
        return list(connection.iterdump())


def registry_cli(capsys, db: Path, *argv: str) -> tuple[int, str]:
    code = main(["registry", *argv, "--registry", str(db)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


@pytest.fixture
def two_promoted(tmp_path: Path) -> tuple[Registry, Path, Path]:
    """Versions 1 and 2 of demo-llama, both promoted; `production` moved 1 -> 2."""
    registry = Registry(tmp_path / "registry.db")
    artifacts = []
    for name in ("one", "two"):
        artifact = make_artifact(tmp_path / name, weights=name.encode())
        version = registry.register(new_version(artifact, make_gate(tmp_path / f"{name}-gate.json")))
        promote(registry, version)
        artifacts.append(artifact)
    registry.set_alias("demo-llama", "production", 1)
    registry.set_alias("demo-llama", "production", 2)
    return registry, artifacts[0], artifacts[1]


def tamper_weights(artifact: Path) -> Path:
    (artifact / "model.safetensors").write_bytes(b"weights swapped after the gate")
    return artifact / "model.safetensors"


def tamper_manifest(artifact: Path) -> Path:
    """A manifest.json rewritten with the same file hashes but other content (say, another recipe)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["recipe"] = "something-else"
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    return artifact / "manifest.json"


TAMPER = pytest.mark.parametrize("tamper", [tamper_weights, tamper_manifest], ids=["weights", "manifest"])


# --- registry consumers ---------------------------------------------------------------------------------


@TAMPER
def test_alias_refuses_a_tampered_artifact_and_changes_nothing(two_promoted, capsys, tamper):
    registry, one, _ = two_promoted
    bad = tamper(one)
    before = snapshot(registry.path)
    code, err = registry_cli(capsys, registry.path, "alias", "demo-llama", "staging", "1")
    assert code == 2 and str(bad) in err
    assert snapshot(registry.path) == before


@TAMPER
def test_rollback_refuses_a_tampered_target_and_changes_nothing(two_promoted, capsys, tamper):
    registry, one, _ = two_promoted
    bad = tamper(one)  # version 1 is what the rollback would return to
    before = snapshot(registry.path)
    code, err = registry_cli(capsys, registry.path, "rollback", "demo-llama", "production")
    assert code == 2 and str(bad) in err
    assert snapshot(registry.path) == before
    assert registry.show("demo-llama", "production").version == 2


@TAMPER
def test_promote_refuses_a_tampered_artifact_and_changes_nothing(tmp_path, capsys, tamper):
    registry = Registry(tmp_path / "registry.db")
    artifact = make_artifact(tmp_path / "a")
    registry.register(new_version(artifact, make_gate(tmp_path / "gate.json")))
    bad = tamper(artifact)
    before = snapshot(registry.path)
    code, err = registry_cli(capsys, registry.path, "promote", "demo-llama", "1", "--reason", "looks fine")
    assert code == 2 and str(bad) in err
    assert snapshot(registry.path) == before


def test_resolve_and_register_refuse_a_tampered_manifest(two_promoted):
    registry, _, two = two_promoted
    bad = tamper_manifest(two)
    with pytest.raises(InputError, match=r"manifest\.json changed since it was recorded") as caught:
        registry.resolve("demo-llama", "production")
    assert caught.value.file == str(bad)


# --- the job's cached skip ---------------------------------------------------------------------------------


@pytest.fixture
def job_workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    sets = [make_eval_set(tmp_path / "eval_sets", "tickets")]
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: sets)
    make_model(tmp_path / "models" / "demo-llama")
    return tmp_path


@TAMPER
def test_a_cached_skip_verifies_the_artifact_first(job_workspace, monkeypatch, capsys, tamper):
    path = demo_job(job_workspace, ["w8a8", "w4a16"])
    install(monkeypatch, FakeRunner(job_workspace, {}))
    assert run_job(path, jobs_dir=job_workspace / "jobs").exit_code == 0
    bad = tamper(job_workspace / "candidates" / "demo-llama" / "w8a8")
    registry_before = snapshot(job_workspace / "registry.db")
    again = install(monkeypatch, FakeRunner(job_workspace, {}))
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(job_workspace))
    code = main(["job", str(path), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 2 and again.calls == []  # nothing re-run: the tampered skip is an error, the intact one a skip
    results = {r["recipe"]: r for r in summary["results"]}
    assert (results["w4a16"]["status"], results["w4a16"]["skipped"]) == ("promoted", True)
    assert results["w8a8"]["status"] == "error" and str(bad) in results["w8a8"]["reasons"][0]
    assert "cached promoted verdict not trusted" in results["w8a8"]["reasons"][0]
    assert snapshot(job_workspace / "registry.db") == registry_before


# --- gate -------------------------------------------------------------------------------------------------


@TAMPER
def test_gate_refuses_a_tampered_artifact_before_serving(cli, stack, workspace, capsys, tamper):
    # workspace.artifact's manifest records only artifact_files; tampering with the manifest's hash map:
    if tamper is tamper_manifest:
        manifest = json.loads((workspace.artifact / "manifest.json").read_text())
        manifest["artifact_files"]["config.json"] = "0" * 64
        (workspace.artifact / "manifest.json").write_text(json.dumps(manifest))
        bad = workspace.artifact / "config.json"
    else:
        bad = tamper(workspace.artifact)
    assert cli() == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err
    assert stack.starts == [] and snapshot(workspace.registry) is None


def test_gate_refuses_an_artifact_changed_while_it_was_served(cli, stack, workspace, capsys, monkeypatch):
    score = stack.score

    def tampering_score(server, *args):
        if server.served_name == "candidate":
            tamper_weights(workspace.artifact)
        return score(server, *args)

    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, score=tampering_score))
    assert cli() == 2
    err = capsys.readouterr().err
    assert str(workspace.artifact / "model.safetensors") in err
    (folder,) = (workspace.root / "artifacts" / "runs").iterdir()
    assert folder.name.endswith("-error") and not (folder / "gate.json").exists()  # no verdict about changed bytes
    assert Registry(workspace.registry).list() == [] and Registry(workspace.registry).history() == []


def test_gate_without_manifest_needs_allow_unverified(cli, stack, workspace, capsys):
    (workspace.artifact / "manifest.json").unlink()
    assert cli() == 2
    err = capsys.readouterr().err
    assert str(workspace.artifact / "manifest.json") in err and "--allow-unverified" in err
    assert stack.starts == [] and snapshot(workspace.registry) is None


@pytest.mark.parametrize("lost", [0, 12], ids=["promoted", "rejected"])
def test_gate_with_allow_unverified_reports_and_never_registers(cli, stack, workspace, capsys, lost):
    (workspace.artifact / "manifest.json").unlink()
    stack.lost = lost
    code = cli("--allow-unverified", "--json")
    out = json.loads(capsys.readouterr().out)
    assert code == (0 if lost == 0 else 1) and out["verified"] is False and out["registry_version"] is None
    assert "UNVERIFIED" in Path(out["report_md"]).read_text()
    assert json.loads(Path(out["gate_json"]).read_text())["inputs"]["artifact"]["verified"] is False
    assert snapshot(workspace.registry) is None or Registry(workspace.registry).list() == []


def test_gate_records_the_manifest_hash_it_verified(cli, stack, workspace, capsys):
    assert cli("--json") == 0
    out = json.loads(capsys.readouterr().out)
    digest = sha256_file(workspace.artifact / "manifest.json")
    assert out["manifest_sha256"] == digest and out["verified"] is True
    assert json.loads(Path(out["gate_json"]).read_text())["inputs"]["artifact"]["manifest_sha256"] == digest
    assert Registry(workspace.registry).show("demo-llama", 1).manifest_hash == digest


# --- malformed manifest.json ------------------------------------------------------------------------------


def _huge(path: Path) -> None:
    with path.open("wb") as handle:
        handle.truncate(17 * 1024 * 1024)  # sparse: instant, and larger than any manifest


MALFORMED = {
    "bad-json": lambda p: p.write_text('{"artifact_files": '),
    "not-object": lambda p: p.write_text("[1, 2]"),
    "files-not-a-map": lambda p: p.write_text('{"artifact_files": ["model.safetensors"]}'),
    "digest-not-hex": lambda p: p.write_text('{"artifact_files": {"model.safetensors": 5}}'),
    "recipe-not-string": lambda p: p.write_text('{"recipe": ["w8a8"], "artifact_files": {}}'),
    "nan": lambda p: p.write_text('{"artifact_files": {"model.safetensors": NaN}}'),
    "traversal-key": lambda p: p.write_text(json.dumps({"artifact_files": {"../../etc/passwd": "0" * 64}})),
    "absolute-key": lambda p: p.write_text(json.dumps({"artifact_files": {"/etc/passwd": "0" * 64}})),
    "not-utf8": lambda p: p.write_bytes(b'{"artifact_files": "\xff"}'),
    "deep": lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
    "huge": _huge,
}


@pytest.mark.parametrize("damage", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_manifest_is_exit_2_naming_the_file(cli, stack, workspace, capsys, damage):
    manifest = workspace.artifact / "manifest.json"
    damage(manifest)
    assert cli() == 2
    err = capsys.readouterr().err
    assert f"quantize: error: {manifest}" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert stack.starts == [] and snapshot(workspace.registry) is None


@pytest.mark.parametrize("damage", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_manifest_is_refused_by_the_registry_naming_the_file(tmp_path, damage):
    artifact = make_artifact(tmp_path / "a")
    damage(artifact / "manifest.json")
    registry = Registry(tmp_path / "registry.db")
    with pytest.raises(InputError) as caught:
        registry.register(new_version(artifact))
    assert caught.value.file == str(artifact.resolve() / "manifest.json")
    assert registry.list() == []
