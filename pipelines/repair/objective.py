"""Which passing candidate wins: the smallest (`size`, the default) or the fastest measured (`speed`).

    choice = choose(contenders, "speed")   # contenders in size order, smallest first

A job ranks its results per model, a repair its attempts; both hand over every candidate it gated (rejected ones
too: the frontiers show them, greyed) in its own size order, and read the winner off the Choice. With `speed` the
passing candidate with the highest throughput ratio estimate (candidate / 16-bit output tokens/s at the policy's
deployment concurrency, from the paired load test: pipelines/loadtest/comparison.py) wins. Two ratios whose 95%
intervals overlap are not told apart: the Choice says so and names the one that would win by size among them. A
passing candidate without a load-test figure cannot win on speed; when none has one, size decides, with a note.

Light on purpose (pydantic only): `quantize job` imports it before the job machinery.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from pydantic import Field

from pipelines.errors import InputError
from pipelines.loadtest.results import PerformanceSummary
from pipelines.schema import StrictModel

if TYPE_CHECKING:  # gate.schema imports scipy (seconds): `quantize job` imports this module before its address check
    from pipelines.gate.schema import GateReport

Objective = Literal["size", "speed"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
OBJECTIVE_HELP = ("what wins among the candidates that pass the quality gate: size (the fewest weight bytes) or speed (the best "
                  "measured throughput ratio at the policy's concurrency, from the load test)")


class QualityBound(StrictModel):
    """How close a candidate came to the gate's tolerance: its worst eval set's one-sided upper confidence bound on the
    worsening (positive: worse than 16-bit), in that set's unit."""

    value: float
    eval_set: str
    unit: str

    @property
    def text(self) -> str:
        return f"{self.value:+.2f} {self.unit} ({self.eval_set})"


def quality_bound(report: GateReport) -> QualityBound | None:
    """The worst set's worsening bound (`worsening_bound`, else the two-sided interval's bad end); None without sets."""
    bounds = [(s.worsening_bound if s.worsening_bound is not None else s.worst_bound, s) for s in report.gate.sets]
    if not bounds:
        return None
    value, worst = max(bounds, key=lambda pair: pair[0])
    return QualityBound(value=value, eval_set=worst.eval_set, unit=worst.unit)


class Contender(StrictModel):
    """One gated candidate as the objective sees it."""

    name: str = Field(description="how the report names it: a recipe (job) or `attempt N` (repair)")
    passed: bool = Field(description="the quality gate promoted it")
    weight_bytes: int | None
    quality: QualityBound | None
    performance: PerformanceSummary | None = None

    @property
    def ratio(self) -> float | None:
        return self.performance.throughput_ratio if self.performance is not None else None

    @property
    def interval(self) -> tuple[float, float] | None:
        bounds = self.performance.throughput_interval if self.performance is not None else None
        return (bounds[0], bounds[1]) if bounds else None

    def ratio_text(self) -> str:
        if self.ratio is None:
            return "-"
        interval = self.interval
        shown = f" [95% CI {interval[0]:.3f}, {interval[1]:.3f}]" if interval else " (no interval: one pair)"
        assert self.performance is not None
        return f"{self.ratio:.3f}{shown}, {self.performance.speed or 'no conclusion'}, {self.performance.pairs or 0} pairs"


class Choice(StrictModel):
    """What won under the objective, and the sentences that say why."""

    objective: Objective
    decided_by: Objective | None = Field(description="speed, or size (the objective, or the fallback when no passing candidate "
                                                     "has a load-test figure); null: nothing passed")
    winner: str | None
    throughput_ratio: float | None = None
    throughput_interval: list[float] | None = Field(default=None, description="[low, high] of the winner's ratio, 95%")
    tied: list[str] = Field(default=[], description="speed: the winner and every candidate whose interval overlaps the winner's")
    size_winner_of_tied: str | None = Field(default=None, description="which of `tied` would win by size")
    without_figures: list[str] = Field(default=[], description="passing candidates with no load-test figure: they cannot win on speed")
    notes: list[str] = Field(default_factory=list)


def choose(contenders: list[Contender], objective: Objective) -> Choice:
    """The winner among the passing contenders (given in size order, smallest first)."""
    passing = [c for c in contenders if c.passed]
    if not passing:
        return Choice(objective=objective, decided_by=None, winner=None, notes=["Nothing passed the quality gate."])
    if objective == "size":
        return _by_size(objective, passing[0])
    return _by_speed(passing)


def _by_size(objective: Objective, smallest: Contender, notes: list[str] | None = None, without: list[str] | None = None) -> Choice:
    size = "-" if smallest.weight_bytes is None else f"{smallest.weight_bytes:,} weight bytes"
    return Choice(objective=objective, decided_by="size", winner=smallest.name, without_figures=without or [],
                  notes=[*(notes or []), f"By size: {smallest.name} ({size}), the smallest that passed."])


def _by_speed(passing: list[Contender]) -> Choice:
    measured = [c for c in passing if c.ratio is not None]
    without = [c.name for c in passing if c.ratio is None]
    notes = [f"{', '.join(without)}: passed the quality gate without a load-test figure (the load test was off or did not run): "
             "cannot win on speed."] if without else []
    if not measured:
        return _by_size("speed", passing[0], [*notes, "No passing candidate has a load-test figure: chosen by size instead."], without)
    winner = max(measured, key=lambda c: (c.ratio or 0.0, -passing.index(c)))  # equal estimates: the smaller wins
    tied = [winner, *(c for c in measured if c is not winner and _overlap(c, winner))]
    assert winner.performance is not None
    notes.append(f"By speed: {winner.name}, throughput {winner.ratio_text()} x the 16-bit model's output tokens/s at concurrency "
                 f"{winner.performance.deployment_concurrency}.")
    by_size = min(tied, key=passing.index)
    if len(tied) > 1:
        others = ", ".join(f"{c.name} ({c.ratio_text()})" for c in tied[1:])
        notes.append(f"Not distinguishable at 95% from {others}: the intervals overlap. By size, {by_size.name} would win among them.")
    return Choice(objective="speed", decided_by="speed", winner=winner.name, throughput_ratio=winner.ratio,
                  throughput_interval=list(winner.interval) if winner.interval else None, tied=[c.name for c in tied] if len(tied) > 1 else [],
                  size_winner_of_tied=by_size.name if len(tied) > 1 else None, without_figures=without, notes=notes)


def _overlap(one: Contender, other: Contender) -> bool:
    """Whether two ratios cannot be told apart: their 95% intervals overlap (a ratio with no interval overlaps any)."""
    a, b = one.interval, other.interval
    return a is None or b is None or (a[0] <= b[1] and b[0] <= a[1])


def require_load_test(objective: Objective, *, loadtest: bool, enabled: bool, policy_path: Path) -> None:
    """`speed` ranks by the load test's figures: refused before any work where no attempt would have one."""
    if objective != "speed":
        return
    if not loadtest:
        raise InputError("--objective speed ranks by the load test's throughput: drop --no-loadtest", field="--no-loadtest")
    if not enabled:
        raise InputError("--objective speed ranks by the load test's throughput, which this policy turns off for the recipe",
                         file=policy_path, field="performance.enabled")
