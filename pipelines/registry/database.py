"""The registry's database layer: one small interface, one implementation per backend.

- pipelines.registry.sqlite_db: one SQLite file, the embedded default (artifacts/registry.db): one user, one machine.
- pipelines.registry.postgres_db: a PostgreSQL database, for a team (many drivers on many machines, Ray workers).

`QUANTGATE_REGISTRY` (or a command's `--registry`) names either: a path, or a `postgresql://` URL. The verbs
(pipelines.registry.store.Registry) write the same SQL to both (qmark parameters; the PostgreSQL connection translates)
inside `Database.transaction`, and call `Connection.lock_model(model)` before they read what they are about to change:
SQLite serialises every write transaction already (BEGIN IMMEDIATE), PostgreSQL takes a per-model transaction lock
there (postgres_db says which and why). Both keep the schema's version (SQLite: PRAGMA user_version, PostgreSQL: the
registry_schema table), refuse a database whose schema is newer than this code, and upgrade an older one under a guard.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from pipelines.console.redact import without_credentials
from pipelines.errors import InputError

# 1: the first schema. 2: versions.manifest_hash (manifest.json's own sha256) and versions.fingerprint
# (stat of every file at the last full verification); a schema-1 database is migrated in place when opened
# for writing (its old rows keep NULL there: they are verified by their artifact hash, in full).
SCHEMA_VERSION = 2
MIGRATE_1_TO_2 = (
    "ALTER TABLE versions ADD COLUMN manifest_hash TEXT",
    "ALTER TABLE versions ADD COLUMN fingerprint TEXT",
)


def table_statements(identity: str, reference: str) -> tuple[str, ...]:
    """The three tables as every backend creates them; `identity` is the dialect's auto-numbered primary key and
    `reference` the type of a column holding one.

    - versions: one row per (source model, artifact, gate evidence); the version number counts per model.
    - aliases:  the current target of each (model, alias) plus a stack of earlier targets for rollback.
    - events:   every registration, status change and alias move, append-only (each backend adds its own trigger).
    """
    return (
        f"""CREATE TABLE IF NOT EXISTS versions (
            id {identity},
            model TEXT NOT NULL,
            version INTEGER NOT NULL,
            source_hash TEXT NOT NULL,
            artifact_path TEXT NOT NULL,
            artifact_hash TEXT NOT NULL,
            recipe_name TEXT NOT NULL,
            recipe_hash TEXT NOT NULL,
            eval_sets TEXT NOT NULL,
            gate_path TEXT,
            gate TEXT,
            gate_hash TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('candidate', 'promoted', 'rejected', 'error')),
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            reason TEXT NOT NULL,
            manifest_hash TEXT,
            fingerprint TEXT,
            UNIQUE (model, version),
            UNIQUE (model, artifact_hash, gate_hash))""",
        # The alias stack: the highest seq is the current target; rollback pops to an earlier one.
        f"""CREATE TABLE IF NOT EXISTS aliases (
            model TEXT NOT NULL,
            alias TEXT NOT NULL,
            seq INTEGER NOT NULL,
            version_id {reference} NOT NULL REFERENCES versions(id),
            at TEXT NOT NULL,
            PRIMARY KEY (model, alias, seq))""",
        f"""CREATE TABLE IF NOT EXISTS events (
            id {identity},
            at TEXT NOT NULL,
            model TEXT NOT NULL,
            version INTEGER,
            kind TEXT NOT NULL,
            alias TEXT,
            from_version INTEGER,
            to_version INTEGER,
            reason TEXT NOT NULL,
            evidence TEXT)""",
    )


# A URL carried as a Path (settings, `--registry` parsed as a path, a job file's resolved path) has its "//" collapsed
# and may have the working directory in front: the URL is found again from its scheme on.
_URL_START = re.compile(r"postgres(?:ql)?:/+")


class Cursor(Protocol):
    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """One open transaction: rows read by column name (row["model"])."""

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> Cursor: ...

    def lock_model(self, model: str) -> None:
        """Serialise this write transaction with every other one that changes `model` (until commit or rollback)."""


class Database(Protocol):
    location: str  # what messages name: the file, or the URL without its password
    path: Path  # the local folder anchor of the signing key and the promotion bundles (<anchor>.parent/keys, /bundles)
    field: str  # the setting that named this database: QUANTGATE_REGISTRY, --registry
    read_only: bool

    def transaction(self, *, write: bool) -> AbstractContextManager[Connection]:
        """A write transaction (the schema created or upgraded first when needed), or a read-only consistent snapshot
        (of an empty registry when none exists yet: a read never creates one)."""

    def begin_copy(self, connection: Connection) -> None:
        """Before rows are copied in with their ids (pipelines.registry.copying): keep every other writer out."""

    def end_copy(self, connection: Connection) -> None:
        """After the copy: ids allocated next come after the copied ones."""


def postgres_url(value: Path | str) -> str | None:
    """The PostgreSQL URL `value` names, or None for a file path."""
    text = str(value)
    found = _URL_START.search(text)
    return "postgresql://" + text[found.end():] if found is not None else None


def files_anchor(value: Path | str) -> Path:
    """Where the registry's files go (the signing key in <anchor>.parent/keys, the promotion bundles beside it): a SQLite
    registry's own file; for a PostgreSQL database, <artifacts>/registry-<database>/registry on the machine that signs."""
    url = postgres_url(value)
    if url is None:
        return Path(value)
    from urllib.parse import urlsplit

    from pipelines.settings import current as current_settings

    try:
        database = urlsplit(url).path.strip("/") or "postgres"
    except ValueError as error:  # an unclosed IPv6 bracket: urllib's refusal, one line naming the URL without its password
        raise InputError(f"not a PostgreSQL URL ({error})", file=without_credentials(url), field="registry") from None
    return current_settings().artifacts_dir / f"registry-{re.sub(r'[^A-Za-z0-9_.-]', '_', database)}" / "registry"


