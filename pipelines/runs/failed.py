"""What a failed run leaves: its staging folder renamed (never copied) to `<run id>-error` beside the finished runs, with
error.txt, and the error line pointed at the kept logs instead of the staging folder that no longer exists.

Failed runs are pruned when a new one is kept: those older than QUANTGATE_FAILED_RUNS_MAX_AGE_DAYS go, then the oldest
until all of them together take at most QUANTGATE_FAILED_RUNS_MAX_MIB; the newest (the one just kept) always stays.
Only folders this product wrote are removed: a run id's shape, `-error`, a real folder (not a link) holding error.txt.
docs/runs.md has the details.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
import traceback
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.console.output import progress
from pipelines.errors import MAX_MESSAGE_CHARS, MAX_WHERE_CHARS, QuantGateError, bounded
from pipelines.files.atomic import write_text_atomic

ERROR_TXT = "error.txt"
FAILED_SUFFIX = "-error"
_FAILED_RUN = re.compile(r"\d{8}T\d{6}Z-.+-\d+-[0-9a-f]+" + re.escape(FAILED_SUFFIX))


class FailedRunLimits(BaseSettings):
    """How much failed runs may keep, read from the environment when a run fails."""

    model_config = SettingsConfigDict(env_prefix="QUANTGATE_FAILED_RUNS_", env_ignore_empty=True, extra="ignore", frozen=True)

    max_age_days: float = Field(default=14.0, ge=0, le=36_500, allow_inf_nan=False)
    max_mib: int = Field(default=1024, ge=0, le=2**40)


def keep_failed(staging: Path, failed: Path, error: BaseException) -> Path | None:
    """Keep a failed run's logs as `failed` with error.txt and point `error` at them; the kept folder, or None. Every step
    is best effort, so that a full or read-only disk never hides `error` (which the caller raises) behind an error of its own."""
    if not staging.is_dir() or staging.is_symlink():
        return None
    write_error_txt(staging, error)
    try:
        os.replace(staging, failed)
    except OSError as own:
        progress(f"could not keep the failed run as {failed.name} ({own.strerror or own}); removing its staging folder")
        shutil.rmtree(staging, ignore_errors=True)
        if staging.exists():
            progress(f"could not remove {staging} either; the next run reclaims it")
        return None
    progress(f"run failed; logs kept in {failed}")
    name_kept_path(error, staging, failed)
    prune_failed_runs(failed.parent, keep=failed)
    return failed


def write_error_txt(folder: Path, error: BaseException) -> None:
    try:
        write_text_atomic(folder / ERROR_TXT, "".join(traceback.format_exception(error)))
    except (OSError, QuantGateError) as own:
        progress(f"could not write {ERROR_TXT} ({own})")


def name_kept_path(error: BaseException, staging: Path, kept: Path) -> None:
    """An error line that names a file in the staging folder (`see <log>`) names it where it was kept."""
    if not isinstance(error, QuantGateError):
        return
    old, new = str(staging), str(kept)
    error.message = bounded(error.message.replace(old, new), MAX_MESSAGE_CHARS)
    if error.file is not None:
        error.file = bounded(error.file.replace(old, new), MAX_WHERE_CHARS)
    error.args = (error.one_line(),)


def prune_failed_runs(runs_dir: Path, *, keep: Path, limits: FailedRunLimits | None = None, now: float | None = None) -> list[Path]:
    """Remove failed runs past the limits, oldest first, never `keep`; returns what was removed."""
    limits = limits or FailedRunLimits()
    now = time.time() if now is None else now
    runs = sorted(_failed_runs(runs_dir, keep), key=lambda run: run[1])  # (path, mtime, bytes), oldest first
    total = sum(size for _, _, size in runs) + _folder_bytes(keep)
    removed = []
    for path, mtime, size in runs:
        too_old = now - mtime > limits.max_age_days * 86_400
        if not too_old and total <= limits.max_mib * 1024 * 1024:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            total -= size
    if removed:
        progress(f"removed {len(removed)} failed run(s) past the limits ({limits.max_age_days:g} days, {limits.max_mib} MiB)")
    return removed


def _failed_runs(runs_dir: Path, keep: Path) -> list[tuple[Path, float, int]]:
    found = []
    try:
        entries = list(os.scandir(runs_dir))
    except OSError:
        return []
    for entry in entries:
        path = Path(entry.path)
        if not _FAILED_RUN.fullmatch(entry.name) or path == keep:
            continue
        try:
            status = entry.stat(follow_symlinks=False)
            marker = (path / ERROR_TXT).lstat()
        except OSError:
            continue
        if stat.S_ISDIR(status.st_mode) and stat.S_ISREG(marker.st_mode):
            found.append((path, status.st_mtime, _folder_bytes(path)))
    return found


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):  # links are not followed
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
