"""The gate: a paired comparison of candidate and baseline on every eval set, judged by the policy.

Input: one SetComparison per eval set (per-item scores of both models, paired by item id) and the
planner's FitCheck. Output: a GateResult with a SetVerdict per set and the overall verdict. Scores are
metrics in [0, 1]; everything reported is in points (x100). The report's schema and its reading and writing
are pipelines.gate.schema's; the file format is in docs/gate-json.md.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
from pydantic import ConfigDict, Field, model_validator
from scipy.stats import norm

from pipelines.errors import InputError
from pipelines.evaluation.metrics import MetricSpec, corpus_aggregation, value_range
from pipelines.gate import betting, concentrated, exact, identical, noise, stats
from pipelines.gate.policy import Policy, SetPolicy, damage_share_applies, relative_rule_in_force
from pipelines.gate.schema import FitCheck, GateResult, IntervalMethod, SetVerdict, StatsSettings
from pipelines.planner.gpus import GiB
from pipelines.recipe import RecipeIdentity
from pipelines.schema import StrictModel

# Float slack for threshold comparisons: a value exactly at a limit passes.
_EPS = 1e-9
# The whole run's false-rejection probability of an unchanged candidate above which the report warns.
WHOLE_RUN_WARNING = 0.10


ItemValue = float | list[Any]


class PairedItem(StrictModel):
    """One item scored by both models. `kl`: the item's mean per-token KL(baseline || candidate), nats.

    Values are the metric's per-item values as lm-eval logs them: a number for averaged metrics, a
    list (for example [gold, prediction] or [loglikelihood, words]) for corpus-level ones. They may be
    non-finite (a loglikelihood of -inf, a NaN score): SetComparison refuses them in the baseline and the
    gate rejects a candidate with them (judge_set), naming the items.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=True)

    item_id: str
    baseline: ItemValue
    candidate: ItemValue
    kl: float | None = Field(default=None, ge=0)
    # The baseline's second scoring (policy noise_floor: pipelines.gate.noise); None when it was scored once.
    baseline_repeat: ItemValue | None = None


class SetComparison(StrictModel):
    eval_set: str
    metric: MetricSpec
    items: list[PairedItem] = Field(min_length=1)
    kl_method: str | None = Field(default=None, description="how per-item KL was measured")

    @model_validator(mode="after")
    def _consistent(self) -> SetComparison:
        ids = [item.item_id for item in self.items]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"item {duplicate!r} appears more than once in {self.eval_set!r}")
        for item in self.items:
            _check_value(self.metric, item)
        if len({item.baseline_repeat is None for item in self.items}) > 1:
            raise ValueError(f"the baseline's second scoring of {self.eval_set!r} holds some items, not all")
        if self.kl_method is None and any(item.kl is not None for item in self.items):
            raise ValueError("items carry KL values but kl_method is not given")
        return self


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def non_finite(value: ItemValue) -> bool:
    """A NaN or an infinity: the value itself, or any number in its list (a loglikelihood of -inf in [ll, words])."""
    numbers = value if isinstance(value, list) else [value]
    return any(isinstance(number, float) and not math.isfinite(number) for number in numbers)


def _check_value(metric: MetricSpec, item: PairedItem) -> None:
    """The baseline's value must be finite; a candidate's non-finite value is the gate's to reject (judge_set)."""
    for baseline in (item.baseline, item.baseline_repeat):
        if baseline is not None and non_finite(baseline):
            raise ValueError(f"the baseline's {metric.name} is not finite on item {item.item_id!r} ({baseline!r})")
    values = tuple(value for value in (item.baseline, item.candidate, item.baseline_repeat) if value is not None and not non_finite(value))
    if metric.kind == "corpus":
        # lm-eval logs [gold, pred] or [loglikelihood, count] pairs, but a bare loglikelihood for `perplexity`.
        if not all(isinstance(value, list) or _finite(value) for value in values):
            raise ValueError(f"corpus metric {metric.name!r} but item {item.item_id!r} is neither a list nor a number")
        return
    if not all(_finite(value) for value in values):
        raise ValueError(f"metric {metric.name!r} needs a finite number per item; item {item.item_id!r} has {values}")
    if metric.kind == "binary" and set(values) - {0.0, 1.0}:
        raise ValueError(f"binary metric but item {item.item_id!r} scores {values}")
    if metric.bounded_unit_interval and not all(0.0 <= value <= 1.0 for value in values):  # type: ignore[operator]
        raise ValueError(f"metric {metric.name!r} lies in [0, 1] but item {item.item_id!r} scores {values}")


