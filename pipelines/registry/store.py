"""The model registry: versions of quantized artifacts, their gate evidence, status and aliases.

One SQLite file (artifacts/registry.db unless QUANTGATE_REGISTRY or an argument says otherwise).
Every write is one `BEGIN IMMEDIATE` transaction, so concurrent processes serialise on the database
lock instead of losing updates; WAL mode lets readers go on while one writes. Three tables:

- versions: one row per (source model, artifact, gate evidence); the version number counts per model.
- aliases:  the current target of each (model, alias) plus a stack of earlier targets for rollback.
- events:   every registration, status change and alias move, append-only.

The registry never points at something incomplete: an artifact is verified against its manifest
when it is registered, promoted, given an alias, rolled back to, or resolved for serving. A version
records its manifest.json's own sha256 and the stat fingerprint of its files at the last full
verification, so these later checks re-hash only files whose size, mtime, ctime or inode changed
(pipelines.artifact.verify_artifact says what that costs). gate.json is read once, into the typed
pipelines.gate.schema.GateReport, when a version is registered; `Version.gate` returns it.

Reading (list, show, history, resolve) opens the file read-only (`file:...?mode=ro`), so a registry on
a read-only disk, or a file the user may not write, can still be inspected.
"""

from __future__ import annotations

import builtins  # Registry.list shadows the built-in inside the class
import json
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.artifact import MANIFEST_FILES_KEY, MANIFEST_NAME, ArtifactCheck, verify_artifact  # noqa: F401 (re-exported)
from pipelines.errors import InputError
from pipelines.files.hashing import sha256_json
from pipelines.gate.schema import GateReport, read_report
from pipelines.registry.evidence import verify_promotion
from pipelines.registry.signing import SignatureRecord, require_signed_bundle
from pipelines.settings import current as current_settings

if TYPE_CHECKING:
    from pipelines.registry.evidence import PromotionCheck

BUSY_TIMEOUT_S = 60.0
# 1: the first schema. 2: versions.manifest_hash (manifest.json's own sha256) and versions.fingerprint
# (stat of every file at the last full verification); a schema-1 file is migrated in place when opened
# for writing (its old rows keep NULL there: they are verified by their artifact hash, in full).
SCHEMA_VERSION = 2

Status = Literal["candidate", "promoted", "rejected", "error"]
# lineage: a repair (pipelines.repair) derived this version from a rejected one; the evidence names both.
EventKind = Literal["registered", "promoted", "rejected", "error", "alias_set", "alias_rollback", "lineage", "regated"]


def default_registry_path() -> Path:
    """$QUANTGATE_REGISTRY, else <artifacts>/registry.db, as the environment says now."""
    return current_settings().registry_path


# --- data ---------------------------------------------------------------------------------------------


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


# Schema 1 -> 2, in place.
_MIGRATE_1_TO_2 = (
    "ALTER TABLE versions ADD COLUMN manifest_hash TEXT",
    "ALTER TABLE versions ADD COLUMN fingerprint TEXT",
)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS versions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
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
    """CREATE TABLE IF NOT EXISTS aliases (
        model TEXT NOT NULL,
        alias TEXT NOT NULL,
        seq INTEGER NOT NULL,
        version_id INTEGER NOT NULL REFERENCES versions(id),
        at TEXT NOT NULL,
        PRIMARY KEY (model, alias, seq))""",
    """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at TEXT NOT NULL,
        model TEXT NOT NULL,
        version INTEGER,
        kind TEXT NOT NULL,
        alias TEXT,
        from_version INTEGER,
        to_version INTEGER,
        reason TEXT NOT NULL,
        evidence TEXT)""",
    """CREATE TRIGGER IF NOT EXISTS events_no_update BEFORE UPDATE ON events
        BEGIN SELECT RAISE(ABORT, 'registry events are append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS events_no_delete BEFORE DELETE ON events
        BEGIN SELECT RAISE(ABORT, 'registry events are append-only'); END""",
)

