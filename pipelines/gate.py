"""The gate: a paired comparison of candidate and baseline on every eval set, judged by the policy.

Input: one SetComparison per eval set (per-item scores of both models, paired by item id) and the
planner's FitCheck. Output: a GateResult with a SetVerdict per set and the overall verdict. Scores are
metrics in [0, 1]; everything reported is in points (x100). The file format is in docs/gate-json.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipelines import stats
from pipelines.atomic import write_text_atomic
from pipelines.errors import InputError, from_validation_error
from pipelines.policy import Policy, SetPolicy

SCHEMA_VERSION = 1
POINTS = 100.0
# Float slack for threshold comparisons: a value exactly at a limit passes.
_EPS = 1e-9
_GIB = 1024**3


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PairedItem(_Model):
    """One item scored by both models. `kl`: the item's mean per-token KL(baseline || candidate), nats."""

    item_id: str
    baseline: float = Field(ge=0, le=1)
    candidate: float = Field(ge=0, le=1)
    kl: float | None = Field(default=None, ge=0)


class SetComparison(_Model):
    eval_set: str
    metric: str
    binary: bool = Field(description="pass/fail metric: every score is 0 or 1")
    items: list[PairedItem] = Field(min_length=1)
    kl_method: str | None = Field(default=None, description="how per-item KL was measured")

    @model_validator(mode="after")
    def _consistent(self) -> "SetComparison":
        ids = [item.item_id for item in self.items]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"item {duplicate!r} appears more than once in {self.eval_set!r}")
        if self.binary:
            odd = next((i for i in self.items if {i.baseline, i.candidate} - {0.0, 1.0}), None)
            if odd is not None:
                raise ValueError(f"binary metric but item {odd.item_id!r} scores {odd.baseline} / {odd.candidate}")
        if self.kl_method is None and any(item.kl is not None for item in self.items):
            raise ValueError("items carry KL values but kl_method is not given")
        return self


class FitCheck(_Model):
    """The planner's answer to the policy's fit requirement."""

    fits: bool
    required_bytes: int = Field(ge=0)
    available_bytes: int = Field(ge=0)
    gpu: str


class StatsSettings(_Model):
    confidence: float = stats.CONFIDENCE
    bootstrap_resamples: int = stats.RESAMPLES
    seed: int = stats.SEED
    alpha: float = stats.ALPHA
    power: float = stats.POWER


class SetVerdict(_Model):
    """One eval set, judged. Scores, deltas, CI bounds and min_detectable_drop are in points."""

    eval_set: str
    metric: str
    binary: bool
    n: int
    baseline_score: float
    candidate_score: float
    delta: float
    ci_low: float
    ci_high: float
    mcnemar_p: float | None
    flips_right_to_wrong: int | None
    flips_wrong_to_right: int | None
    flip_rate: float | None = Field(description="fraction of items that went right->wrong")
    kl_mean: float | None
    kl_max: float | None
    kl_items: int
    kl_method: str | None
    min_detectable_drop: float
    rules: SetPolicy
    warnings: list[str]
    reasons: list[str]
    passed: bool


class GateResult(_Model):
    """The decision. `reasons` (why rejected) and `warnings` collect those of every set plus the fit."""

    schema_version: Literal[1] = SCHEMA_VERSION
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
        return 0 if self.verdict == "promoted" else 1


class GateReport(_Model):
    """gate.json: the decision plus what it was made from (hashes), how long each stage took, the plan."""

    schema_version: Literal[1] = SCHEMA_VERSION
    created_at: str | None = None
    inputs: dict[str, Any] = Field(default_factory=dict, description="model, artifact, recipe, policy, eval_sets: paths and hashes")
    stages: dict[str, float] = Field(default_factory=dict, description="wall seconds per stage, in run order")
    plan: dict[str, Any] | None = None
    gate: GateResult


def decide(comparisons: list[SetComparison], policy: Policy, recipe: str, fit: FitCheck | None = None) -> GateResult:
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
        recipe=recipe,
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


def _points(fraction: float) -> float:
    """Score units to points, rounded to 1e-6 so that 7 of 100 reads 7.0, not 7.000000000000001."""
    return round(POINTS * float(fraction), 6)


