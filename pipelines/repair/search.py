"""The search: which modules to move up their ladders, and how far, gated for real as few times as possible.

1. The promotion sequence. Every unit has points (weight bytes, estimated KL) for its current scheme and each
   rung above it. Along each unit's lower convex hull, a move trades bytes for KL; all units' moves are merged
   by KL removed per byte added, steepest first (a unit's own moves stay in ladder order). Proposal k makes
   the first k moves: its bytes grow with k, its predicted KL falls. This is the greedy answer to "the least
   KL for a byte budget" (the multiple-choice knapsack of ModelOpt's AutoQuantize), with the gate, not a
   budget, deciding how far to go. Single-unit estimates miss how errors compound across many units (on
   SmolLM2 w4a16 the units' KLs sum to a fraction of the whole recipe's), so a second order is also built,
   level by level (every unit to the next rung of its hull, most sensitive first, before any goes further), and
   the simulator chooses: the order whose first proposal (below) costs the fewest bytes is searched, except that a
   budget of three gates or more searches level by level, whose tier ends (item 2) are whole formats.
2. The first proposal: the smallest k whose simulated KL (the whole proposal fake-quantized, measured in
   transformers) is at most the target: `kl_safety` x the policy's smallest max_kl for this recipe. With at least
   three gates in the budget the first gate is spent on a cheaper proposal: the fewest moves under the geometric
   mean of the rejected recipe's simulated KL and that target (on SmolLM2 w4a16, 0.44 and 0.02: the target's
   proposal put 87 of 120 units in 16-bit, 225 MiB, where the cheap one was all int4 GPTQ, 108 MiB); a failure there costs one gate and the target's
   proposal is gated next, a pass is shrunk as below. When the target's proposal lies beyond them and the cheap one
   failed, the next gates (while two are left) go to the tier ends: the last proposal before any unit changes its
   storage (level by level, every unit's own format climbed first: symmetric int4 at its finest group size, with
   GPTQ), then the last before the first 16-bit move (zero points too), before paying several times a module's
   bytes for 16-bit. A change of zero points is the one move the simulated KL ranks and the gate can overturn: on
   SmolLM2 every asymmetric unit measured had the smaller error, asymmetric int4 everywhere was the closer by the
   served KL (0.0074 against 0.0265 nats/token) and lost retail_order_id by copying the prompt's worked example,
   where symmetric int4 everywhere passed. No cheap proposal's failure raises the bar. Not the
   max_kl itself: the accuracy rules bind long before the KL rule (on the demo, a proposal simulated at 0.016
   nats/token, 0.024 by the gate, lost 10 points on one set; 0.00016 passed), and a first proposal that passes
   leaves the remaining gates to shrinking. Found by bisection on the simulated curve: forward passes, not gates.
3. Gated for real. A failure raises the bar (the target is divided by `escalate` below what failed) and the
   next proposal is found the same way; a pass is then shrunk by bisection between the last failure and the
   smallest pass, while a gate is left (and, if `min_saving` is set, while the midpoint saves that share of the bytes).
   The shrink does not halve the moves: it aims at the geometric mean of the simulated KL of the largest failure (at
   first the rejected recipe itself) and of the smallest pass, whose fewest moves it gates. Along the sequence the
   KL falls fast over the first moves (the free ones, static -> dynamic scales and RTN -> GPTQ, then the steepest)
   and slowly over the many last (16-bit moves of small gain), so halving the moves spends gates on proposals far
   larger than the answer. Where that point lies within a quarter of either end (or nowhere strictly between), it
   halves the moves instead: every gate then cuts the interval by at least a quarter, so the shrink stays logarithmic.
   A proposal whose simulated KL is over a max_kl that rejects (`max_kl_action: reject`) counts as a failure
   without a gate: the simulated KL is the mean over every set's reference paths and the gate rejects when any
   one set's mean is over such a max_kl, so that proposal fails unless the simulation is off (on SmolLM2 w4a16,
   simulated 0.316: the gate measured 0.269 and 0.219 on two sets, max_kl 0.2, rejected). A max_kl that only
   warns (the default) is no limit here: such a proposal is gated.
   The budget: `max_gates` full gates and `max_wall_s` of wall time (a gate is not started when the slowest
   one so far would not finish within it). A gate that cannot decide (a server that fails to start) stops
   the search: with a pass in hand the repair reports it, otherwise it is the repair's error.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from pipelines.quantize.compiler import scheme_summary
from pipelines.recipe import GroupScheme
from pipelines.repair.units import Assignment

LEVEL_ORDER = "level by level"
PROBING_GATES = 3  # a budget of this many gates or more spends its first gates on cheap probes
KL_FLOOR = 1e-9  # nats/token: a simulated KL of 0 (every unit 16-bit) still has a logarithm
StopReason = Literal["shrunk", "savings too small", "gate budget", "time budget", "ladder exhausted", "does not fit", "gate error"]


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_gates: int = Field(default=4, ge=1, le=1000, description="full gates (quantize, serve, score, gate) the search may run")
    max_wall_s: float = Field(default=4 * 3600.0, gt=0, le=30 * 24 * 3600, allow_inf_nan=False, description="wall time of the whole repair")


class SearchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kl_safety: float = Field(default=0.1, gt=0, le=1, description="the first proposal's simulated KL is at most this share of max_kl")
    kl_target_without_rule: float = Field(default=0.05, gt=0, description="nats/token, when the policy sets no max_kl")
    escalate: float = Field(default=4.0, gt=1, description="after a failure, the target drops this many times below what failed")
    min_saving: float = Field(default=0.0, ge=0, lt=1, description="shrink only while the midpoint saves this share of the weight bytes "
                                                                   "(0: while gates are left, towards the fewest modules moved)")


class Move(BaseModel):
    model_config = ConfigDict(frozen=True)

    unit: str
    scheme: GroupScheme | None
    delta_bytes: int
    delta_kl: float = Field(description="estimated KL removed (nats/token)")

    @property
    def label(self) -> str:
        return scheme_summary(self.scheme)


def promotion_sequence(current: dict[str, GroupScheme], options: dict[str, list[GroupScheme | None]],
                       cost: Callable[[str, GroupScheme | None], int], kl: Callable[[str, GroupScheme | None], float]) -> list[Move]:
    """All units' hull moves, steepest (KL removed per byte) first; a unit's moves in its own ladder order."""
    hulls = {unit: _hull(unit, current[unit], options[unit], cost, kl) for unit in current}
    order = list(current)
    # Steepest first; among equal slopes (moves that add no bytes: static -> dynamic activations) the larger gain.
    heap = [(-_slope(moves[0]), -moves[0].delta_kl, order.index(unit), unit, 0) for unit, moves in hulls.items() if moves]
    heapq.heapify(heap)
    sequence = []
    while heap:
        _, _, rank, unit, index = heapq.heappop(heap)
        sequence.append(hulls[unit][index])
        if index + 1 < len(hulls[unit]):
            following = hulls[unit][index + 1]
            heapq.heappush(heap, (-_slope(following), -following.delta_kl, rank, unit, index + 1))
    return sequence


def _slope(move: Move) -> float:
    return move.delta_kl / move.delta_bytes if move.delta_bytes > 0 else float("inf")


def _hull(unit: str, start: GroupScheme | None, options: list[GroupScheme | None], cost, kl) -> list[Move]:
    """From the current scheme, repeatedly the option that removes the most KL per added byte (the lower convex
    hull of (bytes, KL)); options that remove no KL are never taken."""
    moves: list[Move] = []
    here: GroupScheme | None = start
    left = list(options)
    while True:
        here_bytes, here_kl = cost(unit, here), kl(unit, here)
        better = [(option, cost(unit, option) - here_bytes, here_kl - kl(unit, option)) for option in left]
        better = [entry for entry in better if entry[2] > 0]
        if not better:
            return moves
        option, delta_bytes, delta_kl = max(better, key=lambda e: (e[2] / e[1] if e[1] > 0 else float("inf"), -e[1]))
        moves.append(Move(unit=unit, scheme=option, delta_bytes=delta_bytes, delta_kl=delta_kl))
        left = left[left.index(option) + 1:]
        here = option


def same_storage(scheme: GroupScheme | None, other: GroupScheme | None) -> bool:
    """Whether two schemes store weights alike: bits, number type and zero points (symmetric or not), and 16-bit or
    quantized activations. Group size, the rounding algorithm and static or dynamic activation scales may differ."""
    if scheme is None or other is None:
        return scheme is other
    return ((scheme.weights.bits, scheme.weights.type, scheme.weights.symmetric, scheme.activations is None)
            == (other.weights.bits, other.weights.type, other.weights.symmetric, other.activations is None))


def level_sequence(current: dict[str, GroupScheme], options: dict[str, list[tuple[int, GroupScheme | None]]],
                   cost: Callable[[str, GroupScheme | None], int], kl: Callable[[str, GroupScheme | None], float],
                   ranking: list[str]) -> list[Move]:
    """Level by level: every unit, most sensitive first, moves to the ladder's next rung before any unit moves to the
    rung after it (group 32 everywhere before 16-bit anywhere); `options` are (ladder position, scheme) per unit. The
    rungs that keep a unit's storage (same_storage: symmetric int4 stays symmetric) are its levels first, the others
    after every unit has climbed those: the parent's format at its finest is one proposal of the sequence. Only the
    rungs on a unit's hull are levels for it: a rung estimated worse than one below it (int4 group 32
    round-to-nearest after group 64 GPTQ) is never a step up."""
    here: dict[str, GroupScheme | None] = dict(current)
    kept = {unit: [(p, s) for p, s in rungs if same_storage(s, current[unit])] for unit, rungs in options.items()}
    kept_hulls = {unit: _hull(unit, current[unit], [s for _, s in rungs], cost, kl) for unit, rungs in kept.items()}
    top = {unit: moves[-1].scheme if moves else current[unit] for unit, moves in kept_hulls.items()}
    after = {unit: _after(rungs, top[unit]) for unit, rungs in options.items()}
    hulls = {unit: {m.scheme for m in kept_hulls[unit]} | {m.scheme for m in _hull(unit, top[unit], [s for _, s in after[unit]], cost, kl)}
             for unit in options}
    sequence: list[Move] = []
    for phase in (kept, after):
        for position in sorted({p for rungs in phase.values() for p, _ in rungs}):
            for unit in ranking:
                found = [s for p, s in phase.get(unit, []) if p == position and s in hulls[unit]]
                if not found:
                    continue
                scheme = found[0]
                sequence.append(Move(unit=unit, scheme=scheme, delta_bytes=cost(unit, scheme) - cost(unit, here[unit]),
                                     delta_kl=kl(unit, here[unit]) - kl(unit, scheme)))
                here[unit] = scheme
    return sequence


def _after(rungs: list[tuple[int, GroupScheme | None]], top: GroupScheme | None) -> list[tuple[int, GroupScheme | None]]:
    """The rungs above `top` in ladder order that change the storage: where a unit goes once its own format is climbed."""
    start = next((p for p, s in rungs if s == top), -1)
    return [(p, s) for p, s in rungs if p > start and not same_storage(s, top)]


def first_below(predict: Callable[[int], float], lo: int, moves: int, target: float) -> int:
    """The smallest k in (lo, moves] with predict(k) <= target (bisection: the curve falls with k), else `moves`."""
    low, high = lo + 1, moves
    if predict(high) > target:
        return high
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if predict(middle) <= target else (middle + 1, high)
    return low


def assignment_at(current: dict[str, GroupScheme], sequence: list[Move], k: int) -> Assignment:
    """Every unit's scheme after the first k moves (a unit not moved keeps its current scheme)."""
    assignment: Assignment = dict(current)
    for move in sequence[:k]:
        assignment[move.unit] = move.scheme
    return assignment


