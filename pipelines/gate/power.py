"""The eval sets' power against the gate policy, before any model is served (`quantize eval-sets power`, docs/gate-json.md
"Sizing"): per set, the tolerance its size can certify, the items the policy's tolerance needs, the exact chance of
promoting a candidate worse by the tolerance, and over the whole run the chance an unchanged candidate is rejected."""

from __future__ import annotations

from pipelines.evaluation.evalsets import EvalSet
from pipelines.gate import exact, identical, stats
from pipelines.gate.policy import Policy, SetPolicy, damage_share_applies, documents_for_damage_share, unattainable
from pipelines.gate.verdict import table_rejects
from pipelines.recipe import RecipeIdentity

GUARANTEES = {
    "binary": "P(promote | true worsening = tolerance) <= 1 - confidence, exact, for every split of the discordance into losses "
              "and gains, under the multinomial model (items drawn independently; Tango's test at a critical value calibrated "
              "per n); promote_at_tolerance gives the exact figure per discordance",
    "continuous": "P(promote | true worsening = tolerance) <= 1 - confidence for any distribution of the per-item changes "
                  "(skewed, heavy-tailed, a few items broken outright), items drawn independently (betting bound)",
    "corpus": "P(promote | true worsening = tolerance) about 1 - confidence (paired bootstrap with a rare-damage allowance; "
              "simulated, not exact), items drawn independently; damage confined to fewer documents than damage_share "
              "is outside it for perplexities and bits_per_byte",
}



def power_rows(eval_sets: list[EvalSet], policy: Policy, recipe: str | RecipeIdentity | None, discordances: list[float],
               baseline_score: float = 0.8) -> list[dict]:
    """Per set, under its rules: the tolerance, the identical-model minimum, the guarantee with its sampling model, and for
    each discordance psi the smallest tolerance its n certifies (an unchanged candidate passing 80% of the time), the items
    the tolerance needs (Nam 1997 with Tango's score test: pipelines.gate.stats.items_needed, at least the identical
    minimum), and promote_at_tolerance: the exact P(promote) of a candidate whose true worsening is the tolerance, worst
    over every split of a discordance up to max(psi, tolerance) into losses and gains (losses only included), summed over
    the multinomial tables judged by the gate's own decision function (table_rejects). Pass/fail sets only have the
    per-discordance figures; other metrics' noise is known once scored (each run's report gives them)."""

    rows = []
    for eval_set in eval_sets:
        rules = policy.for_set(recipe, eval_set.name)
        spec, n = eval_set.metric, eval_set.num_items
        refused = unattainable(policy, recipe, eval_set)
        row: dict = {
            "name": eval_set.name, "metric": spec.name, "kind": spec.kind, "unit": spec.unit, "items": n, "confidence": rules.confidence,
            "tolerance": (rules.ni_margin if rules.non_inferiority else None) if spec.in_points else rules.rel_margin,
            "tolerance_kind": "points" if spec.in_points else "relative",
            "refused": None if refused is None else f"{refused[1]}: {refused[0]}",
            "identical_items_needed": None, "guarantee": GUARANTEES[spec.kind], "by_discordance": [],
        }
        fraction = row["tolerance"] / spec.scale if spec.in_points and row["tolerance"] is not None else (
            row["tolerance"] if spec.relative_scale and spec.kind == "corpus" else None)
        if fraction is not None:
            row["identical_items_needed"] = identical.identical_items_needed(spec.kind, min(fraction, 1.0), rules.confidence)
        if damage_share_applies(spec, rules):  # a corpus set: its damage_share asks for items too (gate.concentrated)
            row["identical_items_needed"] = max(row["identical_items_needed"] or 0, documents_for_damage_share(rules))
        if spec.kind == "binary":
            right = round(baseline_score * n)
            floor = identical.identical_bound("binary", n, fraction, rules.confidence)
            for psi in discordances:
                certifies = spec.scale * max(stats.certifiable_tolerance(n, psi, confidence=rules.confidence), floor)
                needed = None if fraction is None else (1 if fraction >= 1 else max(
                    stats.items_needed(fraction, psi, confidence=rules.confidence), row["identical_items_needed"] or 1))
                row["by_discordance"].append({
                    "discordance": psi, "certifies": round(certifies, 4), "items_needed": needed,
                    **_promote_at_tolerance(rules, spec.higher_is_better, n, right, fraction, psi),
                })
        rows.append(row)
    return rows


def _promote_at_tolerance(rules: SetPolicy, higher_is_better: bool, n: int, right: int, fraction: float | None, psi: float) -> dict:
    """promote_at_tolerance and the split reaching it (p_lose, p_gain), or nulls when no tolerance in (0, 1) applies."""
    if fraction is None or not 0.0 < fraction < 1.0:
        return {"promote_at_tolerance": None, "worst_split": None}

    def promotes(lost: int, gained: int) -> bool:
        return not table_rejects(rules, higher_is_better, n, right, lost, gained)

    rate, p_gain = exact.promote_at_tolerance(promotes, n, fraction, max_discordance=psi)
    return {"promote_at_tolerance": round(rate, 6), "worst_split": {"p_lose": round(p_gain + fraction, 6), "p_gain": round(p_gain, 6)}}


def whole_run_rows(
    eval_sets: list[EvalSet], policy: Policy, recipe: str | RecipeIdentity | None, discordances: list[float], baseline_score: float,
) -> list[dict]:
    """P(at least one pass/fail set rejects an unchanged candidate) per discordance, each set at `baseline_score`."""

    binary = [s for s in eval_sets if s.metric.kind == "binary"]
    rows = []
    for psi in discordances:
        probabilities = []
        for eval_set in binary:
            rules, n = policy.for_set(recipe, eval_set.name), eval_set.num_items
            right = round(baseline_score * n)
            p_lose, p_gain = stats.unchanged_flip_probabilities(psi, right, n)
            higher = eval_set.metric.higher_is_better

            def rejects(lost: int, gained: int, rules=rules, n=n, right=right, higher=higher) -> bool:
                return table_rejects(rules, higher, n, right, lost, gained)

            probabilities.append(stats.table_probability(rejects, n, right, p_lose, p_gain))
        rows.append({"discordance": psi, "sets": len(binary), "reject_probability": round(stats.any_rejects(probabilities), 6)})
    return rows
