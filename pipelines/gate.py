"""The gate: a paired comparison of candidate and baseline on every eval set, judged by the policy.

Input: one SetComparison per eval set (per-item scores of both models, paired by item id) and the
planner's FitCheck. Output: a GateResult with a SetVerdict per set and the overall verdict. Scores are
metrics in [0, 1]; everything reported is in points (x100). The file format is in docs/gate-json.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationError, model_validator

from pipelines import stats
from pipelines.artifact import read_json_object
from pipelines.atomic import write_text_atomic
from pipelines.errors import EXIT_OK, EXIT_REJECTED, InputError, from_validation_error
from pipelines.loadtest.results import PerformanceReport
from pipelines.metrics import MetricSpec, corpus_aggregation, value_range
from pipelines.planner.gpus import GiB
from pipelines.policy import Policy, SetPolicy
from pipelines.recipe import RecipeIdentity
from pipelines.schema import StrictModel

SCHEMA_VERSION: Literal[2] = 2
# Float slack for threshold comparisons: a value exactly at a limit passes.
_EPS = 1e-9
MAX_REPORT_BYTES = 64 * 1024 * 1024  # a gate.json is kilobytes (megabytes with thousands of sets)


ItemValue = float | list[Any]


class PairedItem(StrictModel):
    """One item scored by both models. `kl`: the item's mean per-token KL(baseline || candidate), nats.

    Values are the metric's per-item values as lm-eval logs them: a number for averaged metrics, a
    list (for example [gold, prediction] or [loglikelihood, words]) for corpus-level ones.
    """

    item_id: str
    baseline: ItemValue
    candidate: ItemValue
    kl: float | None = Field(default=None, ge=0)


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
        if self.kl_method is None and any(item.kl is not None for item in self.items):
            raise ValueError("items carry KL values but kl_method is not given")
        return self


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check_value(metric: MetricSpec, item: PairedItem) -> None:
    values = (item.baseline, item.candidate)
    if metric.kind == "corpus":
        # lm-eval logs [gold, pred] or [loglikelihood, count] pairs, but a bare loglikelihood for `perplexity`.
        if not all(isinstance(value, list) or _finite(value) for value in values):
            raise ValueError(f"corpus metric {metric.name!r} but item {item.item_id!r} is neither a list nor a number")
        return
    if not all(_finite(value) for value in values):
        raise ValueError(f"metric {metric.name!r} needs a finite number per item; item {item.item_id!r} has {values}")
    if metric.kind == "binary" and set(values) - {0.0, 1.0}:
        raise ValueError(f"binary metric but item {item.item_id!r} scores {item.baseline} / {item.candidate}")
    if metric.bounded_unit_interval and not all(0.0 <= value <= 1.0 for value in values):  # type: ignore[operator]
        raise ValueError(f"metric {metric.name!r} lies in [0, 1] but item {item.item_id!r} scores {values}")


class FitCheck(StrictModel):
    """The planner's answer to the policy's fit requirement."""

    fits: bool
    required_bytes: int = Field(ge=0)
    available_bytes: int = Field(ge=0)
    gpu: str


class StatsSettings(StrictModel):
    confidence: float = stats.CONFIDENCE
    bootstrap_resamples: int = stats.RESAMPLES
    seed: int = stats.SEED
    alpha: float = stats.ALPHA
    power: float = stats.POWER


IntervalMethod = Literal["tango-score", "bca-bootstrap-floored", "percentile-bootstrap-floored"]
INTERVAL_METHODS: dict[str, IntervalMethod] = {
    "binary": "tango-score", "continuous": "bca-bootstrap-floored", "corpus": "percentile-bootstrap-floored",
}


class SetVerdict(StrictModel):
    """One eval set, judged. Scores, deltas, CI bounds and min_detectable_drop are in `unit`s.

    `delta` is candidate - baseline as measured; `worsening` is the same difference signed so that
    positive is worse (-delta when higher is better, delta when lower is better): the rules read it.
    """

    eval_set: str
    metric: str
    higher_is_better: bool
    aggregation: str
    kind: Literal["binary", "continuous", "corpus"]
    unit: str
    binary: bool
    n: int
    baseline_score: float
    candidate_score: float
    delta: float
    worsening: float
    ci_low: float
    ci_high: float
    interval_method: IntervalMethod
    mcnemar_p: float | None
    flips_right_to_wrong: int | None
    flips_wrong_to_right: int | None
    flip_rate: float | None = Field(description="fraction of items that went right->wrong")
    flip_rate_lower_bound: float | None = Field(description="one-sided 95% Wilson lower bound of flip_rate")
    kl_mean: float | None
    kl_max: float | None
    kl_items: int
    kl_method: str | None
    min_detectable_drop: float
    rules: SetPolicy
    warnings: list[str]
    reasons: list[str]
    passed: bool

    @property
    def worst_bound(self) -> float:
        """The CI bound on the bad side, as a worsening (positive = worse): what non-inferiority reads."""
        return -self.ci_low if self.higher_is_better else self.ci_high


class GateResult(StrictModel):
    """The decision. `reasons` (why rejected) and `warnings` collect those of every set plus the fit."""

    schema_version: Literal[2] = SCHEMA_VERSION
    recipe: str
    verdict: Literal["promoted", "rejected"]
    sets: list[SetVerdict]
    fit: FitCheck | None
    reasons: list[str]
    warnings: list[str]
    settings: StatsSettings

    @property
    def exit_code(self) -> int:
        """0 promoted, 1 rejected: the CLI's contract."""
        return EXIT_OK if self.verdict == "promoted" else EXIT_REJECTED