# The interval method each kind of metric gets (IntervalMethod also names those older gate.json files record).
INTERVAL_METHODS: dict[str, IntervalMethod] = {
    "binary": "tango-score-calibrated", "continuous": "betting", "corpus": "percentile-bootstrap-clipped-betting",
}


def decide(comparisons: list[SetComparison], policy: Policy, recipe: str | RecipeIdentity, fit: FitCheck | None = None) -> GateResult:
    """Judge every eval set by its rules (policy.for_set) and the fit; promoted only if nothing fails."""
    if not comparisons:
        raise InputError("nothing to gate: no eval set was scored", field="eval_sets")
    names = [comparison.eval_set for comparison in comparisons]
    if len(set(names)) != len(names):
        raise InputError(f"eval set scored twice: {sorted({n for n in names if names.count(n) > 1})}", field="eval_sets")
    for comparison in comparisons:
        rules = policy.for_set(recipe, comparison.eval_set)
        if not comparison.metric.in_points and not relative_rule_in_force(rules):
            raise InputError(
                f"eval set {comparison.eval_set}: metric {comparison.metric.name} is in its own unit, not points, and the "
                f"policy gives it no relative tolerance: set rel_margin or max_rel_drop",
                field=policy.rule_source(recipe, comparison.eval_set, "rel_margin"),
            )
    sets = [judge_set(comparison, policy.for_set(recipe, comparison.eval_set)) for comparison in comparisons]
    reasons = [reason for verdict in sets for reason in verdict.reasons] + _fit_reasons(fit)
    warnings = [warning for verdict in sets for warning in verdict.warnings]
    warnings += [
        f"policy: eval_sets override {name!r} matches no scored eval set" for name in policy.eval_sets if name not in names
    ]
    whole_run = stats.any_rejects([v.unchanged_reject_probability for v in sets if v.unchanged_reject_probability is not None])
    if whole_run > WHOLE_RUN_WARNING:
        warnings.append(
            f"whole run: an unchanged candidate with these sets' observed discordance would be rejected by at least one of "
            f"the {len(sets)} sets {whole_run:.0%} of the time (> {WHOLE_RUN_WARNING:.0%}): "
            + ", ".join(f"{v.eval_set} {v.unchanged_reject_probability:.1%}" for v in sets if v.unchanged_reject_probability is not None)
        )
    return GateResult(
        recipe=RecipeIdentity.of(recipe).name,
        verdict="rejected" if reasons else "promoted",
        sets=sets,
        fit=fit,
        reasons=reasons,
        warnings=warnings,
        settings=StatsSettings(),
        unchanged_reject_probability=round(whole_run, 6),
    )


_SHOWN_ITEMS = 5


def judge_set(comparison: SetComparison, rules: SetPolicy) -> SetVerdict:
    """Measure one set and apply its rules. Items where the candidate's value is not finite reject the set, named, and
    the figures are those of the other items; when no item is left, the baseline's against itself (gate.json holds finite
    figures only), and the set is rejected all the same: a model that gives no finite value fails, it is not an error."""
    broken = [item.item_id for item in comparison.items if non_finite(item.candidate)]
    measurable = [item for item in comparison.items if not non_finite(item.candidate)]
    broken_reasons = _broken_reasons(comparison, broken, measured=len(measurable))
    if broken:
        comparison = comparison.model_copy(update={"items": measurable or _baseline_against_itself(comparison.items)})
    measured = _measure(comparison, rules)
    reasons = broken_reasons + (_reasons(comparison.eval_set, measured, rules) if measurable else [])
    return SetVerdict(
        **{key: value for key, value in measured.items() if not key.startswith("_")},
        rules=rules,
        warnings=_warnings(comparison.eval_set, measured, rules, passed=not reasons),
        reasons=reasons,
        passed=not reasons,
    )


