"""A tolerance held against the runtime's measured noise floor, before a candidate is scored (pipelines.gate.noise)."""

from __future__ import annotations

from pathlib import Path

from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import SetScore
from pipelines.gate.noise import floor_refusal, measure_floor
from pipelines.gate.pairing import pair_set
from pipelines.gate.policy import Policy
from pipelines.gate.schema import NoiseFloor
from pipelines.gate.verdict import tolerances
from pipelines.recipe import RecipeIdentity


def floor_from_scores(eval_set: EvalSet, first: SetScore, second: SetScore) -> NoiseFloor:
    """A set's A/A figures from its two baseline scorings, paired by item (before any candidate is scored)."""
    comparison = pair_set(eval_set, first, second, {}, None)
    spec = eval_set.metric
    return measure_floor(
        [item.item_id for item in comparison.items], [item.baseline for item in comparison.items],
        [item.candidate for item in comparison.items], kind=spec.kind, scale=spec.scale, in_points=spec.in_points,
    )


def refuse_below_floor(
    eval_set: EvalSet, first: SetScore, second: SetScore, policy: Policy, policy_path: Path | None, recipe: str | RecipeIdentity | None,
) -> NoiseFloor:
    """The set's floor; InputError (exit 2, one line naming the policy file and the tolerance's field) when the tightest
    tolerance in force is under it."""
    floor = floor_from_scores(eval_set, first, second)
    spec, rules = eval_set.metric, policy.for_set(recipe, eval_set.name)
    found = tolerances(spec.in_points, rules, spec.scale * first.score)
    if found:
        rule = min(found, key=lambda name: found[name])
        error = floor_refusal(floor, found[rule], eval_set=eval_set.name, unit=spec.unit, policy=policy, policy_path=policy_path,
                              recipe=recipe, rule=rule)
        if error is not None:
            raise error
    return floor
