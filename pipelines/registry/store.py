"""The model registry's verbs: versions of quantized artifacts, their gate evidence, status and aliases.

Three layers, as MLflow's registry keeps them: the records (pipelines.registry.records: Version, Event, AliasTarget,
NewVersion), the database (pipelines.registry.database: one interface, SQLite in one file as the embedded default,
PostgreSQL for a team; QUANTGATE_REGISTRY or --registry names a path or a `postgresql://` URL), and the verbs here:
register, promote (through the signed door, pipelines.registry.promotion.promote_signed), reject, mark_error,
set_alias, rollback, list/show/get/aliases/history/resolve, lineage and re-gate events. This module stays the public
facade: the records are importable from it.

Three tables: versions (one row per source model, artifact and gate evidence; the version number counts per model),
aliases (the current target of each (model, alias) plus a stack of earlier targets for rollback) and events (every
registration, status change and alias move, append-only). Every write is one transaction that first locks the model
(`Connection.lock_model`: SQLite's write lock, PostgreSQL's per-model advisory lock) and then reads what it changes.

The registry never points at something incomplete: an artifact is verified against its manifest when it is
registered, promoted, given an alias, rolled back to, or resolved for serving. A version records its manifest.json's
own sha256 and the stat fingerprint of its files at the last full verification, so these later checks re-hash only
files whose size, mtime, ctime or inode changed (pipelines.artifact.verify_artifact says what that costs). gate.json is
read once, into the typed pipelines.gate.schema.GateReport, when a version is registered; `Version.gate` returns it.
"""

from __future__ import annotations

import builtins  # Registry.list shadows the built-in inside the class
import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipelines.artifact import MANIFEST_FILES_KEY, MANIFEST_NAME, ArtifactCheck, verify_artifact  # noqa: F401 (re-exported)
from pipelines.errors import InputError
from pipelines.files.hashing import sha256_json
from pipelines.gate.schema import read_report
from pipelines.registry.database import SCHEMA_VERSION, Connection, Database, postgres_url  # noqa: F401 (re-exported)
from pipelines.registry.evidence import verify_promotion
from pipelines.registry.records import (  # noqa: F401 (re-exported: the records' public home stays importable from here)
    TRANSITIONS,
    AliasTarget,
    EvalSetRef,
    Event,
    EventKind,
    NewVersion,
    Status,
    Version,
    check_alias_name,
    event_from_row,
    now,
    version_from_row,
)
from pipelines.registry.signing import SignatureRecord, require_signed_bundle
from pipelines.registry.sqlite_db import SQLiteDatabase
from pipelines.settings import current as current_settings

if TYPE_CHECKING:
    from pipelines.registry.evidence import PromotionCheck

Row = Any  # Row or a psycopg dict row: both read by column name


def default_registry_path() -> Path:
    """$QUANTGATE_REGISTRY, else <artifacts>/registry.db, as the environment says now."""
    return current_settings().registry_path


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


def registry_exists(value: Path | str | None) -> bool:
    """Whether `value` names a registry that can be opened without creating one: a PostgreSQL URL (its database is the
    server's), or an existing SQLite file."""
    return value is not None and (postgres_url(value) is not None or Path(value).is_file())


def open_database(value: Path | str, field: str) -> Database:
    """The backend `value` names: a PostgreSQL URL, else a SQLite file."""
    url = postgres_url(value)
    if url is not None:
        from pipelines.registry.postgres_db import PostgresDatabase  # psycopg is imported only for a PostgreSQL registry

        return PostgresDatabase(url, field)
    return SQLiteDatabase(Path(value), field)