# Statuses a version may move to, from each status. Rejecting a promoted version is allowed (a
# regression found later) as long as no alias points at it.
_TRANSITIONS: dict[str, set[str]] = {
    "candidate": {"promoted", "rejected", "error"},
    "promoted": {"rejected"},
    "rejected": set(),
    "error": set(),
}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _stored_gate(text: str | None) -> GateReport | None:
    """A registered gate.json, typed. Evidence registered before gate.json schema 2 does not validate:
    its copy stays in the database (and its hash in the version's identity), `Version.gate` is None."""
    if not text:
        return None
    try:
        return GateReport.model_validate_json(text)
    except ValidationError:
        return None


def verify_version(version: Version) -> ArtifactCheck:
    """A version's artifact against what was recorded: manifest.json's own hash, then each file (re-hashed
    only where its stat differs from the fingerprint of the last full verification)."""
    artifact_dir = Path(version.artifact_path)
    check = verify_artifact(artifact_dir, manifest_sha256=version.manifest_hash, fingerprint=version.fingerprint)
    if check.artifact_hash != version.artifact_hash:
        raise InputError(
            f"manifest changed since version {version.version} of {version.model!r} was registered",
            file=artifact_dir / MANIFEST_NAME,
        )
    return check


def _writable(path: Path) -> bool:
    """Whether SQLite can write `path`: the file and its folder (journal, WAL and shared-memory files)."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)


def _creatable(path: Path) -> bool:
    """Whether the registry file could be made: its nearest existing folder can be written."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


@contextmanager
def _empty_registry() -> Iterator[sqlite3.Connection]:
    """What a reader sees of a registry not created yet: the schema, no rows (in memory: no file is made)."""
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.row_factory = sqlite3.Row
    try:
        for statement in _SCHEMA:
            db.execute(statement)
        yield db
    finally:
        db.close()


