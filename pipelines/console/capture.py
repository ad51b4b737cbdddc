"""Where library output goes: a log file instead of the terminal.

Library output (llm-compressor's loguru, transformers warnings, tqdm bars, C code writing to fd 1/2, lm-eval's
logging) goes to a log file, not the terminal: `library_output_to_log()` points file descriptors 1 and 2 at
that file for the duration of the work, while the product's own console (pipelines.console.output.progress_console,
which `progress()` and `pipelines.console.progress.track()` write to) keeps a duplicate of the original stderr.
`library_log(path)` switches the target to a run's own file for the duration of a block (the run folder's
library.log). With `verbose=True` (or `--verbose`, add_verbose_option) nothing is hidden: library output stays
on stderr (and fd 1 points at stderr too, so that stdout carries only the result).

The terminal's progress (pipelines.console.progress) knows nothing of this module: once library output is captured,
pipelines.console.output.before_progress says where it went before the next progress line.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from rich.markup import escape

from pipelines.console import output
from pipelines.settings import current

LIBRARY_LOG_PREFIX = "library"


# ---------------------------------------------------------------- library output to a log file


@dataclass
class _Capture:
    """While library output is captured: the saved terminal fds and the stack of log targets (open fds)."""

    saved_stdout: int
    saved_stderr: int
    console_file: IO[str]
    targets: list[int] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    announced: bool = False

    def announce(self) -> None:
        """Before the product's next line, once library output has reached the session's log: where it is.
        (Nothing is said while nothing was logged: a refused input still prints its one error line only.)"""
        if self.announced:
            return
        try:
            logged = self.paths[0].stat().st_size > 0
        except OSError:
            logged = False
        if logged:
            self.announced = True
            output.progress_console.print(
                f"[dim]>[/dim] library output (llm-compressor, transformers, lm-eval, torch) goes to "
                f"{escape(output.printable(str(self.paths[0])))}; --verbose shows it here"
            )


_capture: _Capture | None = None
_capture_lock = threading.Lock()
_verbose_requested = False


def request_verbose(value: bool = True) -> None:
    """What `--verbose` sets (add_verbose_option): the next library_output_to_log() leaves library output on stderr."""
    global _verbose_requested
    _verbose_requested = value


def _take_verbose_request() -> bool:
    global _verbose_requested
    value, _verbose_requested = _verbose_requested, False
    return value


class _VerboseAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        request_verbose(True)


def add_verbose_option(parser: argparse.ArgumentParser) -> None:
    """`--verbose`: library output (llm-compressor, transformers, lm-eval, torch) on stderr instead of a log file."""
    parser.add_argument(
        "--verbose", action=_VerboseAction,
        help="show library output (llm-compressor, transformers, lm-eval, torch) on stderr instead of writing it to a log file",
    )


def library_logs_dir() -> Path:
    """`$QUANTGATE_ARTIFACTS/logs` as the environment says now."""

    return current().logs_dir


def _new_log_path(folder: Path | None) -> tuple[Path, list[Path]]:
    """A new log file's path (created) and the folders made for it (removed again if nothing was logged)."""

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"{LIBRARY_LOG_PREFIX}-{stamp}-{os.getpid()}.log"
    problems = []
    for candidate in ([folder] if folder is not None else []) + [library_logs_dir(), Path(tempfile.gettempdir()) / "quantgate-logs"]:
        made = [parent for parent in (candidate, *candidate.parents) if not parent.exists()]
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            path = candidate / name
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666))
            return path, made
        except OSError as error:
            problems.append(f"{candidate}: {error.strerror or error}")
    raise OSError(f"no folder for the library log: {'; '.join(problems)}")


def _remove_if_empty(path: Path, made: list[Path]) -> None:
    """A run that logged nothing (refused at once) leaves no file and no folder behind."""
    try:
        if path.stat().st_size:
            return
        path.unlink()
        for folder in made:  # innermost first
            folder.rmdir()
    except OSError:
        pass


def _flush_all() -> None:
    """Python's buffers and C stdio's (torch, tokenizers), before a file descriptor changes target."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):
        pass


def _point_at(fd: int) -> None:
    _flush_all()
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def capturing() -> bool:
    return _capture is not None


def current_library_log() -> Path | None:
    capture = _capture
    return capture.paths[-1] if capture and capture.paths else None


@contextmanager
def library_output_to_log(log_path: Path | None = None, *, verbose: bool | None = None, logs_dir: Path | None = None) -> Iterator[Path | None]:
    """Library output (fd 1 and fd 2) into `log_path` (default: a new file under artifacts/logs) while the
    block runs; the product's progress stays on the real stderr. Yields the log's path (None when verbose).

    verbose (default: whether `--verbose` was given): nothing captured; fd 1 points at stderr instead, so that
    stdout carries only the result printed afterwards (a table or the --json document)."""
    global _capture
    if verbose is None:
        verbose = _take_verbose_request()
    else:
        _take_verbose_request()
    if verbose or _capture is not None:  # verbose, or already captured by an outer block
        with _stdout_on_stderr():
            yield current_library_log()
        return
    path, made = (Path(log_path), []) if log_path is not None else _new_log_path(logs_dir)
    _flush_all()
    saved_stdout, saved_stderr = os.dup(1), os.dup(2)
    console_file, owned = _console_file(saved_stderr)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    with _capture_lock:
        _capture = _Capture(saved_stdout, saved_stderr, console_file, [target], [path])
        output.progress_console.file = console_file
        output.before_progress = _capture.announce
    try:
        _point_at(target)
        yield path
    finally:
        with _capture_lock:
            _flush_all()
            os.dup2(saved_stdout, 1)
            os.dup2(saved_stderr, 2)
            for fd in (saved_stdout, saved_stderr, *_capture.targets):
                _close(fd)
            output.progress_console.file = None  # type: ignore[assignment]  # rich: None means "back to sys.stderr"
            output.before_progress = None
            _capture = None
        if owned:
            try:
                console_file.close()
            except OSError:
                pass
        if log_path is None:
            _remove_if_empty(path, made)


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _console_file(saved_stderr: int) -> tuple[IO[str], bool]:
    """Where the product's console writes while fd 2 points at the log (and whether it is ours to close): a
    duplicate of the real stderr, or, when Python's sys.stderr is not fd 2 at all (an embedding program, a
    test capturing it), that object."""
    if _stderr_fd() != 2 and sys.stderr is not None:
        return sys.stderr, False
    return os.fdopen(os.dup(saved_stderr), "w", buffering=1, encoding="utf-8", errors="replace"), True


@contextmanager
def library_log(path: Path) -> Iterator[None]:
    """Library output of this block goes to `path` (a run folder's own log); then back to the previous target.
    Nothing changes when library output is not captured (--verbose, or a caller outside the CLI)."""
    capture = _capture
    if capture is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    with _capture_lock:
        capture.targets.append(target)
        capture.paths.append(path)
        _point_at(target)
    try:
        yield
    finally:
        with _capture_lock:
            if _capture is capture and capture.targets and capture.targets[-1] == target:
                capture.targets.pop()
                capture.paths.pop()
                _point_at(capture.targets[-1])
                _close(target)
        _remove_if_empty(path, [])


@contextmanager
def _stdout_on_stderr() -> Iterator[None]:
    """fd 1 points at fd 2 for the block: libraries printing to stdout land beside the progress lines."""
    _flush_all()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        _flush_all()
        os.dup2(saved, 1)
        _close(saved)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
