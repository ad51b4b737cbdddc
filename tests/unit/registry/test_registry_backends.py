"""The registry's two backends, SQLite and PostgreSQL (a throwaway cluster: tests/postgres_cluster.py), behind one interface:
the same verbs give the same answers; PostgreSQL's bad inputs are one line naming the setting, with nothing written."""

from __future__ import annotations

import itertools
from pathlib import Path

import psycopg
import pytest
from fakes import make_artifact, make_gate, new_version, promote

from pipelines.cli import main
from pipelines.console.redact import without_credentials
from pipelines.errors import InputError
from pipelines.registry.database import postgres_url
from pipelines.registry.store import Registry, open_registry

_names = itertools.count()


def fresh_database(postgres) -> str:
    return postgres.create_database(f"registry_{next(_names)}")


@pytest.fixture(params=["sqlite", "postgres"])
def location(request, tmp_path: Path, monkeypatch) -> str:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))  # PostgreSQL's key and bundles folder
    if request.param == "sqlite":
        return str(tmp_path / "registry.db")
    return fresh_database(request.getfixturevalue("postgres"))


def promoted_version(registry: Registry, tmp_path: Path, name: str, model: str = "demo-llama") -> int:
    artifact = make_artifact(tmp_path / name, weights=name.encode())
    version = registry.register(new_version(artifact, make_gate(tmp_path / f"{name}-gate.json"), model=model))
    return promote(registry, version).version


def test_the_verbs_answer_alike_on_both_backends(location: str, tmp_path: Path) -> None:
    registry = Registry(location)
    assert registry.list() == [] and registry.aliases() == []  # a read creates nothing
    first = promoted_version(registry, tmp_path, "a")
    second = promoted_version(registry, tmp_path, "b")
    other = promoted_version(registry, tmp_path, "c", model="other-model")
    assert (first, second, other) == (1, 2, 1)
    again = registry.register(new_version(tmp_path / "a", tmp_path / "a-gate.json"))
    assert (again.version, again.status) == (1, "promoted")  # idempotent on artifact and evidence
    registry.set_alias("demo-llama", "production", first)
    moved = registry.set_alias("demo-llama", "production", second, reason="better")
    assert (moved.version, moved.previous) == (2, 1)
    with pytest.raises(InputError, match="target of alias"):
        registry.reject(registry.show("demo-llama", 2).id, "regression")
    back = registry.rollback("demo-llama", "production", "incident", evidence={"by": "test"})
    assert (back.version, registry.show("demo-llama", "production").version) == (1, 1)
    assert registry.verify_signature(registry.show("demo-llama", 1), required=True) is not None
    kinds = [event.kind for event in registry.history("demo-llama")]
    assert kinds == ["registered", "promoted", "registered", "promoted", "alias_set", "alias_set", "alias_rollback"]
    assert [v.version for v in registry.list("demo-llama")] == [1, 2]
    assert registry.resolve("demo-llama", "production").aliases == ["production"]
    with pytest.raises(InputError, match="unknown model 'nope'"):
        registry.list("nope")


