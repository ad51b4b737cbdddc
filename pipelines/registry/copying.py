"""A registry copied between backends (`quantize registry copy --from X --to Y`): SQLite to PostgreSQL when a team takes
over a one-machine registry, or back for an archive. Every version, alias stack entry and event is copied with its id,
in one read snapshot of the source and one write transaction into the target, which must be empty (nothing is merged).
The signed promotion bundles stay where they are: each `promoted` event names its bundle by path, so the copy verifies
on the machine whose disk holds them (or with the same paths mounted)."""

from __future__ import annotations

from typing import Any

from pipelines.errors import InputError
from pipelines.registry.store import Registry

# In foreign-key order: aliases point at versions.
TABLES = ("versions", "aliases", "events")
_ORDER = {"versions": "id", "aliases": "model, alias, seq", "events": "id"}


def copy_registry(source: Registry, target: Registry) -> dict[str, int]:
    """Copy `source` into the empty `target`; returns the rows copied per table."""
    if source.location == target.location:
        raise InputError("the source and the target are the same registry", file=target.location, field="--to")
    with source.db.transaction(write=False) as db:
        rows = {table: [dict(row) for row in db.execute(f"SELECT * FROM {table} ORDER BY {_ORDER[table]}")] for table in TABLES}
    with target.db.transaction(write=True) as db:
        target.db.begin_copy(db)
        held = sum(db.execute(f"SELECT COUNT(*) AS n FROM {table}").fetchone()["n"] for table in TABLES)
        if held:
            raise InputError(f"the target registry is not empty ({held} rows): a copy never merges", file=target.location, field="--to")
        for table in TABLES:
            for row in rows[table]:
                _insert(db, table, row)
        target.db.end_copy(db)
    return {table: len(found) for table, found in rows.items()}


def _insert(db: Any, table: str, row: dict[str, Any]) -> None:
    columns = ", ".join(row)
    db.execute(f"INSERT INTO {table} ({columns}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))