def moved_units(current: dict[str, GroupScheme], sequence: list[Move], k: int) -> dict[str, GroupScheme | None]:
    """The units the first k moves change, and the scheme each ends on."""
    assignment = assignment_at(current, sequence, k)
    return {unit: scheme for unit, scheme in assignment.items() if scheme != current[unit]}


# ----------------------------------------------------------------------------------- the search


class GateResult(BaseModel):
    """What the search needs to know of one real gate."""

    passed: bool
    wall_s: float
    error: str | None = Field(default=None, description="the gate could not decide (a server failed); the search stops")


class Step(BaseModel):
    k: int
    predicted_kl: float
    weight_bytes: int
    fits: bool | None
    why: str = Field(description="why this proposal was chosen")
    gated: bool
    passed: bool | None = None
    wall_s: float = 0.0
    error: str | None = None


class SearchResult(BaseModel):
    steps: list[Step]
    stop: StopReason
    target_kl: float
    best: int | None = Field(description="k of the cheapest passing proposal, None when none passed")
    lowest_failed: int = Field(description="k of the largest proposal that failed (0: the rejected recipe)")


class Search:
    """The search over k for one promotion sequence of `moves` moves; `predict`, `price`, `fits` and `gate`
    are given (the simulator, the planner and the real gate in a repair; fakes in tests)."""

    def __init__(self, moves: int, *, predict: Callable[[int], float], price: Callable[[int], int], fits: Callable[[int], bool | None],
                 gate: Callable[[int, str], GateResult], budget: Budget, settings: SearchSettings, target_kl: float,
                 expected_gate_s: float, kl_limit: float | None = None, started: float | None = None,
                 clock: Callable[[], float] = time.monotonic, extra_s: Callable[[int], float] = lambda k: 0.0,
                 tier_ends: dict[int, str] | None = None):
        self.moves, self.predict, self.price, self.fits, self.gate = moves, predict, price, fits, gate
        self.tier_ends = dict(sorted((tier_ends or {}).items()))  # k -> what the move after it does ("16-bit")
        self._probes: set[int] = set()  # k of the cheap proposals gated before the target's: their failure does not escalate
        self.budget, self.settings, self.target, self.kl_limit = budget, settings, target_kl, kl_limit
        self.expected_gate_s, self.clock, self.extra_s = expected_gate_s, clock, extra_s
        self.started = clock() if started is None else started
        self.steps: list[Step] = []
        self.lo, self.hi = 0, cast(int | None, None)  # k = 0 is the rejected recipe itself

    def run(self) -> SearchResult:
        while True:
            stop = self._stop_before_next()
            if stop:
                break
            k, why = self._next()
            if k is None:
                stop = "ladder exhausted"
                break
            if self.hi is not None and self.price(self.hi) - self.price(k) < self.settings.min_saving * self.price(self.hi):
                stop = "savings too small"
                break
            if self.fits(k) is False:
                self.steps.append(Step(k=k, predicted_kl=self.predict(k), weight_bytes=self.price(k), fits=False, why=why, gated=False))
                stop = "does not fit"
                break
            if self.clock() - self.started + self.expected_gate_s + self.extra_s(k) > self.budget.max_wall_s:
                stop = "time budget"
                break
            self._gate(k, why)
        failed = [s.k for s in self.steps if s.gated and not s.passed]
        return SearchResult(steps=self.steps, stop=stop, target_kl=self.target, best=self.hi, lowest_failed=max(failed, default=0))

    def _stop_before_next(self) -> StopReason | None:
        if any(step.error for step in self.steps):
            return "gate error"
        if self.hi is not None and self.hi - self._shrink_floor() <= 1:
            return "shrunk"
        if sum(step.gated for step in self.steps) >= self.budget.max_gates:
            return "gate budget"
        return None

    def _next(self) -> tuple[int | None, str]:
        if self.hi is not None:
            return self._shrink()
        if self.lo >= self.moves:
            return None, ""
        probe = self._probe()
        if probe is not None:
            self._probes.add(probe[0])
            return probe
        k = first_below(self.predict, self.lo, self.moves, self.target)
        predicted = self.predict(k)
        if predicted <= self.target:
            return k, f"fewest moves whose simulated KL {predicted:.3g} <= target {self.target:.3g}"
        return k, f"every move: no proposal simulated below the target {self.target:.3g}"

    def _probe(self) -> tuple[int, str] | None:
        """With at least three gates, while every gate so far was a failed probe and two gates are left: the cheapest
        proposal not yet ruled out among the probes before the target's proposal. The probes: the cheap proposal, the
        fewest moves under the geometric mean of the rejected recipe's simulated KL and the target (a failure costs one
        gate, and the target follows), and the tier ends (`tier_ends`: the last proposal before any module changes its
        storage, then the last before any goes to 16-bit). Moves within a storage format (group size, GPTQ) cost a few
        percent of the bytes each and a 16-bit move several times its module's, so the smallest artifacts a format holds
        are gated before one that pays for 16-bit modules (on SmolLM2 w4a16: 120 modules at int4 against the target's
        64 modules in 16-bit, 193 MB). With one or two gates the target's proposal comes first."""
        if self.budget.max_gates < PROBING_GATES or self.budget.max_gates - len(self.steps) < 2:
            return None
        if any(step.passed is not False or step.k not in self._probes for step in self.steps):
            return None
        target_k = first_below(self.predict, self.lo, self.moves, self.target)
        probes: dict[int, str | None] = dict(self.tier_ends)  # k -> the tier it ends, None for the cheap proposal
        cheap = self._cheap_target()
        if cheap is not None:
            probes.setdefault(first_below(self.predict, 0, self.moves, cheap[0]), None)
        k = min((k for k in probes if self.lo < k < target_k), default=None)
        if k is None:
            return None
        # only the chosen probe is simulated for its reason: each simulation is a whole proposal fake-quantized
        if probes[k] is None:
            assert cheap is not None
            return k, f"fewest moves whose simulated KL {self.predict(k):.3g} <= {cheap[1]} {cheap[0]:.3g}"
        return k, (f"every move before the first to {probes[k]} (simulated KL {self.predict(k):.3g}): the smallest artifacts "
                   "before it are gated before the costlier proposals beyond it")

    def _cheap_target(self) -> tuple[float, str] | None:
        """The cheap probe's target: the geometric mean of the rejected recipe's simulated KL and the safe target (never
        over a max_kl that rejects); None when the rejected recipe is already simulated under the target."""
        parent = self.predict(0)
        if parent <= self.target:
            return None
        cheap = math.sqrt(parent * self.target)
        if self.kl_limit is not None and cheap > self.kl_limit:  # never gate what a rejecting max_kl would refuse
            return max(self.target, self.kl_limit), "max_kl"
        return cheap, f"the geometric mean of the rejected recipe's {parent:.3g} and the target"

    def _shrink(self) -> tuple[int, str]:
        """Between the largest failure (the parent itself at first) and the smallest pass: the fewest moves simulated under
        the geometric mean of their simulated KLs (the gate's verdict follows the KL across decades, bytes do not), or
        the midpoint in moves when the curve gives nothing strictly between them."""
        assert self.hi is not None
        floor = self._shrink_floor()
        below = "failed" if floor == self.lo else f"simulated KL over max_kl {self.kl_limit:g}, not gated"
        low_kl, high_kl = max(self.predict(floor), KL_FLOOR), max(self.predict(self.hi), KL_FLOOR)
        target = math.sqrt(low_kl * high_kl)
        k = first_below(self.predict, floor, self.hi, target)
        quarter = (self.hi - floor) // 4
        if floor + quarter <= k <= self.hi - quarter and floor < k < self.hi:
            return k, (f"shrink: the fewest moves simulated under {target:.3g}, the geometric mean of the KL at {floor} ({below}, "
                       f"{low_kl:.3g}) and at {self.hi} (passed, {high_kl:.3g}) moves")
        return (floor + self.hi) // 2, f"shrink: bisect between {floor} ({below}) and {self.hi} (passed) moves"

    def _shrink_floor(self) -> int:
        """The largest k below the smallest pass that is known to fail: gated, or simulated over max_kl."""
        if self.hi is None or self.kl_limit is None:
            return self.lo
        return max(self.lo, first_below(self.predict, self.lo, self.hi, self.kl_limit) - 1)

    def _gate(self, k: int, why: str) -> None:
        step = Step(k=k, predicted_kl=self.predict(k), weight_bytes=self.price(k), fits=self.fits(k), why=why, gated=True)
        result = self.gate(k, why)
        step.passed, step.wall_s, step.error = (None if result.error else result.passed), result.wall_s, result.error
        self.steps.append(step)
        if result.error:
            return
        self.expected_gate_s = max(self.expected_gate_s, result.wall_s)
        if result.passed:
            self.hi = k if self.hi is None else min(self.hi, k)
        else:
            self.lo = max(self.lo, k)
            if self.hi is None and k not in self._probes:
                self.target = min(self.target, step.predicted_kl) / self.settings.escalate
            # a cheap proposal (the first, the tier's last) that fails leaves the safe target as it was: it is gated next
