"""The driver's view of a running job: each candidate queued, running (on which node, which attempt) or
decided, and the time left estimated from the wall times measured so far.

Time left: the mean wall time of the candidates decided in this run, times the candidates queued, plus what
that mean leaves of each running one, divided by the most candidates seen running at once (the cluster's
measured parallelism). Unknown until the first candidate is decided.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipelines.console.progress import duration
from pipelines.jobs.ray.worker import TaskStatus, read_status, status_path


class Tracker:
    def __init__(self, labels: dict[int, str], keys: dict[int, str], status_dir: Path):
        self.labels = labels
        self.keys = keys
        self.status_dir = status_dir
        self.running: dict[int, TaskStatus] = {}
        self.decided: dict[int, float] = {}  # position -> wall s
        self.most_at_once = 1
        self.baselines: tuple[int, int] = (0, 0)  # baseline tasks finished, of how many

    @property
    def queued(self) -> list[int]:
        return [p for p in self.labels if p not in self.running and p not in self.decided]

    def poll(self) -> bool:
        """Read the workers' status files; True when something started (or started again) since the last poll."""
        changed = False
        for position in [p for p in self.labels if p not in self.decided]:
            status = read_status(status_path(self.status_dir, self.keys[position]))
            if status is not None and status != self.running.get(position):
                self.running[position] = status
                changed = True
        self.most_at_once = max(self.most_at_once, len(self.running))
        return changed

    def finish(self, position: int, wall_s: float) -> None:
        self.running.pop(position, None)
        self.decided[position] = wall_s

    def seconds_left(self, now: float | None = None) -> float | None:
        if not self.decided:
            return None
        now = time.time() if now is None else now
        mean = sum(self.decided.values()) / len(self.decided)
        work = mean * len(self.queued) + sum(max(0.0, mean - (now - s.started_at)) for s in self.running.values())
        return work / self.most_at_once

    def line(self, now: float | None = None) -> str:
        running = ", ".join(
            f"{self.labels[p]} on {s.node}" + (f" (attempt {s.attempt})" if s.attempt > 1 else "") for p, s in self.running.items()
        )
        left = self.seconds_left(now)
        eta = "time left unknown until a candidate is decided" if left is None else f"about {duration(left)} left"
        if not self.queued and not self.running:
            eta = "done"
        done, total = self.baselines
        baselines = f"baselines {done}/{total} scored, " if total else ""
        return (f"{baselines}{len(self.queued)} queued, {len(self.running)} running" + (f" ({running})" if running else "")
                + f", {len(self.decided)} decided of {len(self.labels)}; {eta}")