def _broken_reasons(comparison: SetComparison, broken: list[str], measured: int) -> list[str]:
    if not broken:
        return []
    shown = ", ".join(broken[:_SHOWN_ITEMS]) + (f", ... ({len(broken)} in all)" if len(broken) > _SHOWN_ITEMS else "")
    figures = "the figures are the other items'" if measured else "no item is left to measure: the figures are the baseline's against itself"
    return [
        f"{comparison.eval_set}: the candidate's {comparison.metric.name} is not finite (NaN or infinite) on "
        f"{len(broken)} of {len(broken) + measured} items: {shown} ({figures})"
    ]


def _baseline_against_itself(items: list[PairedItem]) -> list[PairedItem]:
    return [item.model_copy(update={"candidate": item.baseline, "kl": None}) for item in items]


def _nats(value: float) -> str:
    return f"{value:.4f}" if value >= 1e-3 else f"{value:.2e}"


def _scaled(value: float, scale: float) -> float:
    """Metric units to report units, rounded to 1e-6 so that 7 of 100 reads 7.0, not 7.000000000000001."""
    return round(scale * float(value), 6)


def _scaled_up(value: float, scale: float) -> float:
    """An upper bound in report units, rounded up at 1e-6 (floating-point noise below 1e-9 aside): the rules read it, and a
    bound rounded down could pass a table the calibrated test rejects (n = 349, 12 losses: 5.5000004 read as 5.5)."""
    scaled = scale * float(value)
    return math.ceil(round(scaled * 1e6, 3)) / 1e6 if math.isfinite(scaled) else scaled


def _report_units(key: str, value: float, scale: float) -> float:
    return _scaled_up(value, scale) if key == "worsening_bound" else _scaled(value, scale)


_SCALED = ("baseline_score", "candidate_score", "ci_low", "ci_high", "min_detectable_drop", "worsening_bound")


def _measure(comparison: SetComparison, rules: SetPolicy) -> dict[str, Any]:
    spec = comparison.metric
    n = len(comparison.items)
    repeated = comparison.items[0].baseline_repeat is not None
    if spec.kind == "corpus":
        measured = _measure_corpus(comparison, rules)
    else:
        base = np.array([item.baseline for item in comparison.items], dtype=float)
        cand = np.array([item.candidate for item in comparison.items], dtype=float)
        again = np.array([item.baseline_repeat for item in comparison.items], dtype=float) if repeated else None
        measured = (_measure_binary(spec, base, cand, rules, again) if spec.kind == "binary"
                    else _measure_continuous(spec, base if again is None else (base + again) / 2.0, cand, rules))
    if repeated:
        measured["noise_floor"] = noise.measure_floor(
            [item.item_id for item in comparison.items], [item.baseline for item in comparison.items],
            [item.baseline_repeat for item in comparison.items], kind=spec.kind, scale=spec.scale, in_points=spec.in_points,
            candidate=[item.candidate for item in comparison.items],
        )
    scaled = {key: _report_units(key, measured[key], spec.scale) for key in _SCALED}
    delta = _scaled(measured["candidate_score"] - measured["baseline_score"], spec.scale)
    kl = stats.kl_summary([item.kl for item in comparison.items])
    result = measured | scaled | {
        "eval_set": comparison.eval_set,
        "metric": spec.name,
        "higher_is_better": spec.higher_is_better,
        "aggregation": spec.aggregation,
        "kind": spec.kind,
        "unit": spec.unit,
        "binary": spec.kind == "binary",
        "n": n,
        "delta": delta,
        "worsening": -delta if spec.higher_is_better else delta,
        "interval_method": INTERVAL_METHODS[spec.kind],
        "kl_mean": kl.mean if kl else None,
        "kl_max": kl.max if kl else None,
        "kl_items": kl.items if kl else 0,
        "kl_method": comparison.kl_method,
        "bound_confidence": rules.confidence,
        "_in_points": spec.in_points,
    }
    base_score = result["baseline_score"]
    result["relative_worsening_bound"] = round(result["worsening_bound"] / abs(base_score), 6) if base_score != 0 else None
    return result | _sizing(spec, result, rules)


