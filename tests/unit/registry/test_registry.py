"""The model registry: versions, integrity checks, status changes, aliases, history, concurrency, CLI."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import UNSIGNED, gate_report, make_artifact, make_gate, new_version, promote

from pipelines.artifact import artifact_hash
from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.files.hashing import sha256_file, sha256_json
from pipelines.gate.schema import load_report
from pipelines.registry.store import (
    MANIFEST_FILES_KEY,
    EvalSetRef,
    Registry,
    default_registry_path,
)


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(tmp_path / "registry.db")


def promoted(registry: Registry, tmp_path: Path, name: str) -> int:
    """Register and promote a fresh artifact; returns its version number."""
    artifact = make_artifact(tmp_path / name, weights=name.encode())
    version = registry.register(new_version(artifact, make_gate(tmp_path / f"{name}-gate.json")))
    return promote(registry, version).version


# --- integrity ----------------------------------------------------------------------------------------


def test_artifact_hash_is_the_hash_of_the_manifest_file_hashes(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a")
    expected = sha256_json(json.loads((artifact / "manifest.json").read_text())[MANIFEST_FILES_KEY])
    assert artifact_hash(artifact) == expected
    assert artifact_hash(make_artifact(tmp_path / "b", weights=b"other")) != expected


# --- registering ----------------------------------------------------------------------------------------


def test_register_records_everything_and_numbers_per_model(registry: Registry, tmp_path: Path) -> None:
    gate = make_gate(tmp_path / "gate.json")
    first = registry.register(new_version(make_artifact(tmp_path / "a"), gate))
    second = registry.register(new_version(make_artifact(tmp_path / "b", b"b"), gate))
    other = registry.register(new_version(make_artifact(tmp_path / "c", b"c"), gate, model="other-model"))
    assert (first.version, second.version, other.version) == (1, 2, 1)
    assert first.status == "candidate" and first.aliases == []
    assert first.artifact_path == (tmp_path / "a").resolve().as_posix()
    assert first.artifact_hash == artifact_hash(tmp_path / "a")
    assert first.gate == load_report(gate) and first.gate_path == gate.resolve().as_posix()
    assert first.model_dump(mode="json")["gate"] == json.loads(gate.read_text())  # --json shows gate.json as written
    assert first.eval_sets == [EvalSetRef(name="tickets", hash="set-hash")]
    assert registry.show("demo-llama", 1) == first


def test_register_is_idempotent_on_artifact_and_gate_evidence(registry: Registry, tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a")
    first = registry.register(new_version(artifact, make_gate(tmp_path / "g1.json")))
    again = registry.register(new_version(artifact, make_gate(tmp_path / "g1.json")))
    regated = registry.register(new_version(artifact, make_gate(tmp_path / "g2.json", created_at="2026-12-02T10:00:00+00:00")))
    assert again.id == first.id
    assert regated.version == 2
    assert [e.kind for e in registry.history("demo-llama")] == ["registered", "registered"]


def test_register_refuses_an_incomplete_artifact(registry: Registry, tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a")
    (artifact / "manifest.json").unlink()
    with pytest.raises(InputError, match="manifest"):
        registry.register(new_version(artifact))
    with pytest.raises(InputError, match="does not exist"):
        registry.register(new_version(tmp_path / "nowhere"))
    assert registry.list() == []


def test_register_refuses_unreadable_gate_evidence(registry: Registry, tmp_path: Path) -> None:
    (tmp_path / "gate.json").write_text("{not json")
    with pytest.raises(InputError, match=r"gate\.json"):
        registry.register(new_version(make_artifact(tmp_path / "a"), tmp_path / "gate.json"))


def test_register_refuses_gate_evidence_that_is_not_a_gate_report(registry: Registry, tmp_path: Path) -> None:
    gate = tmp_path / "gate.json"
    report = gate_report().model_dump(mode="json")
    del report["gate"]["verdict"]
    gate.write_text(json.dumps(report))
    with pytest.raises(InputError, match=r"gate\.verdict") as caught:
        registry.register(new_version(make_artifact(tmp_path / "a"), gate))
    assert caught.value.file == str(gate) and registry.list() == []


def test_evidence_stored_before_gate_json_schema_2_reads_back_without_its_report(registry: Registry, tmp_path: Path, capsys) -> None:
    version = registry.register(new_version(make_artifact(tmp_path / "a"), make_gate(tmp_path / "gate.json")))
    legacy = {"schema_version": 1, "inputs": {}, "gate": {"verdict": "promoted", "sets": [], "reasons": []}}
    with sqlite3.connect(registry.path) as db:
        db.execute("UPDATE versions SET gate = ? WHERE id = ?", (json.dumps(legacy), version.id))
    (old,) = registry.list()
    assert old.gate is None and old.verdict is None and old.gate_hash == version.gate_hash
    assert run_cli(capsys, "show", "demo-llama", "1", "--registry", str(registry.path))[0] == 0


# --- status ---------------------------------------------------------------------------------------------


def test_promote_and_reject_are_recorded_with_reason_and_evidence(registry: Registry, tmp_path: Path) -> None:
    one = registry.register(new_version(make_artifact(tmp_path / "a")))
    two = registry.register(new_version(make_artifact(tmp_path / "b", b"b")))
    assert promote(registry, one, "gate passed", {"gate": "g.json"}).status == "promoted"
    rejected = registry.reject(two.id, "tickets dropped 3 points")
    assert (rejected.status, rejected.reason) == ("rejected", "tickets dropped 3 points")
    events = registry.history("demo-llama")
    assert [(e.kind, e.version) for e in events] == [("registered", 1), ("registered", 2), ("promoted", 1), ("rejected", 2)]
    assert events[2].evidence is not None and events[2].evidence["gate"] == "g.json" and "signature" in events[2].evidence
    assert events[3].reason == "tickets dropped 3 points"


def test_promote_verifies_the_artifact_first(registry: Registry, tmp_path: Path) -> None:
    version = registry.register(new_version(make_artifact(tmp_path / "a")))
    (tmp_path / "a" / "model.safetensors").write_bytes(b"swapped after registration")
    with pytest.raises(InputError, match=r"model\.safetensors"):
        promote(registry, version, "gate passed")
    assert registry.show("demo-llama", 1).status == "candidate"


def test_promote_refuses_a_gate_rejected_version_without_override(registry: Registry, tmp_path: Path) -> None:
    gate = make_gate(tmp_path / "gate.json", verdict="rejected")
    version = registry.register(new_version(make_artifact(tmp_path / "a"), gate))
    with pytest.raises(InputError, match="gate rejected"):
        promote(registry, version, "I like it")
    assert promote(registry, version, "accepted risk", override_gate=True).status == "promoted"
    evidence = registry.history("demo-llama")[-1].evidence
    assert evidence is not None and evidence["override_gate"] is True and "signature" in evidence


def test_illegal_transitions_are_refused(registry: Registry, tmp_path: Path) -> None:
    version = registry.register(new_version(make_artifact(tmp_path / "a")))
    registry.reject(version.id, "bad")
    with pytest.raises(InputError, match="rejected and cannot become promoted"):
        promote(registry, version, "changed my mind")
    broken = registry.register(new_version(make_artifact(tmp_path / "b", b"b")))
    registry.mark_error(broken.id, "server died")
    with pytest.raises(InputError, match="error and cannot become rejected"):
        registry.reject(broken.id, "x")


# --- aliases --------------------------------------------------------------------------------------------


def test_only_promoted_versions_carry_an_alias(registry: Registry, tmp_path: Path) -> None:
    registry.register(new_version(make_artifact(tmp_path / "a")))
    with pytest.raises(InputError, match="candidate; only promoted"):
        registry.set_alias("demo-llama", "production", 1)
    with pytest.raises(InputError, match="alias"):
        registry.set_alias("demo-llama", "42", 1)


@pytest.mark.parametrize("alias", ["pr\u043ed", "prod\n", "caf\u00e9", "\uff50rod", "pro d", ""])
def test_an_alias_outside_ascii_letters_digits_and_dashes_is_refused(registry: Registry, tmp_path: Path, alias: str) -> None:
    """'prоd' with a Cyrillic о would otherwise stand beside 'prod'; a trailing newline is not a name either."""
    number = promoted(registry, tmp_path, "a")
    with pytest.raises(InputError, match="ASCII letters"):
        registry.set_alias("demo-llama", alias, number)
    registry.set_alias("demo-llama", "prod", number)


def test_alias_moves_and_rolls_back_through_its_history(registry: Registry, tmp_path: Path) -> None:
    versions = [promoted(registry, tmp_path, name) for name in ("a", "b", "c")]
    for number in versions:
        registry.set_alias("demo-llama", "production", number)
    assert registry.resolve("demo-llama", "production").version == 3
    assert registry.show("demo-llama", 3).aliases == ["production"]
    assert registry.rollback("demo-llama", "production").version == 2
    assert registry.rollback("demo-llama", "production").version == 1
    with pytest.raises(InputError, match="no earlier promoted version"):
        registry.rollback("demo-llama", "production")
    moves = [(e.kind, e.from_version, e.to_version) for e in registry.history("demo-llama", alias="production")]
    assert moves == [("alias_set", None, 1), ("alias_set", 1, 2), ("alias_set", 2, 3),
                     ("alias_rollback", 3, 2), ("alias_rollback", 2, 1)]


def test_setting_the_same_target_twice_is_not_a_move(registry: Registry, tmp_path: Path) -> None:
    number = promoted(registry, tmp_path, "a")
    registry.set_alias("demo-llama", "production", number)
    registry.set_alias("demo-llama", "production", number)
    assert len(registry.history("demo-llama", alias="production")) == 1


def test_rollback_skips_versions_rejected_since(registry: Registry, tmp_path: Path) -> None:
    one, two, three = (promoted(registry, tmp_path, name) for name in ("a", "b", "c"))
    for number in (one, two, three):
        registry.set_alias("demo-llama", "production", number)
    registry.reject(registry.show("demo-llama", two).id, "regression found in production")
    assert registry.rollback("demo-llama", "production").version == one


def test_a_version_holding_an_alias_cannot_be_rejected(registry: Registry, tmp_path: Path) -> None:
    number = promoted(registry, tmp_path, "a")
    registry.set_alias("demo-llama", "production", number)
    with pytest.raises(InputError, match="target of alias"):
        registry.reject(registry.show("demo-llama", number).id, "x")


def test_resolve_verifies_the_artifact_for_serving(registry: Registry, tmp_path: Path) -> None:
    registry.set_alias("demo-llama", "production", promoted(registry, tmp_path, "a"))
    assert registry.resolve("demo-llama", "production").version == 1
    assert registry.resolve("demo-llama", "1").version == 1
    (tmp_path / "a" / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"config\.json"):
        registry.resolve("demo-llama", "production")
    assert registry.show("demo-llama", "production").version == 1  # inspecting still works


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda r: r.show("unknown-model", 1), "model"),
        (lambda r: r.show("demo-llama", 9), "version"),
        (lambda r: r.resolve("demo-llama", "staging"), "alias"),
        (lambda r: r.rollback("demo-llama", "staging"), "alias"),
        (lambda r: r.set_alias("demo-llama", "production", 9), "version"),
        (lambda r: r.promote(999, "x", UNSIGNED), "version_id"),
        (lambda r: r.list("unknown-model"), "model"),
    ],
)
def test_unknown_names_raise_input_errors(registry: Registry, tmp_path: Path, call, field: str) -> None:
    promoted(registry, tmp_path, "a")
    with pytest.raises(InputError) as caught:
        call(registry)
    assert caught.value.field == field and caught.value.file == str(registry.path)


def test_events_are_append_only(registry: Registry, tmp_path: Path) -> None:
    promoted(registry, tmp_path, "a")
    with sqlite3.connect(registry.path) as db, pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("DELETE FROM events")
    assert len(registry.history()) == 2


def test_registry_path_comes_from_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTGATE_REGISTRY", str(tmp_path / "elsewhere.db"))
    assert default_registry_path() == tmp_path / "elsewhere.db"
    assert Registry().path == tmp_path / "elsewhere.db"
    assert not (tmp_path / "elsewhere.db").exists()  # created by the first write, never by opening or reading


def test_a_file_that_is_not_a_registry_is_an_input_error(tmp_path: Path) -> None:
    (tmp_path / "bad.db").write_text("not sqlite at all, just text that is long enough" * 10)
    with pytest.raises(InputError, match=r"bad\.db"):
        Registry(tmp_path / "bad.db")


# --- concurrency ------------------------------------------------------------------------------------------

WORKERS = 4
PER_WORKER = 5


def _worker(db_path: str, artifacts: list[str], barrier) -> list[tuple[int, int]]:
    registry = Registry(db_path)  # the first open of a fresh file races too
    barrier.wait()
    done = []
    for artifact in artifacts:
        version = registry.register(new_version(Path(artifact), make_gate(Path(f"{artifact}-gate.json"))))
        promote(registry, version, f"promoted by {artifact}")
        registry.set_alias("demo-llama", "production", version.version)
        done.append((version.id, version.version))
    return done


def test_the_first_open_waits_for_another_process_holding_the_write_lock(tmp_path: Path) -> None:
    # A fresh file in rollback-journal mode, locked for writing by another process: the switch to WAL is refused at
    # once by SQLite (no busy handler), and the open must wait for the lock instead of calling the file no registry.
    path = tmp_path / "registry.db"
    sqlite3.connect(path).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
         "db.execute('BEGIN IMMEDIATE'); db.execute('CREATE TABLE held (x)')\n"
         "print('held', flush=True); time.sleep(0.5); db.execute('COMMIT')", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        registry = Registry(path)
    finally:
        holder.wait(timeout=30)
    version = registry.register(new_version(make_artifact(tmp_path / "a", b"a")))
    assert registry.list("demo-llama") == [version]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.slow
def test_concurrent_processes_lose_no_update(tmp_path: Path) -> None:
    artifacts = [[str(make_artifact(tmp_path / f"w{w}-{i}", f"{w}-{i}".encode())) for i in range(PER_WORKER)]
                 for w in range(WORKERS)]
    db_path = str(tmp_path / "registry.db")
    # spawn, not fork: a fork taken while another test's threads (MLflow, SQLAlchemy) hold locks deadlocks.
    context = multiprocessing.get_context("spawn")
    barrier = context.Manager().Barrier(WORKERS)
    with context.Pool(WORKERS) as pool:
        results = pool.starmap_async(_worker, [(db_path, batch, barrier) for batch in artifacts]).get(timeout=180)

    registry = Registry(db_path)
    versions = registry.list("demo-llama")
    total = WORKERS * PER_WORKER
    assert sorted(v.version for v in versions) == list(range(1, total + 1))
    assert all(v.status == "promoted" for v in versions)
    assert sorted(v.artifact_path for v in versions) == sorted(
        Path(a).resolve().as_posix() for batch in artifacts for a in batch)
    assert sorted(n for done in results for _, n in done) == list(range(1, total + 1))
    kinds = [e.kind for e in registry.history("demo-llama")]
    assert (kinds.count("registered"), kinds.count("promoted"), kinds.count("alias_set")) == (total, total, total)
    # The alias ends on the last move recorded, and every move chains from the one before it.
    moves = registry.history("demo-llama", alias="production")
    assert all(later.from_version == earlier.to_version for earlier, later in itertools.pairwise(moves))
    assert registry.resolve("demo-llama", "production").version == moves[-1].to_version


# --- CLI --------------------------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["registry", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_lists_shows_and_moves_aliases(capsys, registry: Registry, tmp_path: Path) -> None:
    db = str(registry.path)
    promoted(registry, tmp_path, "a")
    registry.register(new_version(make_artifact(tmp_path / "b", b"b"), make_gate(tmp_path / "gb.json", created_at="2026-12-02T10:00:00+00:00")))

    code, out, _ = run_cli(capsys, "list", "--registry", db, "--json")
    assert code == 0 and [(v["version"], v["status"]) for v in json.loads(out)] == [(1, "promoted"), (2, "candidate")]

    code, out, _ = run_cli(capsys, "promote", "demo-llama", "2", "--reason", "manual", "--registry", db, "--json")
    assert code == 0 and json.loads(out)["status"] == "promoted"

    for version in ("1", "2"):
        assert run_cli(capsys, "alias", "demo-llama", "production", version, "--registry", db)[0] == 0
    code, out, _ = run_cli(capsys, "rollback", "demo-llama", "production", "--registry", db, "--json")
    assert code == 0 and json.loads(out)["version"] == 1

    code, out, _ = run_cli(capsys, "show", "demo-llama", "production", "--registry", db)
    assert code == 0 and "demo-llama v1" in out and "production" in out

    code, out, _ = run_cli(capsys, "history", "demo-llama", "--registry", db, "--json")
    assert [e["kind"] for e in json.loads(out)][-3:] == ["alias_set", "alias_set", "alias_rollback"]

    code, out, _ = run_cli(capsys, "list", "--registry", db)
    assert code == 0 and "demo-llama" in out and "promoted" in out


def test_cli_errors_exit_2_with_one_line(capsys, registry: Registry, tmp_path: Path) -> None:
    db = str(registry.path)
    promoted(registry, tmp_path, "a")
    for argv in (["show", "demo-llama", "7"], ["show", "nobody", "1"], ["rollback", "demo-llama", "staging"],
                 ["reject", "demo-llama", "9", "--reason", "x"]):
        code, out, err = run_cli(capsys, *argv, "--registry", db)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, argv
    code, _, err = run_cli(capsys, "list", "--registry", str(tmp_path / "missing.db"))
    assert code == 2 and "missing.db" in err and not (tmp_path / "missing.db").exists()


def test_cli_promote_needs_override_for_a_gate_rejected_version(capsys, registry: Registry, tmp_path: Path) -> None:
    db = str(registry.path)
    gate = make_gate(tmp_path / "gate.json", verdict="rejected")
    registry.register(new_version(make_artifact(tmp_path / "a"), gate))
    assert run_cli(capsys, "promote", "demo-llama", "1", "--reason", "r", "--registry", db)[0] == 2
    code, out, _ = run_cli(capsys, "promote", "demo-llama", "1", "--reason", "r", "--override-gate",
                           "--registry", db, "--json")
    assert code == 0 and json.loads(out)["status"] == "promoted"


# --- manifest hash, cheap re-verification, schema migration, read-only files --------------------------------


def test_the_manifest_hash_and_fingerprint_are_recorded_and_make_later_checks_cheap(registry: Registry, tmp_path: Path, monkeypatch) -> None:
    import pipelines.artifact as artifact_module

    artifact = make_artifact(tmp_path / "a")
    version = registry.register(new_version(artifact, make_gate(tmp_path / "gate.json")))
    assert version.manifest_hash == sha256_file(artifact / "manifest.json")
    assert set(version.fingerprint) == {"manifest.json", "model.safetensors", "config.json", "sub/tokenizer.json"}
    assert "fingerprint" not in version.model_dump()  # internal: not printed by --json
    hashed: list[str] = []
    real = artifact_module.sha256_file
    monkeypatch.setattr(artifact_module, "sha256_file", lambda path, **bound: hashed.append(Path(path).name) or real(path, **bound))
    promote(registry, version, "gate passed")
    registry.set_alias("demo-llama", "production", 1)
    registry.resolve("demo-llama", "production")
    assert hashed == []  # nothing changed: stat compared, no file re-read
    (artifact / "config.json").write_text('{"quantization_config": {}}')  # same bytes, new mtime/ctime
    registry.resolve("demo-llama", "production")
    assert hashed == ["config.json"]  # only the file whose stat changed is hashed again


def test_a_gate_json_about_another_manifest_is_refused(registry: Registry, tmp_path: Path) -> None:
    gate = make_gate(tmp_path / "gate.json")
    report = json.loads(gate.read_text())
    report["inputs"] = {"artifact": {"manifest_sha256": "0" * 64}}
    gate.write_text(json.dumps(report))
    with pytest.raises(InputError, match=r"another manifest\.json") as caught:
        registry.register(new_version(make_artifact(tmp_path / "a"), gate))
    assert caught.value.file == str(gate)
    assert registry.list() == []


V1_VERSIONS = """CREATE TABLE versions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, model TEXT NOT NULL, version INTEGER NOT NULL, source_hash TEXT NOT NULL,
    artifact_path TEXT NOT NULL, artifact_hash TEXT NOT NULL, recipe_name TEXT NOT NULL, recipe_hash TEXT NOT NULL,
    eval_sets TEXT NOT NULL, gate_path TEXT, gate TEXT, gate_hash TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('candidate', 'promoted', 'rejected', 'error')),
    created_at TEXT NOT NULL, updated_at TEXT NOT NULL, reason TEXT NOT NULL,
    UNIQUE (model, version), UNIQUE (model, artifact_hash, gate_hash))"""


def make_v1_registry(path: Path, artifact: Path) -> None:
    """A registry file as schema 1 wrote it (no manifest_hash / fingerprint), with one candidate row."""
    from pipelines.registry import sqlite_db

    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute(V1_VERSIONS)
    for statement in sqlite_db.SCHEMA[1:]:
        db.execute(statement)
    db.execute(
        "INSERT INTO versions (model, version, source_hash, artifact_path, artifact_hash, recipe_name, recipe_hash,"
        " eval_sets, gate_path, gate, gate_hash, status, created_at, updated_at, reason)"
        " VALUES ('demo-llama', 1, 's', ?, ?, 'w8a8', 'r', '[]', NULL, NULL, '', 'candidate', 't', 't', '')",
        (artifact.resolve().as_posix(), artifact_hash(artifact)),
    )
    db.execute("INSERT INTO events (at, model, version, kind, reason) VALUES ('t', 'demo-llama', 1, 'registered', '')")
    db.execute("PRAGMA user_version = 1")
    db.close()


def test_a_schema_1_registry_is_migrated_in_place(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a")
    make_v1_registry(tmp_path / "registry.db", artifact)
    registry = Registry(tmp_path / "registry.db")
    with sqlite3.connect(registry.path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        columns = {row[1] for row in db.execute("PRAGMA table_info(versions)")}
    assert {"manifest_hash", "fingerprint"} <= columns
    (old,) = registry.list()
    assert (old.version, old.manifest_hash, old.fingerprint) == (1, None, None)
    # An old row is verified in full (no fingerprint); a successful check records what it saw.
    promoted_old = promote(registry, old, "gate passed")
    assert promoted_old.manifest_hash == sha256_file(artifact / "manifest.json") and promoted_old.fingerprint
    assert Registry(tmp_path / "registry.db").show("demo-llama", 1).status == "promoted"  # reopening is a no-op


@pytest.fixture
def read_only_registry(tmp_path: Path):
    """A registry with one promoted version on a tmpfs remounted read-only (as root, chmod would not stop writes)."""
    import subprocess

    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); test_a_registry_opened_read_only_* covers the logic")
    try:
        registry = Registry(folder / "registry.db")
        promoted(registry, tmp_path, "a")
        remount = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only ({remount.stderr.strip()})")
        yield folder / "registry.db"
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_registry_on_a_read_only_disk_can_be_listed_not_changed(read_only_registry: Path, capsys) -> None:
    registry = Registry(read_only_registry)
    assert registry.read_only
    assert [v.status for v in registry.list()] == ["promoted"]
    assert registry.show("demo-llama", 1).version == 1 and [e.kind for e in registry.history()] == ["registered", "promoted"]
    with pytest.raises(InputError, match="read-only") as caught:
        registry.set_alias("demo-llama", "production", 1)
    assert caught.value.file == str(read_only_registry)
    for argv in (["list"], ["show", "demo-llama", "1"], ["history", "demo-llama"]):
        code, out, err = run_cli(capsys, *argv, "--registry", str(read_only_registry), "--json")
        assert code == 0 and json.loads(out), (argv, err)
    code, _, err = run_cli(capsys, "alias", "demo-llama", "production", "1", "--registry", str(read_only_registry))
    assert code == 2 and "read-only" in err


def test_a_registry_opened_read_only_uses_a_read_only_connection(registry: Registry, tmp_path: Path, monkeypatch) -> None:
    from pipelines.registry import sqlite_db

    promoted(registry, tmp_path, "a")
    monkeypatch.setattr(sqlite_db, "_writable", lambda path: False)  # as for a file the user may not write
    opened: list[str] = []
    real_connect = sqlite3.connect
    monkeypatch.setattr(sqlite_db.sqlite3, "connect", lambda target, *a, **k: opened.append(str(target)) or real_connect(target, *a, **k))
    readonly = Registry(registry.path)
    assert readonly.read_only and [v.version for v in readonly.list()] == [1]
    assert opened and all(target.startswith("file:") and "mode=ro" in target for target in opened)
    with pytest.raises(InputError, match="read-only"):
        readonly.promote(1, "x", UNSIGNED)


@pytest.mark.parametrize("target", ["empty-file", "dangling"])
def test_a_registry_behind_a_symbolic_link_is_refused_and_nothing_is_created(tmp_path: Path, target: str) -> None:
    elsewhere = tmp_path / "elsewhere" / "file.db"
    elsewhere.parent.mkdir()
    if target == "empty-file":
        elsewhere.write_bytes(b"")
    link = tmp_path / "root" / "registry.db"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    with pytest.raises(InputError, match="not a symbolic link"):
        Registry(link)
    assert sorted(p.name for p in elsewhere.parent.iterdir()) == (["file.db"] if target == "empty-file" else [])
    assert elsewhere.read_bytes() == b"" if target == "empty-file" else not elsewhere.exists()


def test_a_folder_where_the_registry_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "registry.db").mkdir()
    with pytest.raises(InputError, match="regular file"):
        Registry(tmp_path / "registry.db")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_evidence_with_a_non_finite_number_is_refused_and_not_stored(registry: Registry, tmp_path: Path, value: float) -> None:
    number = promoted(registry, tmp_path, "a")
    before = len(registry.history("demo-llama"))
    with pytest.raises(InputError, match="finite numbers"):
        registry.record_lineage("demo-llama", number, "probe", {"a": value})
    assert len(registry.history("demo-llama")) == before


def test_the_only_door_to_promoted_is_a_signed_bundle(registry: Registry, tmp_path: Path) -> None:
    """Registry.promote takes the record of a signed promotion bundle, and checks the bundle holds that signature."""
    artifact = make_artifact(tmp_path / "a", weights=b"a")
    version = registry.register(new_version(artifact, make_gate(tmp_path / "a-gate.json")))
    with pytest.raises(TypeError):
        registry.promote(version.id, "no signature")  # type: ignore[call-arg]
    with pytest.raises(InputError) as refused:
        registry.promote(version.id, "a forged record", UNSIGNED)
    assert refused.value.field == "signature" and registry.get(version.id).status == "candidate"
    signed = promote(registry, version)
    (event,) = [e for e in registry.history("demo-llama") if e.kind == "promoted"]
    assert signed.status == "promoted" and event.evidence is not None and event.evidence["signature"]["signature_sha256"]
    assert promote(registry, signed).status == "promoted"  # promoted already: unchanged
