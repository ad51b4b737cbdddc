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

# 1: the first schema. 2: versions.manifest_hash (manifest.json's own sha256) and versions.fingerprint
# (stat of every file at the last full verification); a schema-1 database is migrated in place when opened
# for writing (its old rows keep NULL there: they are verified by their artifact hash, in full).
SCHEMA_VERSION = 2
MIGRATE_1_TO_2 = (
    "ALTER TABLE versions ADD COLUMN manifest_hash TEXT",
    "ALTER TABLE versions ADD COLUMN fingerprint TEXT",
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

    database = urlsplit(url).path.strip("/") or "postgres"
    return current_settings().artifacts_dir / f"registry-{re.sub(r'[^A-Za-z0-9_.-]', '_', database)}" / "registry"


