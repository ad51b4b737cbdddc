"""JSON Lines files read with bounds: the one reader of eval-set data, held-out prompts and calibration data.

A data file is the user's: it is read line by line, never whole, and refused before it is read when it is
larger than MAX_FILE_BYTES, at the first line longer than MAX_LINE_BYTES (a 2 GiB file with no newline
costs one stat, a 60 MiB line 1 MiB of reading), and at line MAX_LINES + 1, blank lines counted (60 MiB of
newlines, 63 million empty lines, would otherwise cost a minute of reading nothing). Every problem is an
InputError naming the file and line.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from pipelines.bounds import MiB
from pipelines.errors import InputError
from pipelines.files.jsonio import finite_float, refuse_constant

MAX_LINE_BYTES = MiB  # one item: a rendered template is held to 1,000,000 characters (pipelines.evaluation.templates)
MAX_FILE_BYTES = 64 * MiB  # one data file: about 60,000 items of 1 KiB; calibration keeps every text in memory
# Lines of one data file, blank ones included: a million-item set of short items fits twice over; reading this many
# blank lines takes about a second here.
MAX_LINES = 2_000_000
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def display_path(path: Path | str) -> str:
    """A path as a message shows it: relative to the working directory when under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError, RuntimeError):
        return str(path)


def _open_bounded(path: Path, where: str, max_file_bytes: int) -> int:
    """A descriptor of the regular file at path, no larger than max_file_bytes (a FIFO does not block the open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError("data file not found", file=where) from None
    except OSError as error:
        raise InputError(f"cannot read the data file: {error.strerror or error}", file=where) from None
    status = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(status.st_mode):
        problem = "not a regular file"
    elif status.st_size > max_file_bytes:
        problem = f"{status.st_size} bytes: data files are limited to {max_file_bytes} bytes"
    if problem:
        os.close(fd)
        raise InputError(problem, file=where)
    os.set_blocking(fd, True)
    return fd


def iter_jsonl(
    path: Path, *, max_line_bytes: int = MAX_LINE_BYTES, max_file_bytes: int = MAX_FILE_BYTES, max_lines: int = MAX_LINES,
    non_finite: bool = False,
) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a line that is not a JSON object is an InputError.

    Lines are UTF-8 (a byte-order mark on the first is accepted); NaN and Infinity are refused (unless `non_finite`:
    lm-eval's per-sample files, written by Python's json.dumps, carry a model's NaN or infinite value as the bare
    literals `NaN` / `Infinity` / `-Infinity`, which the gate must see as a value to reject), as is
    nesting too deep for the JSON parser, and a lone surrogate (`"\\ud800"`: not a character, it cannot be
    written back as UTF-8). The file is checked to be a regular file no larger than `max_file_bytes` once open,
    and no line is read past `max_line_bytes`, nor more than `max_lines` lines (nor the file past its limit,
    should it grow while being read)."""
    where = display_path(path)
    with os.fdopen(_open_bounded(Path(path), where, max_file_bytes), "rb") as handle:
        _refuse_many_lines(handle, max_lines, max_file_bytes, where)
        read = 0
        number = 0
        while raw := handle.readline(max_line_bytes + 1):
            number += 1
            read += len(raw)
            if number > max_lines:  # the file grew since it was counted
                raise _too_many_lines(max_lines, where, number)
            if len(raw) > max_line_bytes and not (len(raw) == max_line_bytes + 1 and raw.endswith(b"\n")):
                raise InputError(f"line longer than {max_line_bytes} bytes", file=where, field=f"line {number}")
            if read > max_file_bytes:
                raise InputError(f"more than {max_file_bytes} bytes: data files are limited to that", file=where, field=f"line {number}")
            value = _parse_line(raw, number, where, non_finite)
            if value is not None:
                yield number, value


def _refuse_many_lines(handle: BinaryIO, max_lines: int, max_file_bytes: int, where: str) -> None:
    """Count the file's lines before parsing one, in C (bytes.count over 1 MiB blocks: a tenth of a second for 64 MiB),
    so that a file of millions of blank lines is refused without a Python step per line; then rewind. A file that grew
    past its byte limit meanwhile is left to the reading loop to refuse."""
    lines = scanned = 0
    while scanned <= max_file_bytes and (block := handle.read(MiB)):
        scanned += len(block)
        lines += block.count(b"\n")
        if lines > max_lines:
            raise _too_many_lines(max_lines, where, max_lines + 1)
    handle.seek(0)


def _too_many_lines(max_lines: int, where: str, number: int) -> InputError:
    return InputError(f"more than {max_lines:,} lines (blank ones included): data files are limited to that", file=where, field=f"line {number}")


def _parse_line(raw: bytes, number: int, where: str, non_finite: bool = False) -> dict | None:
    """The object on one line, None for a blank line."""
    field = f"line {number}"
    try:
        line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as error:
        byte = raw[error.start:error.start + 1].hex()
        raise InputError(f"not UTF-8 text (byte 0x{byte} at column {error.start + 1})", file=where, field=field) from None
    if not line.strip():
        return None
    try:
        value = json.loads(line, parse_constant=float if non_finite else refuse_constant,
                           parse_float=float if non_finite else finite_float)
    except json.JSONDecodeError as error:
        raise InputError(f"invalid JSON: {error.msg} (column {error.colno})", file=where, field=field) from None
    except ValueError as error:
        raise InputError(f"invalid JSON: {error}", file=where, field=field) from None
    except RecursionError:
        raise InputError("invalid JSON: nested too deep", file=where, field=field) from None
    if not isinstance(value, dict):
        raise InputError(f"expected a JSON object, got {type(value).__name__}", file=where, field=field)
    if _ESCAPED_SURROGATE.search(raw):  # only an escape can make one: UTF-8 bytes never decode to a surrogate
        _refuse_lone_surrogates(value, where, field)
    return value


def _refuse_lone_surrogates(value: dict, where: str, field: str) -> None:
    """A surrogate escape not paired into one character decodes to a lone surrogate, which no UTF-8 writer accepts."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(error.object[error.start])
        raise InputError(f"a lone surrogate \\u{code:04x} (an escape that is not a character; write the character itself)",
                         file=where, field=field) from None