class GateReport(StrictModel):
    """gate.json: the decision plus what it was made from (hashes), how long each stage took, the plan."""

    schema_version: Literal[2] = SCHEMA_VERSION
    created_at: str | None = None
    inputs: dict[str, Any] = Field(default_factory=dict, description="model, artifact, recipe, policy, eval_sets: paths and hashes")
    stages: dict[str, float] = Field(default_factory=dict, description="wall seconds per stage, in run order")
    plan: dict[str, Any] | None = None
    gate: GateResult
    # The load test's figures and checks (docs/loadtest.md); null when it did not run. Optional: schema 2 still.
    performance: PerformanceReport | None = None

    @property
    def manifest_sha256(self) -> str | None:
        """The manifest.json sha256 of the artifact judged (the runner writes inputs.artifact.manifest_sha256)."""
        artifact = self.inputs.get("artifact")
        value = artifact.get("manifest_sha256") if isinstance(artifact, dict) else None
        return value if isinstance(value, str) else None


def decide(comparisons: list[SetComparison], policy: Policy, recipe: str | RecipeIdentity, fit: FitCheck | None = None) -> GateResult:
    """Judge every eval set by its rules (policy.for_set) and the fit; promoted only if nothing fails."""
    if not comparisons:
        raise InputError("nothing to gate: no eval set was scored", field="eval_sets")
    names = [comparison.eval_set for comparison in comparisons]
    if len(set(names)) != len(names):
        raise InputError(f"eval set scored twice: {sorted({n for n in names if names.count(n) > 1})}", field="eval_sets")
    sets = [judge_set(comparison, policy.for_set(recipe, comparison.eval_set)) for comparison in comparisons]
    reasons = [reason for verdict in sets for reason in verdict.reasons] + _fit_reasons(fit)
    warnings = [warning for verdict in sets for warning in verdict.warnings]
    warnings += [
        f"policy: eval_sets override {name!r} matches no scored eval set" for name in policy.eval_sets if name not in names
    ]
    return GateResult(
        recipe=RecipeIdentity.of(recipe).name,
        verdict="rejected" if reasons else "promoted",
        sets=sets,
        fit=fit,
        reasons=reasons,
        warnings=warnings,
        settings=StatsSettings(),
    )


def judge_set(comparison: SetComparison, rules: SetPolicy) -> SetVerdict:
    """Measure one set and apply its rules."""
    measured = _measure(comparison)
    reasons = _reasons(comparison.eval_set, measured, rules)
    return SetVerdict(
        **measured,
        rules=rules,
        warnings=_warnings(comparison.eval_set, measured, rules, passed=not reasons),
        reasons=reasons,
        passed=not reasons,
    )


