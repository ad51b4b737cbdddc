"""The runtime's own noise floor: the 16-bit baseline scored twice on the same runtime, and what the gate charges a
candidate with it (docs/guarantees.md, "The runtime's noise floor").

vLLM's CPU build batches requests, and batching changes float sums: the same model answers a few items differently from
one scoring to the next. With the policy's `noise_floor` on, the run scores the baseline a second time (a fresh scoring,
cached by content like the first) and per set:

- reports the A/A flips (items whose value differs between the passes, both directions), their rate with an exact
  (Clopper-Pearson) interval, and the items that flipped, by id, as unstable;
- compares the candidate with the mean of both passes (per item 0, 1/2 or 1 on a pass/fail set; averaged metrics their
  mean), so a loss or gain on an item the runtime flipped counts half. The mean has the runtime's expected answer per item,
  as each pass has: the worsening stays unbiased and the baseline's share of the noise is halved. Tango's bound reads the
  half counts with its variance computed as if each half-flip were a whole one, which over-states it: the calibrated
  test stays within its error rate (simulated: pipelines.benchmarks.noise_rule);
- never excludes the unstable items: they are the borderline ones a quantized model flips first, and a test without them
  misses damage that lands there (simulated: a true drop of the tolerance promoted about a third of the time);
- refuses a tolerance smaller than the floor (the A/A rate in the set's unit): a gate cannot resolve a drop smaller
  than the runtime's own noise. Corpus metrics get the report only (their aggregate is not a mean of items).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scipy.stats import binomtest

from pipelines.errors import InputError
from pipelines.gate.policy import Policy
from pipelines.gate.schema import NoiseFloor
from pipelines.recipe import RecipeIdentity

INTERVAL_CONFIDENCE = 0.95


def flipped(first: Any, second: Any) -> bool:
    """Whether an item's value differs between two scorings (numbers, or corpus lists such as [gold, prediction])."""
    return bool(first != second)


def rate_interval(flips: int, n: int, confidence: float = INTERVAL_CONFIDENCE) -> tuple[float, float]:
    """The exact (Clopper-Pearson) two-sided interval of a binomial rate (scipy's binomtest)."""
    interval = binomtest(flips, n).proportion_ci(confidence_level=confidence, method="exact")
    return float(interval.low), float(interval.high)


def measure_floor(
    item_ids: Sequence[str], first: Sequence[Any], second: Sequence[Any], *, kind: str, scale: float, in_points: bool,
    candidate: Sequence[Any] | None = None,
) -> NoiseFloor:
    """One set's A/A figures from its two baseline passes (and, given the candidate's values, how many of the candidate's
    differences from the first pass fall on the items the runtime flipped)."""
    n = len(item_ids)
    unstable = [item for item, a, b in zip(item_ids, first, second, strict=True) if flipped(a, b)]
    binary = kind == "binary"
    low, high = rate_interval(len(unstable), n)
    moved = None if candidate is None else [flipped(a, c) for a, c in zip(first, candidate, strict=True)]
    unstable_set = set(unstable)
    return NoiseFloor(
        n=n, flips=len(unstable),
        right_to_wrong=sum(1 for a, b in zip(first, second, strict=True) if a == 1 and b == 0) if binary else None,
        wrong_to_right=sum(1 for a, b in zip(first, second, strict=True) if a == 0 and b == 1) if binary else None,
        rate=len(unstable) / n, rate_low=low, rate_high=high, interval_confidence=INTERVAL_CONFIDENCE,
        floor=round(scale * len(unstable) / n, 6) if binary and in_points else None,
        unstable_items=unstable,
        reference="first pass" if kind == "corpus" else "mean of both passes",
        candidate_flips=None if moved is None else sum(moved),
        candidate_flips_on_unstable=None if moved is None else sum(1 for item, m in zip(item_ids, moved, strict=True) if m and item in unstable_set),
    )


def floor_refusal(
    floor: NoiseFloor, tolerance: float | None, *, eval_set: str, unit: str, policy: Policy, policy_path: Path | None,
    recipe: str | RecipeIdentity | None, rule: str,
) -> InputError | None:
    """The one-line refusal of a tolerance (in the set's unit) smaller than the measured floor; None when it is not."""
    if floor.floor is None or tolerance is None or tolerance >= floor.floor:
        return None
    return InputError(
        f"eval set {eval_set}: tolerance {tolerance:g} {unit} is smaller than the runtime's own noise floor "
        f"{floor.floor:.2f} {unit} ({floor.flips} of {floor.n} items changed between two scorings of the 16-bit baseline): "
        f"a gate cannot resolve a drop smaller than the runtime's noise; raise it to at least {floor.floor:.2f}",
        file=policy_path, field=policy.rule_source(recipe, eval_set, rule),
    )