def _set_wal(db: sqlite3.Connection) -> None:
    """Switch the file to WAL, waiting up to BUSY_TIMEOUT_S. The switch reads and then needs the exclusive lock;
    while another connection holds the write lock SQLite refuses that upgrade at once (SQLITE_BUSY) instead of
    calling the busy handler, to avoid a deadlock: two first opens of a fresh file meet exactly there."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL").fetchone()
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# --- the registry ------------------------------------------------------------------------------------


class Registry:
    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_registry_path()
        # SQLite follows a link (and creates -wal/-shm beside its target): the registry is a regular file or nothing.
        if self.path.is_symlink():
            raise InputError("the registry must be a regular file, not a symbolic link", file=self.path, field="registry")
        if self.path.exists() and not self.path.is_file():
            raise InputError("the registry must be a regular file", file=self.path, field="registry")
        # An existing registry the user may not write (read-only disk or permissions) is opened for
        # reading only: list / show / history work, writes say why they cannot.
        exists = self.path.exists()
        self.read_only = not _writable(self.path) if exists else not _creatable(self.path)
        self._schema_ready = False  # this instance has seen the schema in place (created or migrated)
        if self.read_only and exists:
            self._check_readable()
        elif exists:
            self._create_schema()
            self._schema_ready = True
        # A registry that does not exist yet is created by its first write, never by a read: `registry list`
        # on a root without one answers "none" and leaves nothing behind.

    def _create(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InputError(f"cannot create the registry's folder ({error.strerror or error})", file=self.path) from None
        self._create_schema()

    # connection handling

    def _connect(self, *, read_only: bool = False) -> sqlite3.Connection:
        try:
            db = self._open_read_only() if read_only else sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if not read_only:
                db.execute("PRAGMA foreign_keys = ON")
                db.execute("PRAGMA synchronous = FULL")
        except sqlite3.DatabaseError as error:
            raise InputError(f"cannot open the registry database ({error})", file=self.path) from None
        return db

    def _open_read_only(self) -> sqlite3.Connection:
        """`mode=ro`. A WAL file in a folder nobody may write has no shared-memory file and cannot be
        created one; then `immutable=1` (safe there: no writer can be at work in that folder either)."""
        if not self.path.is_file():
            raise sqlite3.OperationalError("no such file")
        uri = f"file:{urllib.parse.quote(str(self.path.resolve()))}?mode=ro"
        db = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.OperationalError:
            db.close()
            if not self.read_only:
                raise
        return sqlite3.connect(uri + "&immutable=1", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)

    @contextmanager
    def _transaction(self, mode: Literal["IMMEDIATE", "DEFERRED"] = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """One transaction. IMMEDIATE takes the write lock at BEGIN, so read-then-write cannot race;
        DEFERRED (readers, on a read-only connection) gives one consistent snapshot across several SELECTs."""
        if mode == "IMMEDIATE" and self.read_only:
            raise InputError(
                "the registry is read-only here (the file or its folder cannot be written): it can be listed, not changed",
                file=self.path,
            )
        if mode == "IMMEDIATE" and not self._schema_ready:
            # The first write creates the file and its schema (in a transaction of its own); a file another process is
            # creating right now is waited for under its write lock, never written before its tables exist.
            self._schema_ready = True  # before: creating the schema is itself a write through here
            try:
                self._create()
            except BaseException:
                self._schema_ready = False
                raise
        db = self._connect(read_only=mode == "DEFERRED")
        try:
            db.execute(f"BEGIN {mode}")
            try:
                yield db
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.DatabaseError as error:
            raise InputError(f"registry database error ({error})", file=self.path) from None
        finally:
            db.close()

    def _reader(self) -> AbstractContextManager[sqlite3.Connection]:
        # A file without tables yet is a registry another process is creating this instant: empty, as none at all.
        if not self.path.exists() or (not self._schema_ready and not self._has_tables()):
            return _empty_registry()
        return self._transaction("DEFERRED")

    def _has_tables(self) -> bool:
        db = self._connect(read_only=True)
        try:
            return db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'versions'").fetchone()[0] > 0
        except sqlite3.DatabaseError:
            return False
        finally:
            db.close()

    def _check_readable(self) -> None:
        db = self._connect(read_only=True)
        try:
            found = db.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as error:
            raise InputError(f"not a registry database ({error})", file=self.path) from None
        finally:
            db.close()
        if found > SCHEMA_VERSION:
            raise InputError(f"registry schema {found} is newer than this quantgate's ({SCHEMA_VERSION})", file=self.path)
        if not {"versions", "aliases", "events"} <= tables:
            raise InputError("not a registry database (no versions, aliases and events tables)", file=self.path)

    def _create_schema(self) -> None:
        db = self._connect()
        try:
            # WAL is a property of the file, kept once set: readers never wait for a writer.
            _set_wal(db)
            found = db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as error:
            raise InputError(f"not a registry database ({error})", file=self.path) from None
        finally:
            db.close()
        if found == SCHEMA_VERSION:
            return
        if found > SCHEMA_VERSION:
            raise InputError(f"registry schema {found} is newer than this quantgate's ({SCHEMA_VERSION})", file=self.path)
        with self._transaction() as db:
            # Read again under the write lock: another process may have created or migrated it meanwhile.
            found = db.execute("PRAGMA user_version").fetchone()[0]
            if found == 1:
                for statement in _MIGRATE_1_TO_2:
                    db.execute(statement)
            elif found == 0:  # CREATE ... IF NOT EXISTS: concurrent first opens are safe
                for statement in _SCHEMA:
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # writing

    def register(self, entry: NewVersion, *, verified: ArtifactCheck | None = None) -> Version:
        """Add a candidate version; the same artifact with the same gate evidence returns the existing one.

        The artifact is verified first: in full, or against `verified` (an earlier check of the same
        folder, e.g. the gate's before serving: then only files whose stat changed are re-hashed, and
        manifest.json must be the one that check saw). The gate evidence must be a gate.json (a GateReport,
        read once here); one that names another manifest.json (inputs.artifact.manifest_sha256) is refused.
        """
        artifact_dir = Path(entry.artifact_path).resolve()
        if verified is not None and Path(verified.artifact_dir).resolve() != artifact_dir:
            verified = None
        check = verify_artifact(
            artifact_dir,
            manifest_sha256=verified.manifest_sha256 if verified else None,
            fingerprint=verified.fingerprint if verified else None,
        )
        a_hash = check.artifact_hash
        report, gate = read_report(Path(entry.gate_path)) if entry.gate_path is not None else (None, None)
        judged = report.manifest_sha256 if report is not None else None
        if judged is not None and judged != check.manifest_sha256:
            raise InputError(
                f"the gate evidence judged another manifest.json (sha256 {judged[:12]}...; {artifact_dir / MANIFEST_NAME}"
                f" is {check.manifest_sha256[:12]}...)",
                file=entry.gate_path, field="inputs.artifact.manifest_sha256",
            )
        g_hash = sha256_json(gate) if gate is not None else ""
        with self._transaction() as db:
            existing = db.execute(
                "SELECT id FROM versions WHERE model = ? AND artifact_hash = ? AND gate_hash = ?",
                (entry.source_model, a_hash, g_hash),
            ).fetchone()
            if existing:
                return self._version_by_id(db, existing["id"])
            number = db.execute(
                "SELECT COALESCE(MAX(version), 0) + 1 FROM versions WHERE model = ?", (entry.source_model,)
            ).fetchone()[0]
            now = _now()
            cursor = db.execute(
                "INSERT INTO versions (model, version, source_hash, artifact_path, artifact_hash, recipe_name,"
                " recipe_hash, eval_sets, gate_path, gate, gate_hash, status, created_at, updated_at, reason,"
                " manifest_hash, fingerprint)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'candidate', ?, ?, ?, ?, ?)",
                (
                    entry.source_model, number, entry.source_hash, artifact_dir.as_posix(), a_hash,
                    entry.recipe_name, entry.recipe_hash,
                    json.dumps([ref.model_dump() for ref in entry.eval_sets]),
                    Path(entry.gate_path).resolve().as_posix() if entry.gate_path is not None else None,
                    json.dumps(gate) if gate is not None else None, g_hash, now, now, entry.reason,
                    check.manifest_sha256, json.dumps(check.fingerprint),
                ),
            )
            self._event(db, entry.source_model, number, "registered", reason=entry.reason)
            assert cursor.lastrowid is not None  # an INSERT into a table with an INTEGER PRIMARY KEY
            return self._version_by_id(db, cursor.lastrowid)

    def promotable(self, version: Version, *, override_gate: bool = False) -> bool:
        """Whether `version` is still to be promoted: False when it is promoted already; an InputError when it cannot be
        (its own gate evidence says rejected and there is no explicit override, or its status cannot become promoted)."""
        if version.verdict == "rejected" and not override_gate:
            raise InputError(
                f"the gate rejected version {version.version} of {version.model!r} ({version.gate_path});"
                " promoting it needs an explicit gate override",
                file=self.path, field="status",
            )
        current = self.get(version.id)
        if current.status == "promoted":
            return False
        if "promoted" not in _TRANSITIONS[current.status]:
            raise InputError(f"version {current.version} of {current.model!r} is {current.status} and cannot become promoted",
                             file=self.path, field="status")
        return True

    def promote(self, version_id: int, reason: str, signature: SignatureRecord, evidence: dict[str, Any] | None = None, *,
                override_gate: bool = False) -> Version:
        """Mark a version promoted: only with the record of its signed promotion bundle, whose signature file must be
        the one recorded (pipelines.registry.promotion.promote_signed assembles, signs and calls this: the one door),
        and after verifying its artifact files against the manifest. A version whose own gate evidence says `rejected`
        is only promoted with override_gate=True, which is recorded in the event's evidence."""
        version = self.get(version_id)
        if self.read_only:
            with self._transaction():  # the read-only refusal, before any check
                pass
        self.promotable(version, override_gate=override_gate)
        require_signed_bundle(signature)
        check = verify_version(version)
        evidence = {**(evidence or {}), "signature": signature.model_dump()}
        if override_gate:
            evidence["override_gate"] = True
        return self._set_status(version_id, "promoted", reason, evidence, check=check)

    def reject(self, version_id: int, reason: str, evidence: dict[str, Any] | None = None) -> Version:
        return self._set_status(version_id, "rejected", reason, evidence)

    def mark_error(self, version_id: int, reason: str, evidence: dict[str, Any] | None = None) -> Version:
        """The version could not be judged (scoring or serving failed)."""
        return self._set_status(version_id, "error", reason, evidence)

    def set_alias(self, model: str, alias: str, version: int, reason: str = "") -> AliasTarget:
        """Point `alias` at a promoted version, after verifying its artifact; the previous target is kept for `rollback`."""
        _check_alias_name(alias)
        # Verified outside the write lock (a full hash may take minutes), then re-read under it.
        with self._reader() as db:
            target = self._promoted_row(db, model, version)
            stored = self._version_by_id(db, target["id"])
        check = verify_version(stored)
        self.verify_signature(stored)
        with self._transaction() as db:
            target = self._promoted_row(db, model, version)
            self._refresh_fingerprint(db, target["id"], check)
            current = self._alias_top(db, model, alias)
            if current is not None and current["version_id"] == target["id"]:
                return self._alias_target(db, model, alias)
            seq = (current["seq"] + 1) if current is not None else 1
            db.execute(
                "INSERT INTO aliases (model, alias, seq, version_id, at) VALUES (?, ?, ?, ?, ?)",
                (model, alias, seq, target["id"], _now()),
            )
            from_version = self._number_of(db, current["version_id"]) if current is not None else None
            self._event(db, model, version, "alias_set", alias=alias, from_version=from_version,
                        to_version=version, reason=reason)
            return self._alias_target(db, model, alias)

    def rollback(self, model: str, alias: str, reason: str = "", *, to_version: int | None = None,
                 evidence: dict[str, Any] | None = None, require_signature: bool = False) -> AliasTarget:
        """Move `alias` back to the promoted version it pointed at before its current one (or, with `to_version`, to that
        earlier entry of its stack), after verifying that version's artifact and its signed bundle (required with
        `require_signature`: a version promoted before signing is then refused). `evidence` is kept in the event."""
        with self._reader() as db:
            current, earlier = self._rollback_step(db, model, alias, to_version)
            stored = self._version_by_id(db, earlier["version_id"])
        check = verify_version(stored)
        self.verify_signature(stored, required=require_signature)
        with self._transaction() as db:
            moved = (current["seq"], earlier["version_id"])
            current, earlier = self._rollback_step(db, model, alias, to_version)
            if (current["seq"], earlier["version_id"]) != moved:
                raise InputError(f"alias {alias!r} of {model!r} moved while rolling back; run the rollback again",
                                 file=self.path, field="alias")
            self._refresh_fingerprint(db, earlier["version_id"], check)
            # Pop the stack down to the earlier target; the events table keeps the full story.
            db.execute("DELETE FROM aliases WHERE model = ? AND alias = ? AND seq > ?", (model, alias, earlier["seq"]))
            self._event(db, model, earlier["version"], "alias_rollback", alias=alias,
                        from_version=self._number_of(db, current["version_id"]),
                        to_version=earlier["version"], reason=reason, evidence=evidence)
            return self._alias_target(db, model, alias)

    def alias_stack(self, model: str, alias: str) -> builtins.list[int]:
        """The versions `alias` has pointed at and can roll back to, its current target first."""
        with self._reader() as db:
            if self._alias_top(db, model, alias) is None:
                raise self._unknown_alias(db, model, alias)
            rows = db.execute(
                "SELECT v.version FROM aliases a JOIN versions v ON v.id = a.version_id WHERE a.model = ? AND a.alias = ?"
                " ORDER BY a.seq DESC", (model, alias),
            ).fetchall()
            return [row["version"] for row in rows]

    # reading

    def list(self, model: str | None = None) -> list[Version]:
        with self._reader() as db:
            if model is not None:
                self._require_model(db, model)
            rows = db.execute(
                "SELECT id FROM versions WHERE (? IS NULL OR model = ?) ORDER BY model, version", (model, model)
            ).fetchall()
            return [self._version_by_id(db, row["id"]) for row in rows]

    def show(self, model: str, version: int | str) -> Version:
        """A version by number or alias, as recorded (its files are not checked; see `resolve`)."""
        with self._reader() as db:
            return self._version_by_id(db, self._lookup_id(db, model, version))

    def get(self, version_id: int) -> Version:
        """A version by its registry id (`Version.id`)."""
        with self._reader() as db:
            return self._version_by_id(db, version_id)

    def aliases(self, model: str | None = None) -> builtins.list[AliasTarget]:
        with self._reader() as db:
            rows = db.execute(
                "SELECT DISTINCT model, alias FROM aliases WHERE (? IS NULL OR model = ?) ORDER BY model, alias",
                (model, model),
            ).fetchall()
            return [self._alias_target(db, row["model"], row["alias"]) for row in rows]

    def history(self, model: str | None = None, *, version: int | None = None,
                alias: str | None = None) -> builtins.list[Event]:
        with self._reader() as db:
            if model is not None:
                self._require_model(db, model)
            rows = db.execute(
                "SELECT * FROM events WHERE (? IS NULL OR model = ?) AND (? IS NULL OR alias = ?)"
                " AND (? IS NULL OR version = ? OR from_version = ? OR to_version = ?) ORDER BY id",
                (model, model, alias, alias, version, version, version, version),
            ).fetchall()
        try:
            return [_event_from_row(row) for row in rows]
        except (ValueError, TypeError, RecursionError) as error:  # ValueError: JSON and pydantic errors among them
            problem = " ".join(str(error).split())[:300]
            raise InputError(f"an event row is malformed ({type(error).__name__}: {problem})", file=self.path, field="events") from None

    def record_lineage(self, model: str, version: int, reason: str, evidence: dict[str, Any]) -> None:
        """Where `version` came from (a `lineage` event): e.g. the rejected version a repair started from and the
        overrides it added. Appended like every event; the version itself is not changed."""
        with self._transaction() as db:
            self._version_row(db, model, version)
            self._event(db, model, version, "lineage", reason=reason, evidence=evidence)

    def record_regate(self, model: str, version: int, reason: str, evidence: dict[str, Any]) -> None:
        """A re-gate of a promoted version on another runtime (a `regated` event holding its signature record:
        pipelines.registry.regates). Appended like every event; the version's status is not changed."""
        with self._transaction() as db:
            if self._version_row(db, model, version)["status"] != "promoted":
                raise InputError(f"version {version} of {model!r} is no longer promoted; its re-gate is not recorded", file=self.path,
                                 field="status")
            self._event(db, model, version, "regated", reason=reason, evidence=evidence)

    def verify_signature(self, version: Version, *, required: bool = False) -> PromotionCheck | None:
        """The version's signed promotion bundle: signature, every file, evidence (pipelines.registry.evidence.verify_promotion).
        A version promoted before signing has none: None, or an InputError when `required`."""

        promoted = [e for e in self.history(version.model, version=version.version) if e.kind == "promoted" and e.version == version.version]
        return verify_promotion(promoted[-1].evidence if promoted else None, version, required=required, registry=self.path)

    def resolve(self, model: str, alias_or_version: str | int) -> Version:
        """The version an alias or a version number names, with its artifact verified for serving."""
        version = self.show(model, alias_or_version)
        verify_version(version)
        return version

    # internals

    def _set_status(self, version_id: int, status: Literal["promoted", "rejected", "error"], reason: str, evidence: dict[str, Any] | None,
                    *, check: ArtifactCheck | None = None) -> Version:
        with self._transaction() as db:
            row = self._row_by_id(db, version_id)
            if row["status"] == status:
                return self._version_by_id(db, version_id)
            if status not in _TRANSITIONS[row["status"]]:
                raise InputError(
                    f"version {row['version']} of {row['model']!r} is {row['status']} and cannot become {status}",
                    file=self.path, field="status",
                )
            holding = self._aliases_of(db, version_id)
            if holding:
                raise InputError(
                    f"version {row['version']} of {row['model']!r} is the target of alias(es) {', '.join(holding)};"
                    " move or roll them back first",
                    file=self.path, field="alias",
                )
            db.execute(
                "UPDATE versions SET status = ?, reason = ?, updated_at = ? WHERE id = ?",
                (status, reason, _now(), version_id),
            )
            self._refresh_fingerprint(db, version_id, check)
            self._event(db, row["model"], row["version"], status, reason=reason, evidence=evidence)
            return self._version_by_id(db, version_id)

    def _refresh_fingerprint(self, db: sqlite3.Connection, version_id: int, check: ArtifactCheck | None) -> None:
        """After a check that had to re-hash files (stat changed, content intact), remember the new stat."""
        if check is None or not check.hashed:
            return
        row = self._row_by_id(db, version_id)
        if row["artifact_hash"] == check.artifact_hash:
            db.execute(
                "UPDATE versions SET fingerprint = ?, manifest_hash = COALESCE(manifest_hash, ?) WHERE id = ?",
                (json.dumps(check.fingerprint), check.manifest_sha256, version_id),
            )

    def _promoted_row(self, db: sqlite3.Connection, model: str, version: int) -> sqlite3.Row:
        target = self._version_row(db, model, version)
        if target["status"] != "promoted":
            raise InputError(
                f"version {version} of {model!r} is {target['status']}; only promoted versions can carry an alias",
                file=self.path, field="version",
            )
        return target

    def _rollback_step(self, db: sqlite3.Connection, model: str, alias: str, to_version: int | None = None) -> tuple[sqlite3.Row, sqlite3.Row]:
        """The alias's current entry and the promoted entry a rollback returns to (the nearest earlier one, or the nearest
        earlier one of `to_version`)."""
        current = self._alias_top(db, model, alias)
        if current is None:
            raise self._unknown_alias(db, model, alias)
        earlier = db.execute(
            "SELECT a.seq, a.version_id, v.version FROM aliases a JOIN versions v ON v.id = a.version_id"
            " WHERE a.model = ? AND a.alias = ? AND a.seq < ? AND v.status = 'promoted'"
            " AND a.version_id != ? AND (? IS NULL OR v.version = ?) ORDER BY a.seq DESC LIMIT 1",
            (model, alias, current["seq"], current["version_id"], to_version, to_version),
        ).fetchone()
        if earlier is None:
            what = "no earlier promoted version" if to_version is None else f"no earlier promoted entry of version {to_version}"
            raise InputError(f"alias {alias!r} of {model!r} has {what} to roll back to", file=self.path, field="alias")
        return current, earlier

    def _event(self, db: sqlite3.Connection, model: str, version: int | None, kind: EventKind, *,
               alias: str | None = None, from_version: int | None = None, to_version: int | None = None,
               reason: str = "", evidence: dict[str, Any] | None = None) -> None:
        try:  # the events table is append-only evidence: JSON as its readers parse it, never Infinity or NaN
            stored = json.dumps(evidence, default=str, allow_nan=False) if evidence is not None else None
        except ValueError:
            raise InputError("evidence must hold finite numbers only (no Infinity or NaN)", field="evidence") from None
        db.execute(
            "INSERT INTO events (at, model, version, kind, alias, from_version, to_version, reason, evidence)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (_now(), model, version, kind, alias, from_version, to_version, reason, stored),
        )

    def _row_by_id(self, db: sqlite3.Connection, version_id: int) -> sqlite3.Row:
        row = db.execute("SELECT * FROM versions WHERE id = ?", (version_id,)).fetchone()
        if row is None:
            raise InputError(f"no registry entry with id {version_id}", file=self.path, field="version_id")
        return row

    def _version_by_id(self, db: sqlite3.Connection, version_id: int) -> Version:
        row = self._row_by_id(db, version_id)
        try:
            return self._version_from_row(db, row)
        except (ValueError, TypeError, KeyError, RecursionError) as error:  # ValueError: JSON and pydantic errors among them
            problem = " ".join(str(error).split())[:300]
            raise InputError(f"version row {version_id} is malformed ({type(error).__name__}: {problem})", file=self.path,
                             field="versions") from None

    def _version_from_row(self, db: sqlite3.Connection, row: sqlite3.Row) -> Version:
        version_id = row["id"]
        columns = row.keys()  # a schema-1 file opened read-only has no manifest_hash / fingerprint
        fingerprint = json.loads(row["fingerprint"]) if "fingerprint" in columns and row["fingerprint"] else None
        return Version(
            id=row["id"], model=row["model"], version=row["version"], source_hash=row["source_hash"],
            artifact_path=row["artifact_path"], artifact_hash=row["artifact_hash"],
            recipe_name=row["recipe_name"], recipe_hash=row["recipe_hash"],
            eval_sets=[EvalSetRef(**ref) for ref in json.loads(row["eval_sets"])],
            gate_path=row["gate_path"], gate=_stored_gate(row["gate"]),
            gate_hash=row["gate_hash"] or None, status=row["status"], created_at=row["created_at"],
            updated_at=row["updated_at"], reason=row["reason"], aliases=self._aliases_of(db, version_id),
            manifest_hash=row["manifest_hash"] if "manifest_hash" in columns else None,
            fingerprint=fingerprint if isinstance(fingerprint, dict) else None,
        )

    def _require_model(self, db: sqlite3.Connection, model: str) -> None:
        if db.execute("SELECT 1 FROM versions WHERE model = ? LIMIT 1", (model,)).fetchone() is None:
            known = [row["model"] for row in db.execute("SELECT DISTINCT model FROM versions ORDER BY model")]
            raise InputError(
                f"unknown model {model!r} (registered: {', '.join(known) or 'none'})", file=self.path, field="model"
            )

    def _version_row(self, db: sqlite3.Connection, model: str, version: int) -> sqlite3.Row:
        self._require_model(db, model)
        row = db.execute("SELECT * FROM versions WHERE model = ? AND version = ?", (model, version)).fetchone()
        if row is None:
            known = [str(r["version"]) for r in db.execute("SELECT version FROM versions WHERE model = ? ORDER BY version", (model,))]
            raise InputError(
                f"model {model!r} has no version {version} (versions: {', '.join(known)})", file=self.path, field="version"
            )
        return row

    def _lookup_id(self, db: sqlite3.Connection, model: str, alias_or_version: int | str) -> int:
        if isinstance(alias_or_version, int) or str(alias_or_version).isdigit():
            return self._version_row(db, model, int(alias_or_version))["id"]
        top = self._alias_top(db, model, str(alias_or_version))
        if top is None:
            raise self._unknown_alias(db, model, str(alias_or_version))
        return top["version_id"]

    def _number_of(self, db: sqlite3.Connection, version_id: int) -> int:
        return self._row_by_id(db, version_id)["version"]

    def _alias_top(self, db: sqlite3.Connection, model: str, alias: str) -> sqlite3.Row | None:
        return db.execute(
            "SELECT seq, version_id FROM aliases WHERE model = ? AND alias = ? ORDER BY seq DESC LIMIT 1",
            (model, alias),
        ).fetchone()

    def _alias_target(self, db: sqlite3.Connection, model: str, alias: str) -> AliasTarget:
        rows = db.execute(
            "SELECT v.version FROM aliases a JOIN versions v ON v.id = a.version_id"
            " WHERE a.model = ? AND a.alias = ? ORDER BY a.seq DESC LIMIT 2",
            (model, alias),
        ).fetchall()
        return AliasTarget(model=model, alias=alias, version=rows[0]["version"],
                           previous=rows[1]["version"] if len(rows) > 1 else None)

    def _aliases_of(self, db: sqlite3.Connection, version_id: int) -> builtins.list[str]:
        """Aliases whose current target is this version."""
        rows = db.execute(
            "SELECT a.alias FROM aliases a WHERE a.version_id = ? AND a.seq ="
            " (SELECT MAX(b.seq) FROM aliases b WHERE b.model = a.model AND b.alias = a.alias) ORDER BY a.alias",
            (version_id,),
        ).fetchall()
        return [row["alias"] for row in rows]

    def _unknown_alias(self, db: sqlite3.Connection, model: str, alias: str) -> InputError:
        self._require_model(db, model)
        known = [row["alias"] for row in db.execute(
            "SELECT DISTINCT alias FROM aliases WHERE model = ? ORDER BY alias", (model,))]
        return InputError(
            f"model {model!r} has no alias {alias!r} (aliases: {', '.join(known) or 'none'})",
            file=self.path, field="alias",
        )


def open_registry(path: Path | None, field: str = "--registry") -> Registry:
    """The registry a command names with `--registry PATH` (which must exist), else the default one."""
    if path is not None:
        try:
            found = path.is_file()
        except (OSError, ValueError) as error:
            raise InputError(f"not a usable path ({getattr(error, 'strerror', None) or error})", file=path, field=field) from None
        if not found:
            raise InputError("no registry database at this path", file=path, field=field)
    return Registry(path)


def _check_alias_name(alias: str) -> None:
    # ASCII only: str.isalnum() accepts every script, and a Cyrillic 'о' in 'prоd' would stand beside 'prod'.
    if not alias or alias.isdigit() or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in alias):
        raise InputError(
            f"alias must be ASCII letters, digits, '-', '_' or '.' and not a bare number (got {alias!r})", field="alias"
        )


def _event_from_row(row: sqlite3.Row) -> Event:
    values = dict(row)
    values["evidence"] = json.loads(values["evidence"]) if values["evidence"] else None
    return Event(**values)
