"""The one reader of a file the product's own run folders hold, read back as input (a state file, a spec.json, a client key,
a log, an export's marker): anyone who can write under artifacts/ can swap it for a link, a FIFO, /dev/zero or an 8 GiB
sparse file. So the file is found by lstat before anything is opened (a link, FIFO, device or folder is refused without
opening it: opening a FIFO blocks), opened with O_NOFOLLOW|O_NONBLOCK, re-checked on the open descriptor (the same inode:
nothing swapped in between) and read within a byte bound. Every refusal is one InputError naming the file (and `field`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pipelines.errors import InputError


def open_regular(path: Path, what: str, field: str | None = None) -> tuple[int, os.stat_result]:
    """A read descriptor of the regular file at `path` and its status; a link, FIFO, device or folder is an InputError."""
    try:
        before = path.lstat()
    except (OSError, ValueError) as error:
        raise InputError(f"cannot read the {what} ({getattr(error, 'strerror', None) or error})", file=path, field=field) from None
    if not stat.S_ISREG(before.st_mode):
        raise InputError(f"the {what} is not a regular file (a link, a FIFO, a device or a folder); refused", file=path, field=field)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise InputError(f"cannot read the {what} ({error.strerror or error})", file=path, field=field) from None
    status = os.fstat(descriptor)
    if (status.st_dev, status.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(status.st_mode):
        os.close(descriptor)
        raise InputError(f"the {what} was replaced while it was being opened; refused", file=path, field=field)
    return descriptor, status


def read_regular(path: Path, what: str, max_bytes: int, field: str | None = None) -> bytes:
    """The whole regular file at `path`, at most `max_bytes` (a larger one is an InputError, nothing past the bound read)."""
    descriptor, status = open_regular(path, what, field)
    with os.fdopen(descriptor, "rb") as handle:
        if status.st_size > max_bytes:
            raise InputError(f"the {what} is {status.st_size} bytes (at most {max_bytes}); refused", file=path, field=field)
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(f"the {what} grew past {max_bytes} bytes while being read; refused", file=path, field=field)
    return data


def read_regular_tail(path: Path, what: str, max_bytes: int) -> bytes:
    """The last `max_bytes` of the regular file at `path` (its first line may be cut)."""
    descriptor, status = open_regular(path, what)
    with os.fdopen(descriptor, "rb") as handle:
        handle.seek(max(0, status.st_size - max_bytes))
        return handle.read(max_bytes)


def read_regular_from(path: Path, what: str, offset: int, max_bytes: int) -> tuple[int, bytes]:
    """At most `max_bytes` of the regular file at `path` from `offset` (from its start when it is now shorter: truncated
    or replaced), with the offset actually read from."""
    descriptor, status = open_regular(path, what)
    start = offset if status.st_size >= offset else 0
    with os.fdopen(descriptor, "rb") as handle:
        handle.seek(start)
        return start, handle.read(max_bytes)