class Registry:
    def __init__(self, path: Path | str | None = None, *, field: str | None = None):
        """The registry at `path` (a file path or a `postgresql://` URL; default: $QUANTGATE_REGISTRY, else
        <artifacts>/registry.db). `field`: the setting that named it, for error lines."""
        self.db = open_database(path if path is not None else default_registry_path(),
                                field or ("QUANTGATE_REGISTRY" if path is None else "registry"))
        self.path = self.db.path  # the file, or (PostgreSQL) the anchor of the signing key and bundles' folder
        self.location = self.db.location
        self.read_only = self.db.read_only

    def _transaction(self) -> AbstractContextManager[Connection]:
        return self.db.transaction(write=True)

    def _reader(self) -> AbstractContextManager[Connection]:
        return self.db.transaction(write=False)

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
            db.lock_model(entry.source_model)
            existing = db.execute(
                "SELECT id FROM versions WHERE model = ? AND artifact_hash = ? AND gate_hash = ?",
                (entry.source_model, a_hash, g_hash),
            ).fetchone()
            if existing:
                return self._version_by_id(db, existing["id"])
            number = db.execute(
                "SELECT COALESCE(MAX(version), 0) + 1 AS next FROM versions WHERE model = ?", (entry.source_model,)
            ).fetchone()["next"]
            at = now()
            row = db.execute(
                "INSERT INTO versions (model, version, source_hash, artifact_path, artifact_hash, recipe_name,"
                " recipe_hash, eval_sets, gate_path, gate, gate_hash, status, created_at, updated_at, reason,"
                " manifest_hash, fingerprint)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'candidate', ?, ?, ?, ?, ?) RETURNING id",
                (
                    entry.source_model, number, entry.source_hash, artifact_dir.as_posix(), a_hash,
                    entry.recipe_name, entry.recipe_hash,
                    json.dumps([ref.model_dump() for ref in entry.eval_sets]),
                    Path(entry.gate_path).resolve().as_posix() if entry.gate_path is not None else None,
                    json.dumps(gate) if gate is not None else None, g_hash, at, at, entry.reason,
                    check.manifest_sha256, json.dumps(check.fingerprint),
                ),
            ).fetchone()
            self._event(db, entry.source_model, number, "registered", reason=entry.reason)
            return self._version_by_id(db, row["id"])

    def promotable(self, version: Version, *, override_gate: bool = False) -> bool:
        """Whether `version` is still to be promoted: False when it is promoted already; an InputError when it cannot be
        (its own gate evidence says rejected and there is no explicit override, or its status cannot become promoted)."""
        if version.verdict == "rejected" and not override_gate:
            raise InputError(
                f"the gate rejected version {version.version} of {version.model!r} ({version.gate_path});"
                " promoting it needs an explicit gate override",
                file=self.location, field="status",
            )
        current = self.get(version.id)
        if current.status == "promoted":
            return False
        if "promoted" not in TRANSITIONS[current.status]:
            raise InputError(f"version {current.version} of {current.model!r} is {current.status} and cannot become promoted",
                             file=self.location, field="status")
        return True

    def promote(self, version_id: int, reason: str, signature: SignatureRecord, evidence: dict[str, Any] | None = None, *,
                override_gate: bool = False, verified: ArtifactCheck | None = None) -> Version:
        """Mark a version promoted: only with the record of its signed promotion bundle, whose signature file must be
        the one recorded (pipelines.registry.promotion.promote_signed assembles, signs and calls this: the one door),
        and with its artifact files verified against the manifest: `verified`, the door's own check of this version
        (passed down, so a promotion hashes the artifact once), else checked here. A version whose own gate evidence
        says `rejected` is only promoted with override_gate=True, which is recorded in the event's evidence."""
        version = self.get(version_id)
        if self.read_only:
            with self._transaction():  # the read-only refusal, before any check
                pass
        self.promotable(version, override_gate=override_gate)
        require_signed_bundle(signature)
        matches = verified is not None and verified.artifact_hash == version.artifact_hash and (
            Path(verified.artifact_dir).resolve() == Path(version.artifact_path).resolve())
        check = verified if verified is not None and matches else verify_version(version)
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
        check_alias_name(alias)
        # Verified outside the write lock (a full hash may take minutes), then re-read under it.
        with self._reader() as db:
            target = self._promoted_row(db, model, version)
            stored = self._version_by_id(db, target["id"])
        check = verify_version(stored)
        self.verify_signature(stored)
        with self._transaction() as db:
            db.lock_model(model)
            target = self._promoted_row(db, model, version)
            self._refresh_fingerprint(db, target["id"], check)
            current = self._alias_top(db, model, alias)
            if current is not None and current["version_id"] == target["id"]:
                return self._alias_target(db, model, alias)
            seq = (current["seq"] + 1) if current is not None else 1
            db.execute(
                "INSERT INTO aliases (model, alias, seq, version_id, at) VALUES (?, ?, ?, ?, ?)",
                (model, alias, seq, target["id"], now()),
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
            db.lock_model(model)
            moved = (current["seq"], earlier["version_id"])
            current, earlier = self._rollback_step(db, model, alias, to_version)
            if (current["seq"], earlier["version_id"]) != moved:
                raise InputError(f"alias {alias!r} of {model!r} moved while rolling back; run the rollback again",
                                 file=self.location, field="alias")
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
                "SELECT id FROM versions WHERE (CAST(? AS TEXT) IS NULL OR model = ?) ORDER BY model, version", (model, model)
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
                "SELECT DISTINCT model, alias FROM aliases WHERE (CAST(? AS TEXT) IS NULL OR model = ?) ORDER BY model, alias",
                (model, model),
            ).fetchall()
            return [self._alias_target(db, row["model"], row["alias"]) for row in rows]

    def history(self, model: str | None = None, *, version: int | None = None,
                alias: str | None = None) -> builtins.list[Event]:
        with self._reader() as db:
            if model is not None:
                self._require_model(db, model)
            rows = db.execute(
                "SELECT * FROM events WHERE (CAST(? AS TEXT) IS NULL OR model = ?) AND (CAST(? AS TEXT) IS NULL OR alias = ?)"
                " AND (CAST(? AS INTEGER) IS NULL OR version = ? OR from_version = ? OR to_version = ?) ORDER BY id",
                (model, model, alias, alias, version, version, version, version),
            ).fetchall()
        try:
            return [event_from_row(row) for row in rows]
        except (ValueError, TypeError, RecursionError) as error:  # ValueError: JSON and pydantic errors among them
            problem = " ".join(str(error).split())[:300]
            raise InputError(f"an event row is malformed ({type(error).__name__}: {problem})", file=self.location, field="events") from None

    def record_lineage(self, model: str, version: int, reason: str, evidence: dict[str, Any]) -> None:
        """Where `version` came from (a `lineage` event): e.g. the rejected version a repair started from and the
        overrides it added. Appended like every event; the version itself is not changed."""
        with self._transaction() as db:
            db.lock_model(model)
            self._version_row(db, model, version)
            self._event(db, model, version, "lineage", reason=reason, evidence=evidence)

    def record_regate(self, model: str, version: int, reason: str, evidence: dict[str, Any]) -> None:
        """A re-gate of a promoted version on another runtime (a `regated` event holding its signature record:
        pipelines.registry.regates). Appended like every event; the version's status is not changed."""
        with self._transaction() as db:
            db.lock_model(model)
            if self._version_row(db, model, version)["status"] != "promoted":
                raise InputError(f"version {version} of {model!r} is no longer promoted; its re-gate is not recorded", file=self.location,
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
            db.lock_model(self._row_by_id(db, version_id)["model"])
            row = self._row_by_id(db, version_id)  # again, under the model's lock
            if row["status"] == status:
                return self._version_by_id(db, version_id)
            if status not in TRANSITIONS[row["status"]]:
                raise InputError(
                    f"version {row['version']} of {row['model']!r} is {row['status']} and cannot become {status}",
                    file=self.location, field="status",
                )
            holding = self._aliases_of(db, version_id)
            if holding:
                raise InputError(
                    f"version {row['version']} of {row['model']!r} is the target of alias(es) {', '.join(holding)};"
                    " move or roll them back first",
                    file=self.location, field="alias",
                )
            db.execute(
                "UPDATE versions SET status = ?, reason = ?, updated_at = ? WHERE id = ?",
                (status, reason, now(), version_id),
            )
            self._refresh_fingerprint(db, version_id, check)
            self._event(db, row["model"], row["version"], status, reason=reason, evidence=evidence)
            return self._version_by_id(db, version_id)

    def _refresh_fingerprint(self, db: Connection, version_id: int, check: ArtifactCheck | None) -> None:
        """After a check that had to re-hash files (stat changed, content intact), remember the new stat."""
        if check is None or not check.hashed:
            return
        row = self._row_by_id(db, version_id)
        if row["artifact_hash"] == check.artifact_hash:
            db.execute(
                "UPDATE versions SET fingerprint = ?, manifest_hash = COALESCE(manifest_hash, ?) WHERE id = ?",
                (json.dumps(check.fingerprint), check.manifest_sha256, version_id),
            )

    def _promoted_row(self, db: Connection, model: str, version: int) -> Row:
        target = self._version_row(db, model, version)
        if target["status"] != "promoted":
            raise InputError(
                f"version {version} of {model!r} is {target['status']}; only promoted versions can carry an alias",
                file=self.location, field="version",
            )
        return target

    def _rollback_step(self, db: Connection, model: str, alias: str, to_version: int | None = None) -> tuple[Row, Row]:
        """The alias's current entry and the promoted entry a rollback returns to (the nearest earlier one, or the nearest
        earlier one of `to_version`)."""
        current = self._alias_top(db, model, alias)
        if current is None:
            raise self._unknown_alias(db, model, alias)
        earlier = db.execute(
            "SELECT a.seq, a.version_id, v.version FROM aliases a JOIN versions v ON v.id = a.version_id"
            " WHERE a.model = ? AND a.alias = ? AND a.seq < ? AND v.status = 'promoted'"
            " AND a.version_id != ? AND (CAST(? AS INTEGER) IS NULL OR v.version = ?) ORDER BY a.seq DESC LIMIT 1",
            (model, alias, current["seq"], current["version_id"], to_version, to_version),
        ).fetchone()
        if earlier is None:
            what = "no earlier promoted version" if to_version is None else f"no earlier promoted entry of version {to_version}"
            raise InputError(f"alias {alias!r} of {model!r} has {what} to roll back to", file=self.location, field="alias")
        return current, earlier

    def _event(self, db: Connection, model: str, version: int | None, kind: EventKind, *,
               alias: str | None = None, from_version: int | None = None, to_version: int | None = None,
               reason: str = "", evidence: dict[str, Any] | None = None) -> None:
        try:  # the events table is append-only evidence: JSON as its readers parse it, never Infinity or NaN
            stored = json.dumps(evidence, default=str, allow_nan=False) if evidence is not None else None
        except ValueError:
            raise InputError("evidence must hold finite numbers only (no Infinity or NaN)", field="evidence") from None
        db.execute(
            "INSERT INTO events (at, model, version, kind, alias, from_version, to_version, reason, evidence)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (now(), model, version, kind, alias, from_version, to_version, reason, stored),
        )

    def _row_by_id(self, db: Connection, version_id: int) -> Row:
        row = db.execute("SELECT * FROM versions WHERE id = ?", (version_id,)).fetchone()
        if row is None:
            raise InputError(f"no registry entry with id {version_id}", file=self.location, field="version_id")
        return row

    def _version_by_id(self, db: Connection, version_id: int) -> Version:
        row = self._row_by_id(db, version_id)
        try:
            return self._version_from_row(db, row)
        except (ValueError, TypeError, KeyError, RecursionError) as error:  # ValueError: JSON and pydantic errors among them
            problem = " ".join(str(error).split())[:300]
            raise InputError(f"version row {version_id} is malformed ({type(error).__name__}: {problem})", file=self.location,
                             field="versions") from None

    def _version_from_row(self, db: Connection, row: Row) -> Version:
        return version_from_row(row, self._aliases_of(db, row["id"]))

    def _require_model(self, db: Connection, model: str) -> None:
        if db.execute("SELECT 1 FROM versions WHERE model = ? LIMIT 1", (model,)).fetchone() is None:
            known = [row["model"] for row in db.execute("SELECT DISTINCT model FROM versions ORDER BY model")]
            raise InputError(
                f"unknown model {model!r} (registered: {', '.join(known) or 'none'})", file=self.location, field="model"
            )

    def _version_row(self, db: Connection, model: str, version: int) -> Row:
        self._require_model(db, model)
        row = db.execute("SELECT * FROM versions WHERE model = ? AND version = ?", (model, version)).fetchone()
        if row is None:
            known = [str(r["version"]) for r in db.execute("SELECT version FROM versions WHERE model = ? ORDER BY version", (model,))]
            raise InputError(
                f"model {model!r} has no version {version} (versions: {', '.join(known)})", file=self.location, field="version"
            )
        return row

    def _lookup_id(self, db: Connection, model: str, alias_or_version: int | str) -> int:
        if isinstance(alias_or_version, int) or str(alias_or_version).isdigit():
            return self._version_row(db, model, int(alias_or_version))["id"]
        top = self._alias_top(db, model, str(alias_or_version))
        if top is None:
            raise self._unknown_alias(db, model, str(alias_or_version))
        return top["version_id"]

    def _number_of(self, db: Connection, version_id: int) -> int:
        return self._row_by_id(db, version_id)["version"]

    def _alias_top(self, db: Connection, model: str, alias: str) -> Row | None:
        return db.execute(
            "SELECT seq, version_id FROM aliases WHERE model = ? AND alias = ? ORDER BY seq DESC LIMIT 1",
            (model, alias),
        ).fetchone()

    def _alias_target(self, db: Connection, model: str, alias: str) -> AliasTarget:
        rows = db.execute(
            "SELECT v.version FROM aliases a JOIN versions v ON v.id = a.version_id"
            " WHERE a.model = ? AND a.alias = ? ORDER BY a.seq DESC LIMIT 2",
            (model, alias),
        ).fetchall()
        return AliasTarget(model=model, alias=alias, version=rows[0]["version"],
                           previous=rows[1]["version"] if len(rows) > 1 else None)

    def _aliases_of(self, db: Connection, version_id: int) -> builtins.list[str]:
        """Aliases whose current target is this version."""
        rows = db.execute(
            "SELECT a.alias FROM aliases a WHERE a.version_id = ? AND a.seq ="
            " (SELECT MAX(b.seq) FROM aliases b WHERE b.model = a.model AND b.alias = a.alias) ORDER BY a.alias",
            (version_id,),
        ).fetchall()
        return [row["alias"] for row in rows]

    def _unknown_alias(self, db: Connection, model: str, alias: str) -> InputError:
        self._require_model(db, model)
        known = [row["alias"] for row in db.execute(
            "SELECT DISTINCT alias FROM aliases WHERE model = ? ORDER BY alias", (model,))]
        return InputError(
            f"model {model!r} has no alias {alias!r} (aliases: {', '.join(known) or 'none'})",
            file=self.location, field="alias",
        )


def open_registry(path: Path | str | None, field: str = "--registry") -> Registry:
    """The registry a command names with `--registry PATH|URL` (a file, which must exist, or a PostgreSQL URL), else the
    default one ($QUANTGATE_REGISTRY)."""
    if path is None:
        return Registry(None)
    if postgres_url(path) is None:
        try:
            found = Path(path).is_file()
        except (OSError, ValueError) as error:
            raise InputError(f"not a usable path ({getattr(error, 'strerror', None) or error})", file=path, field=field) from None
        if not found:
            raise InputError("no registry database at this path", file=path, field=field)
    return Registry(path, field=field)
