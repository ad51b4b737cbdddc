"""The registry's records: what a version, an event and an alias target are, and the rules on them that need no database
(status transitions, alias names, a stored gate.json read back). The database layer (pipelines.registry.database) stores
them; the verbs (pipelines.registry.store.Registry) change them."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.errors import InputError
from pipelines.gate.schema import GateReport

Status = Literal["candidate", "promoted", "rejected", "error"]
# lineage: a repair (pipelines.repair) derived this version from a rejected one; the evidence names both.
EventKind = Literal["registered", "promoted", "rejected", "error", "alias_set", "alias_rollback", "lineage", "regated"]



class EvalSetRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    hash: str = Field(min_length=1)


class NewVersion(BaseModel):
    """What the caller knows about a candidate artifact; the registry adds hashes it computes itself."""

    model_config = ConfigDict(extra="forbid")

    source_model: str = Field(min_length=1)
    source_hash: str = Field(min_length=1)
    artifact_path: Path
    recipe_name: str = Field(min_length=1)
    recipe_hash: str = Field(min_length=1)
    eval_sets: list[EvalSetRef] = Field(default_factory=list)
    gate_path: Path | None = None
    reason: str = ""


class Version(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: int
    model: str
    version: int
    source_hash: str
    artifact_path: str
    artifact_hash: str
    recipe_name: str
    recipe_hash: str
    eval_sets: list[EvalSetRef]
    gate_path: str | None
    # gate.json as registered; None without evidence, or for evidence older than gate.json schema 2.
    gate: GateReport | None
    gate_hash: str | None
    status: Status
    created_at: str
    updated_at: str
    reason: str
    aliases: list[str] = Field(default_factory=list)
    # sha256 of manifest.json itself; None for versions registered before schema 2.
    manifest_hash: str | None = None
    # stat of every file at the last full verification (internal: what makes later checks cheap).
    fingerprint: dict[str, list[int]] | None = Field(default=None, exclude=True, repr=False)

    @property
    def verdict(self) -> str | None:
        """The gate's verdict on this version, from its evidence."""
        return self.gate.gate.verdict if self.gate is not None else None


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: int
    at: str
    model: str
    version: int | None
    kind: EventKind
    alias: str | None
    from_version: int | None
    to_version: int | None
    reason: str
    evidence: dict[str, Any] | None


class AliasTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    alias: str
    version: int
    previous: int | None



# Statuses a version may move to, from each status. Rejecting a promoted version is allowed (a
# regression found later) as long as no alias points at it.
TRANSITIONS: dict[str, set[str]] = {
    "candidate": {"promoted", "rejected", "error"},
    "promoted": {"rejected"},
    "rejected": set(),
    "error": set(),
}




def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def stored_gate(text: str | None) -> GateReport | None:
    """A registered gate.json, typed. Evidence registered before gate.json schema 2 does not validate:
    its copy stays in the database (and its hash in the version's identity), `Version.gate` is None."""
    if not text:
        return None
    try:
        return GateReport.model_validate_json(text)
    except ValidationError:
        return None


def check_alias_name(alias: str) -> None:
    # ASCII only: str.isalnum() accepts every script, and a Cyrillic 'о' in 'prоd' would stand beside 'prod'.
    if not alias or alias.isdigit() or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in alias):
        raise InputError(
            f"alias must be ASCII letters, digits, '-', '_' or '.' and not a bare number (got {alias!r})", field="alias"
        )


def event_from_row(row: Any) -> Event:
    values = dict(row)
    values["evidence"] = json.loads(values["evidence"]) if values["evidence"] else None
    return Event(**values)


def version_from_row(row: Any, aliases: list[str]) -> Version:
    """A versions row (sqlite3.Row or a dict) as a Version; a schema-1 SQLite file opened read-only lacks the last two columns."""
    columns = row.keys()
    fingerprint = json.loads(row["fingerprint"]) if "fingerprint" in columns and row["fingerprint"] else None
    return Version(
        id=row["id"], model=row["model"], version=row["version"], source_hash=row["source_hash"],
        artifact_path=row["artifact_path"], artifact_hash=row["artifact_hash"],
        recipe_name=row["recipe_name"], recipe_hash=row["recipe_hash"],
        eval_sets=[EvalSetRef(**ref) for ref in json.loads(row["eval_sets"])],
        gate_path=row["gate_path"], gate=stored_gate(row["gate"]),
        gate_hash=row["gate_hash"] or None, status=row["status"], created_at=row["created_at"],
        updated_at=row["updated_at"], reason=row["reason"], aliases=aliases,
        manifest_hash=row["manifest_hash"] if "manifest_hash" in columns else None,
        fingerprint=fingerprint if isinstance(fingerprint, dict) else None,
    )