def _nats(value: float) -> str:
    return f"{value:.4f}" if value >= 1e-3 else f"{value:.2e}"


def _scaled(value: float, scale: float) -> float:
    """Metric units to report units, rounded to 1e-6 so that 7 of 100 reads 7.0, not 7.000000000000001."""
    return round(scale * float(value), 6)


def _measure(comparison: SetComparison) -> dict[str, Any]:
    spec = comparison.metric
    n = len(comparison.items)
    if spec.kind == "corpus":
        measured = _measure_corpus(comparison)
    else:
        base = np.array([item.baseline for item in comparison.items], dtype=float)
        cand = np.array([item.candidate for item in comparison.items], dtype=float)
        measured = _measure_binary(base, cand) if spec.kind == "binary" else _measure_continuous(spec, base, cand)
    scaled = {key: _scaled(measured[key], spec.scale) for key in ("baseline_score", "candidate_score", "ci_low", "ci_high", "min_detectable_drop")}
    delta = _scaled(measured["candidate_score"] - measured["baseline_score"], spec.scale)
    kl = stats.kl_summary([item.kl for item in comparison.items])
    return measured | scaled | {
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
    }


_NO_FLIPS = {"mcnemar_p": None, "flips_right_to_wrong": None, "flips_wrong_to_right": None, "flip_rate": None, "flip_rate_lower_bound": None}


def _measure_binary(base: np.ndarray, cand: np.ndarray) -> dict[str, Any]:
    flipped = stats.flips(base, cand)
    low, high = stats.tango_interval(flipped.right_to_wrong, flipped.wrong_to_right, flipped.n)
    return {
        "baseline_score": base.mean(),
        "candidate_score": cand.mean(),
        "ci_low": low,
        "ci_high": high,
        "mcnemar_p": stats.mcnemar_exact_p(flipped.right_to_wrong, flipped.wrong_to_right),
        "flips_right_to_wrong": flipped.right_to_wrong,
        "flips_wrong_to_right": flipped.wrong_to_right,
        "flip_rate": flipped.right_to_wrong_rate,
        "flip_rate_lower_bound": stats.wilson_lower_bound(flipped.right_to_wrong, flipped.n),
        "min_detectable_drop": stats.min_detectable_drop_binary(flipped.n, flipped.discordance_rate),
    }


def _measure_continuous(spec: MetricSpec, base: np.ndarray, cand: np.ndarray) -> dict[str, Any]:
    spread = value_range(spec, (float(np.ptp(np.concatenate([base, cand]))),))
    _, low, high = stats.mean_difference_interval(base, cand, value_range=spread)
    sd = float(np.std(cand - base, ddof=1)) if base.size > 1 else 0.0
    return _NO_FLIPS | {
        "baseline_score": base.mean(),
        "candidate_score": cand.mean(),
        "ci_low": low,
        "ci_high": high,
        "min_detectable_drop": stats.min_detectable_drop_continuous(base.size, sd),
    }


def _measure_corpus(comparison: SetComparison) -> dict[str, Any]:
    spec = comparison.metric
    aggregate = corpus_aggregation(spec.aggregation)
    base_values = [item.baseline for item in comparison.items]
    cand_values = [item.candidate for item in comparison.items]
    full = (float(aggregate(base_values)), float(aggregate(cand_values)))
    base_score, cand_score, low, high = stats.corpus_difference_interval(
        aggregate, base_values, cand_values, value_range=value_range(spec, full)
    )
    return _NO_FLIPS | {
        "baseline_score": base_score,
        "candidate_score": cand_score,
        "ci_low": low,
        "ci_high": high,
        "min_detectable_drop": stats.min_detectable_drop_from_interval((high - low) / 2.0),
    }