# --- what the tolerance rules allow, and what the set can certify ----------------------------------------------

def tolerances(in_points: bool, rules: SetPolicy, baseline_score: float) -> dict[str, float]:
    """The tolerances in force for a set, in its unit, by rule: ni_margin (metrics in points), rel_margin x |baseline|
    (metrics in their own unit), max_rel_drop x |baseline| (any); relative ones only at a nonzero baseline."""
    found = {}
    if rules.non_inferiority and in_points:
        found["ni_margin"] = rules.ni_margin
    if baseline_score != 0:
        if rules.non_inferiority and not in_points and rules.rel_margin is not None:
            found["rel_margin"] = rules.rel_margin * abs(baseline_score)
        if rules.max_rel_drop is not None:
            found["max_rel_drop"] = rules.max_rel_drop * abs(baseline_score)
    return found


def tolerance(in_points: bool, rules: SetPolicy, baseline_score: float) -> float | None:
    """The tightest tolerance in force for a set, in its unit (tolerances)."""
    found = tolerances(in_points, rules, baseline_score)
    return min(found.values()) if found else None


def _fraction(allowed: float | None, unit_range: float) -> float | None:
    """A tolerance in unit as a fraction of one item's reach; None when there is none (or it is not positive)."""
    return None if allowed is None or allowed <= 0 or unit_range <= 0 else allowed / unit_range


def _sizing(spec: MetricSpec, m: dict[str, Any], rules: SetPolicy) -> dict[str, Any]:
    """tolerance, min_certifiable_tolerance, items_needed, unchanged_reject_probability (docs/gate-json.md, "Sizing")."""
    allowed = tolerance(spec.in_points, rules, m["baseline_score"])
    scale, n = spec.scale, m["n"]
    unit_range = scale * (1.0 if spec.kind == "binary" else m["_value_range"])  # one item's reach, in unit
    if spec.kind == "binary":
        psi = m["_discordance"]
        # Nam's planning figure, never below what the calibrated test gives an identical candidate
        certifiable = max(stats.certifiable_tolerance(n, psi, confidence=rules.confidence),
                          identical.identical_bound("binary", n, _fraction(allowed, scale), rules.confidence))
        needed = None
        if allowed is not None and allowed > 0:
            needed = 1 if allowed >= scale else max(
                stats.items_needed(allowed / scale, psi, confidence=rules.confidence),
                identical.identical_items_needed("binary", allowed / scale, rules.confidence) or 1,
            )
        rejected = binary_unchanged_reject_probability(rules, spec.higher_is_better, n, m["_baseline_right"], psi)
    else:
        se, value_range = m["_se"], m["_value_range"]

        def reach(items: int) -> float:
            return stats.normal_certifiable_tolerance(  # the zero-count floor stands in for each kind's own (a planning figure)
                se * math.sqrt(n / items), value_range * stats.zero_count_bound(items, confidence=rules.confidence), confidence=rules.confidence,
            )

        certifiable = reach(n)
        needed = None if allowed is None or allowed <= 0 else stats.smallest_n(lambda items: reach(items) <= allowed / scale)
        rejected = _normal_unchanged_reject_probability(spec, rules, m, allowed)
    return {
        "tolerance": None if allowed is None else round(allowed, 6),
        "min_certifiable_tolerance": _scaled(certifiable, scale),
        "items_needed": needed,
        "unchanged_reject_probability": round(rejected, 6),
        "_identical_bound": unit_range * identical.identical_bound(spec.kind, n, _fraction(allowed, unit_range), rules.confidence),
        "_unit_range": unit_range,
    }


