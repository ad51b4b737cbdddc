"""A run's folder from its id to its end: the one lifecycle of every command that writes evidence under runs/.

    with run_folder(runs_dir, "w8a8") as folder:   # reclaims dead runs' staging folders, makes .<id>.tmp
        ...write into folder.path...               # library output of the block goes to folder.path/library.log
    folder.final                                   # renamed into place only when the block succeeded

A block that fails keeps its logs as `<id>-error` with error.txt, and its error line names them there
(pipelines/runs/failed.py: best effort, so a full or read-only disk never hides the error being raised; failed runs
pruned by age and size). A repair writes its evidence in place as it goes (`staged=False`: attempts and
the registry's lineage events name files inside it), so its folder has its final name from the start and a
failure leaves error.txt beside the evidence. pipelines.serve.reclaim parses the id's shape from staging folders;
a staging folder holds its run's owner lock (reclaim.hold_owner_lock) until it is renamed.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from pipelines.console.capture import library_log
from pipelines.console.output import progress
from pipelines.files.atomic import storage_error
from pipelines.files.safepath import ensure_inside, safe_component
from pipelines.runs.failed import FAILED_SUFFIX, keep_failed, write_error_txt
from pipelines.serve.reclaim import OWNER_LOCK, hold_owner_lock, reclaim_stale

LIBRARY_LOG = "library.log"  # a run's library output (llm-compressor, transformers, lm-eval in-process), unless --verbose


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
        lock = hold_owner_lock(path) if staged else None
    except OSError as error:
        raise storage_error(error, path) from error
    try:
        with library_log(path / LIBRARY_LOG):
            yield RunFolder(identifier, path, final)
        if staged:
            _release_owner_lock(path, lock)
            os.replace(path, final)
    except BaseException as error:
        if staged:
            _release_owner_lock(path, lock)
            keep_failed(path, runs_dir / f"{identifier}{FAILED_SUFFIX}", error)
        else:
            write_error_txt(path, error)
        if isinstance(error, OSError):
            raise storage_error(error, path) from error
        raise


def _release_owner_lock(folder: Path, lock: int | None) -> None:
    """The lock file goes before the folder is renamed (no run folder keeps it); removing it touches the folder, so no
    reclaim takes it for a dead run's in the moment before the rename."""
    if lock is None:
        return
    try:
        (folder / OWNER_LOCK).unlink(missing_ok=True)
    except OSError:
        pass
    os.close(lock)