def test_events_are_append_only_on_postgres(postgres, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    url = fresh_database(postgres)
    promoted_version(Registry(url), tmp_path, "a")
    with psycopg.connect(url, autocommit=True) as connection, pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        connection.execute("DELETE FROM events")


def test_a_url_carried_as_a_path_is_found_again() -> None:
    url = "postgresql://quant:secret@/registry?host=/tmp/sock"
    assert postgres_url(Path(url)) == url
    assert postgres_url(Path("/work/main") / Path(url)) == url  # a job file's path resolved against its folder
    assert postgres_url(Path("/tmp/registry.db")) is None
    assert without_credentials(url) == "postgresql://***@/registry?host=/tmp/sock"
    assert without_credentials("postgresql://u@h/db?password=secret&sslmode=disable") == "postgresql://***@h/db?password=***&sslmode=disable"


def _refused(capsys, registry: str, setting: str, *expected: str, secret: str = "") -> None:
    code = main(["registry", "list", "--registry", registry])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and setting in err, err
    assert all(text in err for text in expected), err
    assert not secret or secret not in err, err


def test_bad_postgres_urls_are_one_line_naming_the_setting(postgres, capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    socket = str(postgres.socket_dir)
    _refused(capsys, "postgresql://postgres@/db?host=/x&nonsense=1", "--registry", "not a PostgreSQL URL")
    _refused(capsys, f"postgresql://postgres@/no_such_database?host={socket}", "--registry", "cannot connect", "no_such_database")
    _refused(capsys, "postgresql://postgres:hunter2@/db?host=/nonexistent/folder", "--registry", "cannot connect", "//***@",
             secret="hunter2")
    # Wrong credentials: a role with a password, the cluster asking it for one (the rest of the cluster trusts).
    hba = postgres.data_dir / "pg_hba.conf"
    hba.write_text("local all quant_reader scram-sha-256\n" + hba.read_text())
    with psycopg.connect(postgres.url(), autocommit=True) as admin:
        admin.execute("CREATE ROLE quant_reader LOGIN PASSWORD 'right-one'")
        admin.execute("SELECT pg_reload_conf()")
    url = fresh_database(postgres)
    monkeypatch.setenv("QUANTGATE_REGISTRY", url.replace("postgres@", "quant_reader:wrong-one@"))
    code = main(["registry", "list"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "QUANTGATE_REGISTRY" in err and "wrong-one" not in err, err


def test_a_role_without_privileges_writes_nothing(postgres, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    url = fresh_database(postgres)
    with psycopg.connect(postgres.url(), autocommit=True) as admin:
        admin.execute("CREATE ROLE quant_guest LOGIN")
    guest = url.replace("postgres@", "quant_guest@")
    registry = Registry(guest)
    assert registry.list() == []
    with pytest.raises(InputError, match="permission denied") as caught:
        registry.register(new_version(make_artifact(tmp_path / "a"), make_gate(tmp_path / "g.json")))
    assert caught.value.field == "registry"
    with psycopg.connect(url) as connection:
        assert connection.execute("SELECT to_regclass('versions')").fetchone() == (None,)


def test_a_schema_from_the_future_is_refused_and_an_upgrade_waits_for_writers_to_stop(postgres, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    url = fresh_database(postgres)
    promoted_version(Registry(url), tmp_path, "a")
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("UPDATE registry_schema SET version = 99")
        with pytest.raises(InputError, match="registry schema 99 .* is newer than this quantgate's"):
            open_registry(url, field="QUANTGATE_REGISTRY")
        # A schema-1 database (no manifest_hash / fingerprint) is upgraded only with no other client connected.
        admin.execute("ALTER TABLE versions DROP COLUMN manifest_hash, DROP COLUMN fingerprint")
        admin.execute("UPDATE registry_schema SET version = 1")
        stale = Registry(url)
        with pytest.raises(InputError, match="other client"):
            stale.register(new_version(make_artifact(tmp_path / "b", b"b"), make_gate(tmp_path / "gb.json")))
        del stale  # its connection closed: a writer stopped
    assert [v.version for v in Registry(url).list()] == [1]  # still readable, still schema 1
    promoted_version(Registry(url), tmp_path, "c")  # the admin gone: upgraded, then written
    with psycopg.connect(url) as connection:
        assert connection.execute("SELECT version FROM registry_schema").fetchone() == (2,)


def test_a_registry_copied_to_postgres_and_back_keeps_everything(postgres, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    source = Registry(tmp_path / "registry.db")
    first, second = promoted_version(source, tmp_path, "a"), promoted_version(source, tmp_path, "b")
    source.set_alias("demo-llama", "production", first)
    source.set_alias("demo-llama", "production", second)
    source.register(new_version(make_artifact(tmp_path / "c", b"c"), make_gate(tmp_path / "c-gate.json")))
    url = fresh_database(postgres)
    assert main(["registry", "copy", "--from", str(source.path), "--to", url]) == 0
    assert "copied 3 versions, 2 alias entries and 7 events" in capsys.readouterr().out
    back = tmp_path / "back" / "registry.db"
    assert main(["registry", "copy", "--from", url, "--to", str(back)]) == 0
    for copy in (Registry(url), Registry(back)):
        assert copy.list() == source.list() and copy.history() == source.history() and copy.aliases() == source.aliases()
        assert copy.verify_signature(copy.show("demo-llama", "production"), required=True) is not None
    copied = Registry(url)
    assert copied.rollback("demo-llama", "production").version == first  # the alias stack came along
    fourth = copied.register(new_version(make_artifact(tmp_path / "d", b"d"), make_gate(tmp_path / "d-gate.json")))
    assert (fourth.id, fourth.version) == (4, 4)  # ids continue after the copied ones
    capsys.readouterr()
    assert main(["registry", "copy", "--from", str(source.path), "--to", url]) == 2
    assert "--to: the target registry is not empty" in capsys.readouterr().err
