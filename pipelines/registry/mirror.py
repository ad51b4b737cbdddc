"""The registry's mirror in an MLflow tracking server (docs/registry.md, "MLflow mirror").

The registry is the source of truth; MLflow is a copy people already browse. After a promotion, an alias move or a
rollback has been committed, its caller calls `mirror_after`: with a target (`--mlflow URL`, else QUANTGATE_MLFLOW)
the versions named and every alias of the model are mirrored (pipelines.registry.mlflow_export.mirror_model). A
failure never reaches the caller: it is one line on stderr and a pending record under <artifacts>/mirror-pending/,
retried by the next mirror call to the same server and by `quantize registry mirror --retry`. Mirroring is
idempotent (a version already in MLflow is reused, aliases are set to what the registry says), so a retry after a
partial failure finishes the work without duplicates.

Credentials in the URL (https://user:secret@host) are never printed and never written: messages and the pending
records carry the URL with its user part replaced by `***` (a PostgreSQL registry's URL too); a retry takes the
credentials from the target given to it and from QUANTGATE_REGISTRY (MLflow's own MLFLOW_TRACKING_USERNAME / _PASSWORD /
_TOKEN work too, and keep the URL plain).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ValidationError

from pipelines.console.output import progress
from pipelines.console.redact import without_credentials
from pipelines.errors import QuantGateError
from pipelines.files.atomic import write_json_atomic
from pipelines.files.jsonio import read_json_object
from pipelines.registry.mlflow_export import MirrorResult, mirror_model
from pipelines.registry.store import Registry, open_registry
from pipelines.schema import StrictModel
from pipelines.settings import current as current_settings

PENDING_DIR = "mirror-pending"
_MAX_RECORD_BYTES = 64 * 1024
_MAX_MESSAGE = 240
_target: ContextVar[str | None] = ContextVar("quantgate_mlflow_target", default=None)


class Pending(StrictModel):
    """A mirror call that failed: what to mirror again, and where (the URL without its credentials)."""

    registry: str
    model: str
    versions: list[int]
    tracking: str
    error: str
    since: str


@contextmanager
def mirroring_to(url: str | None) -> Iterator[None]:
    """Within the block, promotions mirror to `url` (the run's `--mlflow`); None leaves QUANTGATE_MLFLOW in charge."""
    token = _target.set(url)
    try:
        yield
    finally:
        _target.reset(token)


def mirror_target(explicit: str | None = None) -> str | None:
    return explicit or _target.get() or current_settings().mlflow


def mirror_after(registry: Registry, model: str, versions: list[int] | None = None, *, target: str | None = None) -> None:
    """Mirror `versions` of `model` and its aliases, if a mirror is configured; never raises (one line on failure)."""
    url = mirror_target(target)
    if url is None:
        return
    numbers = list(versions or [])
    pending = _matching(url, registry, model)
    numbers += [number for _, record in pending for number in record.versions if number not in numbers]
    started = time.monotonic()
    try:
        result = mirror_model(registry, model, numbers, url)
    except Exception as error:  # the promotion stands whatever MLflow did: report, record, go on
        record = _record(registry, model, numbers, url, error)
        progress(f"MLflow mirror to {without_credentials(url)} failed ({record.error}); the registry is unchanged, recorded for "
                 f"retry (quantize registry mirror --retry)")
        return
    _forget(path for path, _ in pending)
    progress(f"mirrored to MLflow at {without_credentials(url)} in {time.monotonic() - started:.1f} s: {_summary(result)}")
    retry_pending(url, quiet=True)


def retry_pending(url: str | None = None, *, quiet: bool = False) -> tuple[list[MirrorResult], list[str]]:
    """Mirror every pending record this target can serve (the given URL, or a record's own when it had no
    credentials); records that succeed are removed. Returns what was mirrored and one line per failure."""
    done: list[MirrorResult] = []
    failed: list[str] = []
    for (registry_location, model, tracking), records in _grouped(url).items():
        target = url if url is not None and without_credentials(url) == tracking else tracking
        numbers = sorted({number for _, record in records for number in record.versions})
        try:
            done.append(mirror_model(_reopen(registry_location), model, numbers, target))
        except Exception as error:
            failed.append(f"{model} ({registry_location}) to {tracking}: {_message(error)}")
            if quiet:
                break  # the server is likely down: one failed try is enough for this call
            continue
        _forget(path for path, _ in records)
    return done, failed


def pending_dir() -> Path:
    return current_settings().artifacts_dir / PENDING_DIR


def pending_records() -> list[tuple[Path, Pending]]:
    """Every readable pending record (one that cannot be read is named by the retry command, not here)."""
    folder = pending_dir()
    if not folder.is_dir():
        return []
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            data, _ = read_json_object(path, what="pending mirror record", max_bytes=_MAX_RECORD_BYTES)
            records.append((path, Pending.model_validate(data)))
        except (QuantGateError, ValidationError):
            continue
    return records


def _grouped(url: str | None) -> dict[tuple[str, str, str], list[tuple[Path, Pending]]]:
    groups: dict[tuple[str, str, str], list[tuple[Path, Pending]]] = {}
    for path, record in pending_records():
        usable = (url is not None and without_credentials(url) == record.tracking) or (url is None and "***@" not in record.tracking)
        if usable:
            groups.setdefault((record.registry, record.model, record.tracking), []).append((path, record))
    return groups


def _matching(url: str, registry: Registry, model: str) -> list[tuple[Path, Pending]]:
    return _grouped(url).get((_location(registry), model, without_credentials(url)), [])


def _location(registry: Registry) -> str:
    """The registry's file or PostgreSQL URL, its credentials left out (what a pending record may hold)."""
    return without_credentials(str(registry.location))


def _reopen(location: str) -> Registry:
    """A pending record's registry: its own location, or the default registry's when that is the same one with the
    credentials a record never holds."""
    if "***@" in location and _location(Registry(None)) == location:
        return Registry(None)
    return open_registry(location)


def _record(registry: Registry, model: str, numbers: list[int], url: str, error: Exception) -> Pending:
    """Write the pending record of a failed call (one file per content: two failures of the same call, one file)."""
    record = Pending(registry=_location(registry), model=model, versions=sorted(set(numbers)), tracking=without_credentials(url),
                     error=_message(error), since=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    key = hashlib.sha256(f"{record.registry}\n{model}\n{record.tracking}\n{record.versions}".encode()).hexdigest()[:16]
    try:
        write_json_atomic(pending_dir() / f"{key}.json", record.model_dump())
    except QuantGateError as storage:
        record = record.model_copy(update={"error": f"{record.error}; and the pending record could not be written: {storage}"})
    return record


def _forget(paths: Iterator[Path] | list[Path]) -> None:
    """Pending records mirrored since: removed where the disk lets us (one left behind is retried, and mirroring is
    idempotent, so it costs a lookup, never the promotion's exit code)."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            progress(f"MLflow mirror: could not remove the mirrored pending record {path.name} ({error.strerror}); "
                     "it will be retried harmlessly")


def _message(error: Exception) -> str:
    text = getattr(error, "message", None) or str(error) or type(error).__name__
    first = without_credentials(str(text)).strip().splitlines()[0] if str(text).strip() else type(error).__name__
    return first if len(first) <= _MAX_MESSAGE else first[:_MAX_MESSAGE - 3] + "..."


def _summary(result: MirrorResult) -> str:
    versions = ", ".join(f"v{number} -> {mlflow_version}" for number, mlflow_version in sorted(result.versions.items()))
    aliases = ", ".join(f"{alias} -> {mlflow_version}" for alias, mlflow_version in sorted(result.aliases.items()))
    return f"{result.registered_model}: versions {versions or '-'}; aliases {aliases or '-'}"