def _reasons(name: str, m: dict[str, Any], rules: SetPolicy) -> list[str]:
    """One line per failed rule, naming the set, the rule and both numbers."""
    reasons = []
    unit, worse = m["unit"], m["worsening"]
    if rules.max_abs_drop is not None and worse > rules.max_abs_drop + _EPS:
        reasons.append(f"{name}: {_worse_word(m)} {worse:.2f} {unit} > max_abs_drop {rules.max_abs_drop}")
    if rules.max_rel_drop is not None and m["baseline_score"] != 0:
        relative = worse / abs(m["baseline_score"])
        if relative > rules.max_rel_drop + _EPS:
            reasons.append(
                f"{name}: relative {_worse_word(m)} {relative:.3f} of baseline {m['baseline_score']:.2f} > max_rel_drop {rules.max_rel_drop}"
            )
    bound = -m["ci_low"] if m["higher_is_better"] else m["ci_high"]
    if rules.non_inferiority and bound > rules.ni_margin + _EPS:
        side, shown = ("lower", m["ci_low"]) if m["higher_is_better"] else ("upper", m["ci_high"])
        limit = -rules.ni_margin if m["higher_is_better"] else rules.ni_margin
        relation = "<" if m["higher_is_better"] else ">"
        reasons.append(
            f"{name}: 95% CI {side} bound {shown:+.2f} {unit} {relation} {limit:+g} (ni_margin {rules.ni_margin}; non-inferiority not shown)"
        )
    if rules.max_flip_rate is not None and m["flip_rate_lower_bound"] is not None and m["flip_rate_lower_bound"] > rules.max_flip_rate + _EPS:
        reasons.append(
            f"{name}: flip rate {m['flip_rate']:.3f} ({m['flips_right_to_wrong']}/{m['n']} right->wrong), "
            f"95% lower bound {m['flip_rate_lower_bound']:.3f} > max_flip_rate {rules.max_flip_rate}"
        )
    if rules.max_kl is not None and m["kl_mean"] is not None and m["kl_mean"] > rules.max_kl + _EPS:
        reasons.append(f"{name}: mean KL {_nats(m['kl_mean'])} nats/token > max_kl {rules.max_kl}")
    return reasons


def _worse_word(m: dict[str, Any]) -> str:
    return "drop" if m["higher_is_better"] else "rise"


def _warnings(name: str, m: dict[str, Any], rules: SetPolicy, *, passed: bool) -> list[str]:
    """What does not reject but qualifies the verdict: too few items, a weak or significant pass, unchecked rules."""
    warnings = []
    n, unit = m["n"], m["unit"]
    if n < rules.min_items:
        warnings.append(f"{name}: {n} items < min_items {rules.min_items}")
    bar, bar_name = (rules.ni_margin, "ni_margin") if rules.non_inferiority else (rules.max_abs_drop, "max_abs_drop")
    if passed and bar is not None and m["min_detectable_drop"] > bar:
        warnings.append(
            f"{name}: too small to decide: {n} items reliably detect only changes of {m['min_detectable_drop']:.1f} {unit} "
            f"or more (alpha {stats.ALPHA}, power {stats.POWER}), above {bar_name} {bar}"
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
    if rules.max_flip_rate is not None and not m["binary"]:
        warnings.append(f"{name}: metric {m['metric']!r} is not pass/fail; max_flip_rate not checked")
    return warnings


def _fit_reasons(fit: FitCheck | None) -> list[str]:
    if fit is None or fit.fits:
        return []
    return [
        f"fit: needs {fit.required_bytes / GiB:.1f} GiB > {fit.available_bytes / GiB:.1f} GiB available on {fit.gpu}"
    ]


def save_report(report: GateReport, path: Path) -> None:
    write_text_atomic(path, report.model_dump_json(indent=2) + "\n")


def read_report(path: Path) -> tuple[GateReport, dict[str, Any]]:
    """A gate.json, typed, and its JSON object as written (what the registry keeps and hashes); a bad file
    raises InputError naming it."""
    if not path.is_file():
        raise InputError("no such gate report", file=path, field="report")
    data = read_json_object(path, what="gate report", max_bytes=MAX_REPORT_BYTES)[0]
    try:
        return GateReport.model_validate(data), data
    except ValidationError as error:
        raise from_validation_error(error, path) from None


def load_report(path: Path) -> GateReport:
    """Read a gate.json back (to render it, register it, repair from it); a bad file raises InputError naming it."""
    return read_report(path)[0]
