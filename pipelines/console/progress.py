"""The product's own progress on the terminal.

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

Bars and lines go to the product's own console (pipelines.console.output.progress_console). Library output goes to a
log file instead (pipelines.console.capture); this module neither imports nor re-routes it: a live display leaves fd 1/2 alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.markup import escape

from pipelines.console import output

PLAIN_INTERVAL_S = 10.0


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
        # heavy: imported when used
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