def _normal_unchanged_reject_probability(spec: MetricSpec, rules: SetPolicy, m: dict[str, Any], allowed: float | None) -> float:
    """Averaged and corpus metrics: the estimate of an unchanged candidate taken as N(0, se) (se measured), rejected when
    it exceeds max_abs_drop (points) or the tolerance less the bound's reach max(z(c) se, floor)."""
    se, scale = m["_se"], spec.scale
    limits = []
    if allowed is not None:
        floor = m["_value_range"] * stats.zero_count_bound(m["n"], confidence=rules.confidence)
        limits.append(allowed / scale - max(stats.z_one_sided(rules.confidence) * se, floor))
    if rules.max_abs_drop is not None and spec.in_points:
        limits.append(rules.max_abs_drop / scale)
    if not limits:
        return 0.0
    limit = min(limits)
    if se == 0:
        return 1.0 if limit < 0 else 0.0
    return float(norm.sf(limit / se))


def binary_unchanged_reject_probability(rules: SetPolicy, higher_is_better: bool, n: int, right: int, discordance: float) -> float:
    """Exact over the binomial 2x2 tables (stats.table_probability) of an unchanged candidate at this discordance,
    judged by this module's own rules (KL not counted). Bad flips are right->wrong when higher is better."""
    p_lose, p_gain = stats.unchanged_flip_probabilities(discordance, right, n)
    if higher_is_better:
        return stats.table_probability(lambda lost, gained: table_rejects(rules, True, n, right, lost, gained), n, right, p_lose, p_gain)
    # lower is better: wrong->right flips (0 -> 1) are the bad ones, drawn among the baseline's 0 items
    return stats.table_probability(lambda bad, good: table_rejects(rules, False, n, right, good, bad), n, n - right, p_gain, p_lose)


@lru_cache(maxsize=200_000)
def table_rejects(
    rules: SetPolicy, higher_is_better: bool, n: int, right: float, lost: int, gained: int, charged: tuple[float, float] | None = None,
) -> bool:
    """Whether a set of n pass/fail items (baseline right on `right`) with these flips fails its rules, KL aside.
    `charged`: the half counts against the mean of two baseline passes, `right` then the mean count (_binary_table)."""
    measured = _binary_table(n, right, lost, gained, rules, higher_is_better, full=False, charged=charged)
    scaled = {key: _report_units(key, measured[key], 100.0) if key in _SCALED else value for key, value in measured.items()}
    delta = _scaled(measured["candidate_score"] - measured["baseline_score"], 100.0)
    scaled |= {"unit": "points", "higher_is_better": higher_is_better, "worsening": -delta if higher_is_better else delta,
               "kl_mean": None, "n": n, "_in_points": True}
    base = scaled["baseline_score"]
    scaled["relative_worsening_bound"] = scaled["worsening_bound"] / abs(base) if base != 0 else None
    return bool(_reasons("simulated", scaled, rules))


_NO_FLIPS = {"mcnemar_p": None, "flips_right_to_wrong": None, "flips_wrong_to_right": None, "flip_rate": None, "flip_rate_lower_bound": None}


def binary_critical_value(rules: SetPolicy, n: int, right: float) -> float | None:
    """The critical value of a pass/fail set's bound: calibrated (pipelines.gate.exact) at the tightest tolerance in force,
    so that a true worsening of exactly that tolerance passes at most 1 - c of the time; None (Tango's z(c)) when no
    tolerance applies."""
    allowed = tolerance(True, rules, 100.0 * right / n)
    if allowed is None or not 0.0 < allowed < 100.0:
        return None
    return exact.critical_value(n, allowed / 100.0, rules.confidence)


