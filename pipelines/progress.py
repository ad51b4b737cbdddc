"""The product's own progress on the terminal, and where library output goes instead.

Progress of a stage that takes more than a few seconds:

    with track("quantize", total=num_layers, unit="layer") as bar:
        ...
        bar.advance()            # one more layer done (thread-safe: a callback or a log follower may call it)

On a terminal this is a live rich bar on stderr (stage, bar, done/total, elapsed, time left); elsewhere (a CI
log, a pipe) it is plain lines: at most one every PLAIN_INTERVAL_S seconds while the stage runs and always
the final one, e.g.

    > quantize: layer 12/30, 40 s elapsed, ~60 s left
    > quantize: 30 layers in 1 min 12 s

`total=None` is a stage whose size is unknown (a server starting): it shows what is done and the time spent.
Tracks may nest or run side by side; they share one live display.

Library output (llm-compressor's loguru, transformers warnings, tqdm bars, C code writing to fd 1/2, lm-eval's
logging) goes to a log file, not the terminal: `library_output_to_log()` points file descriptors 1 and 2 at
that file for the duration of the work, while the product's own console (pipelines.output.progress_console,
which `progress()` and `track()` write to) keeps a duplicate of the original stderr. `library_log(path)`
switches the target to a run's own file for the duration of a block (the run folder's library.log).
With `verbose=True` nothing is hidden: library output stays on stderr (and fd 1 points at stderr too, so
that stdout carries only the result).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from rich.markup import escape

from pipelines import output

PLAIN_INTERVAL_S = 10.0
LIBRARY_LOG_PREFIX = "library"


# ---------------------------------------------------------------- durations and lines


def duration(seconds: float) -> str:
    """40 s, 3 min 5 s, 1 h 2 min: short and without a fraction past ten seconds."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def _plural(unit: str, count: int) -> str:
    if count == 1 or not unit:
        return unit
    return unit[:-1] + "ies" if unit.endswith("y") and unit[-2:-1] not in "aeiou" else unit + "s"


class Bar:
    """One stage's count. `advance(n)` and `update(...)` are safe from any thread."""

    def __init__(
        self, stage: str, total: int | None, unit: str, *, clock: Callable[[], float] = time.monotonic,
        interval_s: float | None = None, emit: Callable[[str], None] | None = None,
        on_change: Callable[[Bar], None] | None = None,
    ) -> None:
        self.stage = stage
        self.unit = unit
        self._total = total
        self._completed = 0
        self._clock = clock
        self._started = clock()
        self._interval_s = PLAIN_INTERVAL_S if interval_s is None else interval_s
        self._last_line = self._started
        self._emit = emit  # plain mode: where a periodic line goes (None on a live display)
        self._on_change = on_change  # live mode: refresh the display
        self._lock = threading.Lock()
        self._anchor: tuple[float, int] | None = None  # (time, count) when the first unit was done
        self.finished = False

    # ---- counting

    @property
    def completed(self) -> int:
        return self._completed

    @property
    def total(self) -> int | None:
        return self._total

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._started

    def advance(self, n: int = 1) -> None:
        """n more units done (n=0 only lets a periodic plain line out, e.g. while waiting)."""
        with self._lock:
            self._completed += n
            if self._total is not None:
                self._completed = min(self._completed, self._total)
            self._anchor_at_first_unit()
        self._changed()

    def update(self, *, completed: int | None = None, total: int | None = None) -> None:
        """Set the count or the total outright (a follower that reads absolute counts)."""
        with self._lock:
            if total is not None:
                self._total = total
            if completed is not None:
                self._completed = max(0, completed)
            if self._total is not None:
                self._completed = min(self._completed, self._total)
            self._anchor_at_first_unit()
        self._changed()

    def _anchor_at_first_unit(self) -> None:
        if self._anchor is None and self._completed > 0:
            self._anchor = (self._clock(), self._completed)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)
        if self._emit is None or self.finished:
            return
        now = self._clock()
        with self._lock:
            due = now - self._last_line >= self._interval_s
            if due:
                self._last_line = now
        if due:
            self._emit(self.line())

    # ---- text

    def time_left_s(self) -> float | None:
        """From the pace since the first unit was done: the time before it (loading a model, starting a server)
        is warm-up, and counting it would promise a long stage for every stage that starts slowly."""
        done, total, anchor = self._completed, self._total, self._anchor
        if total is None or anchor is None or done <= anchor[1] or done >= total:
            return None
        since, first_count = anchor
        return (self._clock() - since) / (done - first_count) * (total - done)

    def line(self) -> str:
        """`quantize: layer 12/30, 40 s elapsed, ~60 s left` (what a plain log shows while it runs)."""
        elapsed = f"{duration(self.elapsed_s)} elapsed"
        if self._total is not None:
            left = self.time_left_s()
            return f"{self.stage}: {self.unit} {self._completed}/{self._total}, {elapsed}" + (f", ~{duration(left)} left" if left is not None else "")
        if self._completed:
            return f"{self.stage}: {self._completed} {_plural(self.unit, self._completed)}, {elapsed}"
        return f"{self.stage}: {elapsed}"

    def final_line(self, failed: bool = False) -> str:
        """`quantize: 30 layers in 1 min 12 s`, or where it stopped."""
        spent = duration(self.elapsed_s)
        if failed:
            where = f" at {self.unit} {self._completed}/{self._total}" if self._total is not None else (
                f" after {self._completed} {_plural(self.unit, self._completed)}" if self._completed else "")
            return f"{self.stage}: stopped{where} after {spent}"
        if self._total is not None:
            count = f"{self._completed} {_plural(self.unit, self._completed)}" if self._completed == self._total else (
                f"{self.unit} {self._completed}/{self._total}")
            return f"{self.stage}: {count} in {spent}"
        if self._completed:
            return f"{self.stage}: {self._completed} {_plural(self.unit, self._completed)} in {spent}"
        return f"{self.stage}: done in {spent}"