def _measure(comparison: SetComparison) -> dict[str, Any]:
    base = np.array([item.baseline for item in comparison.items])
    cand = np.array([item.candidate for item in comparison.items])
    n = base.size
    _, low, high = stats.paired_bootstrap_ci(base, cand)
    kl = stats.kl_summary([item.kl for item in comparison.items])
    measured: dict[str, Any] = {
        "eval_set": comparison.eval_set,
        "metric": comparison.metric,
        "binary": comparison.binary,
        "n": n,
        "baseline_score": _points(base.mean()),
        "candidate_score": _points(cand.mean()),
        "delta": _points(cand.mean() - base.mean()),
        "ci_low": _points(low),
        "ci_high": _points(high),
        "kl_mean": kl.mean if kl else None,
        "kl_max": kl.max if kl else None,
        "kl_items": kl.items if kl else 0,
        "kl_method": comparison.kl_method,
    }
    if comparison.binary:
        flipped = stats.flips(base, cand)
        measured |= {
            "mcnemar_p": stats.mcnemar_exact_p(flipped.right_to_wrong, flipped.wrong_to_right),
            "flips_right_to_wrong": flipped.right_to_wrong,
            "flips_wrong_to_right": flipped.wrong_to_right,
            "flip_rate": flipped.right_to_wrong_rate,
            "min_detectable_drop": _points(stats.min_detectable_drop_binary(n, flipped.discordance_rate)),
        }
    else:
        sd = float(np.std(cand - base, ddof=1)) if n > 1 else 0.0
        measured |= {
            "mcnemar_p": None,
            "flips_right_to_wrong": None,
            "flips_wrong_to_right": None,
            "flip_rate": None,
            "min_detectable_drop": _points(stats.min_detectable_drop_continuous(n, sd)),
        }
    return measured


def _reasons(name: str, m: dict[str, Any], rules: SetPolicy) -> list[str]:
    """One line per failed rule, naming the set, the rule and both numbers."""
    reasons = []
    drop = -m["delta"]
    if rules.max_abs_drop is not None and drop > rules.max_abs_drop + _EPS:
        reasons.append(f"{name}: drop {drop:.2f} points > max_abs_drop {rules.max_abs_drop}")
    if rules.max_rel_drop is not None and m["baseline_score"] > 0:
        relative = drop / m["baseline_score"]
        if relative > rules.max_rel_drop + _EPS:
            reasons.append(
                f"{name}: relative drop {relative:.3f} of baseline {m['baseline_score']:.2f} > max_rel_drop {rules.max_rel_drop}"
            )
    if rules.non_inferiority and m["ci_low"] < -rules.ni_margin - _EPS:
        reasons.append(
            f"{name}: 95% CI lower bound {m['ci_low']:.2f} points < -ni_margin {-rules.ni_margin} (non-inferiority not shown)"
        )
    if rules.max_flip_rate is not None and m["flip_rate"] is not None and m["flip_rate"] > rules.max_flip_rate + _EPS:
        reasons.append(
            f"{name}: flip rate {m['flip_rate']:.3f} ({m['flips_right_to_wrong']}/{m['n']} right->wrong) "
            f"> max_flip_rate {rules.max_flip_rate}"
        )
    if rules.max_kl is not None and m["kl_mean"] is not None and m["kl_mean"] > rules.max_kl + _EPS:
        reasons.append(f"{name}: mean KL {_nats(m['kl_mean'])} nats/token > max_kl {rules.max_kl}")
    return reasons


def _warnings(name: str, m: dict[str, Any], rules: SetPolicy, *, passed: bool) -> list[str]:
    """What does not reject but qualifies the verdict: too few items, a weak or significant pass, unchecked rules."""
    warnings = []
    n = m["n"]
    if n < rules.min_items:
        warnings.append(f"{name}: {n} items < min_items {rules.min_items}")
    bar, bar_name = (rules.ni_margin, "ni_margin") if rules.non_inferiority else (rules.max_abs_drop, "max_abs_drop")
    if passed and bar is not None and m["min_detectable_drop"] > bar:
        warnings.append(
            f"{name}: too small to decide: {n} items reliably detect only drops of {m['min_detectable_drop']:.1f} points "
            f"or more (alpha {stats.ALPHA}, power {stats.POWER}), above {bar_name} {bar}"
        )
    if passed and m["mcnemar_p"] is not None and m["delta"] < 0 and m["mcnemar_p"] < stats.ALPHA:
        warnings.append(
            f"{name}: the drop of {-m['delta']:.2f} points is within the policy but statistically significant "
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
        f"fit: needs {fit.required_bytes / _GIB:.1f} GiB > {fit.available_bytes / _GIB:.1f} GiB available on {fit.gpu}"
    ]


def save_report(report: GateReport, path: Path) -> None:
    write_text_atomic(path, report.model_dump_json(indent=2) + "\n")


def load_report(path: Path) -> GateReport:
    """Read a gate.json back (for re-rendering); a bad file raises InputError naming it."""
    if not path.is_file():
        raise InputError("no such gate report", file=path, field="report")
    try:
        return GateReport.model_validate_json(path.read_text())
    except ValidationError as error:
        raise from_validation_error(error, path) from None
