"""Write-then-rename, so that no reader ever sees a half-written file or folder.

Files and folders get the permissions a plain `open()` / `mkdir()` would give them (0666 / 0777 less
the umask), not the private 0600 / 0700 of tempfile's mkstemp / mkdtemp: an artifact, a gate.json or a
report is meant to be read by whoever the umask lets read it.

A write that fails for a reason of the disk (full: ENOSPC, read-only: EROFS, permissions, quota) ends
as a StorageError naming the errno and the path that failed, after the temporary file or folder is
removed; a failure of that clean-up never hides the first error.
"""

from __future__ import annotations

import errno as errno_module
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from pipelines.errors import QuantGateError


class StorageError(QuantGateError):
    """The disk refused a write (full, read-only, permissions): exit code 2, naming errno and path."""


def storage_error(error: OSError, path: str | Path | None = None) -> QuantGateError:
    """`error` as one line naming its errno and the path (its own filename if it has one, else `path`)."""
    if isinstance(error, QuantGateError):
        return error
    code = errno_module.errorcode.get(error.errno, "") if error.errno is not None else ""
    label = f"[Errno {error.errno} {code}] " if error.errno is not None else ""
    reason = error.strerror or str(error) or type(error).__name__
    target = error.filename if error.filename is not None else path
    extra = f" (-> {error.filename2})" if getattr(error, "filename2", None) else ""
    return StorageError(f"{label}{reason}{extra}", file=target)


def current_umask() -> int:
    """The process umask, read without changing it (Linux: /proc/self/status), else set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~current_umask()


def folder_mode() -> int:
    return 0o777 & ~current_umask()


def hidden_sibling(final: Path) -> Path:
    """A new hidden folder beside `final` (`.<name>.tmp-<host>-<pid>-XXXX`), its parents made; a disk error is a
    StorageError. The same name's folders left by a process of this host that is gone (SIGKILLed mid-write: a Ray
    worker killed while it quantized, whose retry writes the same artifact) are removed first; another host's, or a
    live process's, are never touched (the artifacts root may be shared storage)."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_orphaned_siblings(final)
        return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-", dir=final.parent))
    except OSError as error:
        raise storage_error(error, final.parent) from error


def remove_orphaned_siblings(final: Path) -> list[Path]:
    """The hidden staging folders of `final` whose writer (this host, its pid in the name) no longer runs, removed."""
    prefix, host = f".{final.name}.tmp-", socket.gethostname()
    removed = []
    for sibling in final.parent.glob(f"{glob_escape(prefix)}*"):
        owner = sibling.name[len(prefix):].rsplit("-", 2)
        if len(owner) == 3 and owner[0] == host and owner[1].isdigit() and not _running(int(owner[1])):
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or a number no pid can be: never taken as gone
    return True


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `final`, on any error it is removed.

    The folder gets 0777 less the umask. A disk error (here or in the caller's writes into the folder)
    ends as a StorageError naming the original errno and path.
    """
    staging = hidden_sibling(final)
    try:
        staging.chmod(folder_mode())
        yield staging
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError):
            raise storage_error(error, staging) from error
        raise


def write_text_atomic(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write `text` (UTF-8) to a temporary sibling, fsync, rename over `path`; mode 0666 less the umask, or `mode`."""
    write_bytes_atomic(path, text.encode("utf-8"), mode=mode)


def write_bytes_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Write `data` to a temporary sibling, fsync, rename over `path` (a symbolic link there is replaced, never followed);
    mode 0666 less the umask, or `mode` (0o600 for a file holding keys: the sibling has it before a byte is written)."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), file_mode() if mode is None else mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        if tmp is not None:
            try:
                Path(tmp).unlink(missing_ok=True)
            except OSError:
                pass  # the first error is the one to report
        if isinstance(error, OSError):
            raise storage_error(error, path) from error
        raise


def write_json_atomic(path: Path, value: Any) -> None:
    write_text_atomic(path, json.dumps(value, indent=2, sort_keys=False, default=str) + "\n")