# ---------------------------------------------------------------- the live display (a terminal)


class _Live:
    """One rich Progress shared by every track open at a time (rich allows one live display per console)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress: Any = None  # a rich Progress, imported when the first bar opens
        self._tasks: dict[int, object] = {}

    def add(self, bar: Bar) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        with self._lock:
            if self._progress is None:
                self._progress = Progress(
                    TextColumn("[dim]>[/dim] {task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]},"),
                    TimeElapsedColumn(), TextColumn("elapsed, ~"), TimeRemainingColumn(), TextColumn("left"),
                    console=output.progress_console, transient=True,
                    # Library output is not re-routed through the display: it goes where fd 1/2 point (the log).
                    redirect_stdout=False, redirect_stderr=False,
                )
                self._progress.start()
            self._tasks[id(bar)] = self._progress.add_task(
                escape(output.printable(bar.stage)), total=bar.total, unit=escape(_plural(bar.unit, 2))
            )

    def changed(self, bar: Bar) -> None:
        with self._lock:
            task = self._tasks.get(id(bar))
            if task is not None and self._progress is not None:
                self._progress.update(task, completed=bar.completed, total=bar.total)

    def remove(self, bar: Bar) -> None:
        with self._lock:
            task = self._tasks.pop(id(bar), None)
            if self._progress is None:
                return
            if task is not None:
                self._progress.remove_task(task)
            if not self._tasks:
                self._progress.stop()
                self._progress = None


_LIVE = _Live()


def live_display() -> bool:
    """A live bar only where a person watches: the product's console is a terminal (not dumb, not CI)."""
    console = output.progress_console
    return bool(console.is_terminal and not console.is_dumb_terminal and os.environ.get("CI") is None)


@contextmanager
def track(stage: str, total: int | None = None, unit: str = "step") -> Iterator[Bar]:
    """Progress of one stage: `with track("quantize", total=30, unit="layer") as bar: bar.advance()`.

    The final line (`quantize: 30 layers in 52 s`, or `... stopped at layer 12/30 after 40 s`) is printed
    however the block ends."""
    live = live_display()
    bar = Bar(stage, total, unit, emit=None if live else output.progress, on_change=_LIVE.changed if live else None)
    stop = threading.Event()
    if live:
        if output.before_progress is not None:
            output.before_progress()
        _LIVE.add(bar)
    else:  # a plain log still hears from a stage that counts nothing for a while (a server starting)
        threading.Thread(target=_heartbeat, args=(bar, stop), name=f"progress {stage}", daemon=True).start()
    failed = True
    try:
        yield bar
        failed = False
    finally:
        stop.set()
        bar.finished = True
        if live:
            _LIVE.remove(bar)
        output.progress(bar.final_line(failed=failed))


def _heartbeat(bar: Bar, stop: threading.Event) -> None:
    while not stop.wait(min(1.0, PLAIN_INTERVAL_S)):
        bar.advance(0)


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
    from pipelines.settings import current

    return current().logs_dir


def _new_log_path(folder: Path | None) -> tuple[Path, list[Path]]:
    """A new log file's path (created) and the folders made for it (removed again if nothing was logged)."""
    import tempfile

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