def _binary_table(
    n: int, right: float, lost: int, gained: int, rules: SetPolicy, higher_is_better: bool, *, full: bool = True,
    charged: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """A pass/fail set's figures from its 2x2 table alone, in metric units (fractions). `full`: also the 95% interval,
    McNemar and the sizing inputs (what the rules do not read). `charged`: the losses and gains the bound reads when they
    are not the table's (against the mean of two baseline passes, in halves: pipelines.gate.noise); `right` is then the
    baseline's mean count. The flips (and max_flip_rate) are the table's, against the first pass."""
    # Bound of the worsening: -(lower bound of delta) when higher is better; the upper bound of delta (the lower
    # bound of -delta, losses and gains swapped) when lower is better. Its critical value is calibrated per n.
    confidence, z = rules.confidence, binary_critical_value(rules, n, right)
    losses, gains = charged if charged is not None else (lost, gained)
    bound = -(stats.tango_lower_bound(losses, gains, n, z=z, confidence=confidence) if higher_is_better
              else stats.tango_lower_bound(gains, losses, n, z=z, confidence=confidence))
    measured: dict[str, Any] = {
        "baseline_score": right / n,
        "candidate_score": (right - losses + gains) / n,
        "worsening_bound": bound,
        "flips_right_to_wrong": lost,
        "flips_wrong_to_right": gained,
        "flip_rate": lost / n,
        "flip_rate_lower_bound": stats.exact_lower_bound(lost, n, confidence=confidence),
    }
    if full:
        low, high = stats.tango_interval(losses, gains, n)
        measured |= {
            "ci_low": low,
            "ci_high": high,
            "mcnemar_p": stats.mcnemar_exact_p(lost, gained),
            "min_detectable_drop": stats.min_detectable_drop_binary(n, (losses + gains) / n),
            "_discordance": (losses + gains) / n,
            "_baseline_right": round(right),
        }
    return measured


def _measure_binary(spec: MetricSpec, base: np.ndarray, cand: np.ndarray, rules: SetPolicy, again: np.ndarray | None = None) -> dict[str, Any]:
    """`again`: the baseline's second pass; the bound then reads the candidate against the mean of both (in halves)."""
    flipped = stats.flips(base, cand)
    if again is None:
        return _binary_table(flipped.n, int(base.sum()), flipped.right_to_wrong, flipped.wrong_to_right, rules, spec.higher_is_better)
    difference = cand - (base + again) / 2.0
    charged = (float(np.maximum(-difference, 0.0).sum()), float(np.maximum(difference, 0.0).sum()))
    return _binary_table(flipped.n, float((base + again).sum() / 2.0), flipped.right_to_wrong, flipped.wrong_to_right, rules,
                         spec.higher_is_better, charged=charged)


def _bad_side(spec: MetricSpec, low: float, high: float) -> float:
    """The bound of an interval of delta on the bad side, as a worsening (positive = worse)."""
    return -low if spec.higher_is_better else high


def _measure_continuous(spec: MetricSpec, base: np.ndarray, cand: np.ndarray, rules: SetPolicy) -> dict[str, Any]:
    spread = value_range(spec, (float(np.ptp(np.concatenate([base, cand]))),))
    _, low, high = stats.mean_difference_interval(base, cand, value_range=spread)
    bound_low, bound_high = betting.mean_bounds(cand - base, spread, rules.confidence)
    sd = float(np.std(cand - base, ddof=1)) if base.size > 1 else 0.0
    return _NO_FLIPS | {
        "baseline_score": base.mean(),
        "candidate_score": cand.mean(),
        "ci_low": low,
        "ci_high": high,
        "worsening_bound": _bad_side(spec, bound_low, bound_high),
        "min_detectable_drop": stats.min_detectable_drop_continuous(base.size, sd),
        "_se": sd / math.sqrt(base.size),
        "_value_range": spread,
    }


def _measure_corpus(comparison: SetComparison, rules: SetPolicy) -> dict[str, Any]:
    spec = comparison.metric
    aggregate = corpus_aggregation(spec.aggregation)
    base_values = [item.baseline for item in comparison.items]
    cand_values = [item.candidate for item in comparison.items]
    base_score, cand_score, diffs = stats.corpus_bootstrap(aggregate, base_values, cand_values)
    spread = value_range(spec, (base_score, cand_score))
    n, estimate = len(base_values), cand_score - base_score
    effects = stats.deletion_effects(aggregate, base_values, cand_values)
    low, high = stats.percentile_interval(diffs, estimate, n, value_range=spread, effects=effects)
    bound_low, bound_high = stats.percentile_interval(
        diffs, estimate, n, value_range=spread, confidence=stats.two_sided_level(rules.confidence), effects=effects,
    )
    return _NO_FLIPS | _concentrated(comparison, rules, base_score) | {
        "baseline_score": base_score,
        "candidate_score": cand_score,
        "ci_low": low,
        "ci_high": high,
        "worsening_bound": _bad_side(spec, bound_low, bound_high),
        "min_detectable_drop": stats.min_detectable_drop_from_interval((high - low) / 2.0),
        "_se": float(np.std(diffs, ddof=1)) if diffs.size > 1 else 0.0,
        "_value_range": spread,
    }


def _concentrated(comparison: SetComparison, rules: SetPolicy, base_score: float) -> dict[str, Any]:
    """concentrated_bound and concentrated_clip (shares of the tolerance: pipelines.gate.concentrated), or nothing when no
    tolerance applies."""
    spec = comparison.metric
    allowed = tolerance(spec.in_points, rules, spec.scale * base_score)
    if not damage_share_applies(spec, rules) or allowed is None or allowed <= 0:
        return {}
    found = concentrated.contributions(
        spec.aggregation, [item.baseline for item in comparison.items], [item.candidate for item in comparison.items],
        higher_is_better=spec.higher_is_better, allowed=allowed / spec.scale, baseline_score=base_score,
    )
    clipped = concentrated.clipped_bound(found, rules.damage_share, rules.confidence)
    return {"concentrated_bound": round(clipped.bound, 6), "concentrated_clip": round(clipped.clip, 6)}


def _reasons(name: str, m: dict[str, Any], rules: SetPolicy) -> list[str]:
    """One line per failed rule, naming the set, the rule and both numbers."""
    reasons = []
    unit, worse, word = m["unit"], m["worsening"], _worse_word(m)
    in_points = m["_in_points"]
    sure = f"{rules.confidence:.0%} one-sided bound"
    if in_points and rules.max_abs_drop is not None and worse > rules.max_abs_drop + _EPS:
        reasons.append(f"{name}: {word} {worse:.2f} {unit} > max_abs_drop {rules.max_abs_drop}")
    bound, relative = m["worsening_bound"], m["relative_worsening_bound"]
    if rules.non_inferiority and in_points and bound > rules.ni_margin + _EPS:
        reasons.append(
            f"{name}: the {word} may be as large as {bound:.2f} {unit} ({sure}) > ni_margin {rules.ni_margin} (non-inferiority not shown)"
        )
    if rules.non_inferiority and not in_points and rules.rel_margin is not None and relative is not None and relative > rules.rel_margin + _EPS:
        reasons.append(
            f"{name}: the {word} may be as large as {relative:.3f} of the baseline {m['baseline_score']:.4g} ({bound:.4g} {unit}, "
            f"{sure}) > rel_margin {rules.rel_margin} (non-inferiority not shown)"
        )
    if rules.max_rel_drop is not None and relative is not None and relative > rules.max_rel_drop + _EPS:
        reasons.append(
            f"{name}: relative {word} up to {relative:.3f} of baseline {m['baseline_score']:.2f} ({sure}) > max_rel_drop {rules.max_rel_drop}"
        )
    if rules.max_flip_rate is not None and m["flip_rate_lower_bound"] is not None and m["flip_rate_lower_bound"] > rules.max_flip_rate + _EPS:
        reasons.append(
            f"{name}: flip rate {m['flip_rate']:.3f} ({m['flips_right_to_wrong']}/{m['n']} right->wrong), "
            f"{rules.confidence:.0%} lower bound {m['flip_rate_lower_bound']:.3f} > max_flip_rate {rules.max_flip_rate}"
        )
    if m.get("concentrated_bound") is not None and m["concentrated_bound"] > concentrated.LIMIT + _EPS:
        reasons.append(
            f"{name}: a worsening concentrated in {rules.damage_share:.0%} of items is not ruled out: with each item's contribution "
            f"clipped at {m['concentrated_clip']:g}x the tolerance, the mean worsening may be {m['concentrated_bound']:.3f} of the "
            f"tolerance ({sure}) > {concentrated.LIMIT} (damage_share {rules.damage_share:g})"
        )
    if rules.max_kl_action == "reject" and _kl_over(m, rules):
        reasons.append(f"{name}: mean KL {_nats(m['kl_mean'])} nats/token > max_kl {rules.max_kl} (max_kl_action: reject)")
    return reasons


def _kl_over(m: dict[str, Any], rules: SetPolicy) -> bool:
    return rules.max_kl is not None and m["kl_mean"] is not None and m["kl_mean"] > rules.max_kl + _EPS


def _worse_word(m: dict[str, Any]) -> str:
    return "drop" if m["higher_is_better"] else "rise"


def _warnings(name: str, m: dict[str, Any], rules: SetPolicy, *, passed: bool) -> list[str]:
    """What does not reject but qualifies the verdict: too few items, a set too small for its tolerance, a weak or
    significant pass, KL over max_kl (a warning by default) or unchecked."""
    warnings = []
    n, unit, word = m["n"], m["unit"], _worse_word(m)
    if n < rules.min_items:
        warnings.append(f"{name}: {n} items < min_items {rules.min_items}")
    allowed, sure = m["tolerance"], f"{rules.confidence:.0%} confidence"
    if allowed is not None:
        floor, scale_range = m["_identical_bound"], m["_unit_range"]
        if floor > allowed + _EPS:
            needs = "no number of items can"
            minimum = identical.identical_items_needed(m["kind"], allowed / scale_range, rules.confidence) if allowed > 0 else None
            if minimum is not None:
                needs = f"it needs at least {minimum} items"
            warnings.append(
                f"{name}: {n} items cannot show a {word} under {allowed:.4g} {unit} at {sure} even against an identical model "
                f"(its bound is at least {floor:.4g} {unit}); {needs}"
            )
        elif not passed and m["worsening"] <= allowed + _EPS < m["worsening_bound"] and m["min_certifiable_tolerance"] > allowed:
            discordance = f"discordance {m['flips_right_to_wrong'] + m['flips_wrong_to_right']}/{n}, " if m["binary"] else ""
            needed = f"about {m['items_needed']:,} items" if m["items_needed"] is not None else "far more items"
            warnings.append(
                f"{name}: too few items for a tolerance of {allowed:.4g} {unit}: at its observed noise ({discordance}an unchanged "
                f"candidate passing {stats.POWER:.0%} of the time) {n} items certify {m['min_certifiable_tolerance']:.2f} {unit} "
                f"at best; {allowed:.4g} {unit} needs {needed}"
            )
    if passed and not rules.non_inferiority and rules.max_abs_drop is not None and m["min_detectable_drop"] > rules.max_abs_drop:
        warnings.append(
            f"{name}: too small to decide: {n} items reliably detect only changes of {m['min_detectable_drop']:.1f} {unit} "
            f"or more (alpha {stats.ALPHA}, power {stats.POWER}), above max_abs_drop {rules.max_abs_drop}"
        )
    if passed and m["mcnemar_p"] is not None and m["worsening"] > 0 and m["mcnemar_p"] < stats.ALPHA:
        warnings.append(
            f"{name}: the drop of {m['worsening']:.2f} {unit} is within the policy but statistically significant "
            f"(McNemar p={m['mcnemar_p']:.3g})"
        )
    if rules.max_kl is not None and m["kl_items"] == 0:
        warnings.append(f"{name}: KL not measured; max_kl {rules.max_kl} not checked")
    elif 0 < m["kl_items"] < n:
        warnings.append(f"{name}: KL measured on {m['kl_items']} of {n} items")
    if rules.max_kl_action == "warn" and _kl_over(m, rules):
        warnings.append(
            f"{name}: mean KL {_nats(m['kl_mean'])} nats/token > max_kl {rules.max_kl}: a warning, not a rejection (the KL is a "
            f"top-k lower bound of the full KL and max_kl has no stated error rate; max_kl_action: reject makes it one)"
        )
    if rules.max_flip_rate is not None and not m["binary"]:
        warnings.append(f"{name}: metric {m['metric']!r} is not pass/fail; max_flip_rate not checked")
    return warnings


def _fit_reasons(fit: FitCheck | None) -> list[str]:
    if fit is None or fit.fits:
        return []
    return [
        f"fit: needs {fit.required_bytes / GiB:.1f} GiB > {fit.available_bytes / GiB:.1f} GiB available on {fit.gpu}"
    ]
