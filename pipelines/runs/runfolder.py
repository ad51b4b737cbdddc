"""A run's folder from its id to its end: the one lifecycle of every command that writes evidence under runs/.

    with run_folder(runs_dir, "w8a8") as folder:   # reclaims dead runs' staging folders, makes .<id>.tmp
        ...write into folder.path...               # library output of the block goes to folder.path/library.log
    folder.final                                   # renamed into place only when the block succeeded

A block that fails keeps its logs as `<id>-error` with error.txt (best effort: a full or read-only disk never
hides the error being raised). A repair writes its evidence in place as it goes (`staged=False`: attempts and
the registry's lineage events name files inside it), so its folder has its final name from the start and a
failure leaves error.txt beside the evidence. pipelines.serve.reclaim parses the id's shape from staging folders.
"""

from __future__ import annotations

import os
import secrets
import shutil
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from pipelines.console.capture import library_log
from pipelines.console.output import progress
from pipelines.files.atomic import storage_error
from pipelines.files.safepath import ensure_inside, safe_component
from pipelines.serve.reclaim import reclaim_stale

LIBRARY_LOG = "library.log"  # a run's library output (llm-compressor, transformers, lm-eval in-process), unless --verbose
ERROR_TXT = "error.txt"


class RunFolder(NamedTuple):
    run_id: str
    path: Path  # where the run writes now: the staging folder, or the final one when not staged
    final: Path  # where the evidence is once the run succeeded


def run_id(name: str) -> str:
    """`<stamp>-<name>-<pid>-<hex>`: the random suffix keeps two runs of one recipe in the same second apart."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    identifier = f"{stamp}-{safe_component(name, 'recipe')}-{os.getpid()}-{secrets.token_hex(3)}"
    return safe_component(identifier, "run id", max_length=200)


def reclaim(runs_dir: Path) -> None:
    """Staging folders of runs that died (SIGKILL, OOM, power) are removed before this run adds its own."""
    try:
        for path in reclaim_stale(runs_dir):
            progress(f"removed {path}, left by a run that is no longer alive")
    except OSError as error:  # best effort: a read-only runs folder is reported by the run's own mkdir
        progress(f"could not reclaim stale run folders in {runs_dir}: {error}")


@contextmanager
def run_folder(runs_dir: Path, name: str, *, staged: bool = True) -> Iterator[RunFolder]:
    """See the module docstring. OSError inside the block becomes a storage error naming the folder (exit 2)."""
    reclaim(runs_dir)
    identifier = run_id(name)
    final = ensure_inside(runs_dir, runs_dir / identifier, "run id")
    path = ensure_inside(runs_dir, runs_dir / f".{identifier}.tmp", "run id") if staged else final
    try:
        path.mkdir(parents=True)
    except OSError as error:
        raise storage_error(error, path) from error
    try:
        with library_log(path / LIBRARY_LOG):
            yield RunFolder(identifier, path, final)
        if staged:
            os.replace(path, final)
    except BaseException as error:
        if staged:
            keep_failed(path, runs_dir / f"{identifier}-error", error)
        else:
            _write_error(path, error)
        if isinstance(error, OSError):
            raise storage_error(error, path) from error
        raise


def _write_error(folder: Path, error: BaseException) -> None:
    try:
        (folder / ERROR_TXT).write_text("".join(traceback.format_exception(error)))
    except OSError as own:
        progress(f"could not write {ERROR_TXT} ({own.strerror or own})")


def keep_failed(staging: Path, failed: Path, error: BaseException) -> None:
    """Keep a failed run's logs as `failed` with error.txt; every step is best effort, so that a full or
    read-only disk never hides `error` (which the caller raises) behind a failure of its own."""
    if not staging.exists():
        return
    _write_error(staging, error)
    try:
        shutil.rmtree(failed, ignore_errors=True)
        os.replace(staging, failed)
        progress(f"run failed; logs kept in {failed}")
        return
    except OSError as own:
        progress(f"could not keep the failed run as {failed.name} ({own.strerror or own}); removing its staging folder")
    shutil.rmtree(staging, ignore_errors=True)
    if staging.exists():
        progress(f"could not remove {staging} either; the next run reclaims it")
