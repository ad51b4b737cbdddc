"""The price of each rule, per set (docs/guarantees.md, "Price"; `quantize eval-sets power`, docs/gate-json.md "Sizing").

Every rule buys its guarantee with width. Per set and per noise level this module states:
- width_ratio: the rule's one-sided bound less the estimate, over normal theory's z(c) se at the same one-sided level c
  (se: the per-item differences' sd / sqrt(n), the jackknife's for corpus metrics); the median over the draws;
- pass_rate: how often an unchanged candidate passes. Pass/fail sets: exact, summed over the binomial 2x2 tables judged by
  the gate's own rule function (verdict.table_rejects, what judge_set's reasons come from). Averaged and corpus sets:
  simulated through judge_set itself (so any rule the gate gains is counted), seeded, at most REPS draws within a time
  budget; `reps` and the standard error say how many it made.

The noise is measured where the policy's noise floor has a second scoring of the baseline on record (the cache holds it):
an unchanged candidate is the baseline's other scoring, so each draw resamples the set's items with both scorings and
swaps them at random per item. Where none exists the grid below is assumed, on the cached baseline's values (or a stated
synthetic baseline when the set was never scored), and labelled "assumed, not measured".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from pipelines.errors import InputError
from pipelines.evaluation.baseline import BaselineEntry, RepeatEntry
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.metrics import MetricSpec, corpus_aggregation
from pipelines.files.run_input import read_regular
from pipelines.gate import stats
from pipelines.gate.noise import rate_interval
from pipelines.gate.policy import Policy, SetPolicy, unattainable
from pipelines.gate.verdict import PairedItem, SetComparison, binary_critical_value, judge_set
from pipelines.gate.verdict import binary_unchanged_reject_probability as unchanged_reject_probability
from pipelines.recipe import RecipeIdentity

REPS = 200
SECONDS = 5.0  # per set, all its noise levels together
SEED = 0
ASSUMED_DISCORDANCE = (0.02, 0.10)  # pass/fail: the share of items an unchanged candidate answers differently
ASSUMED_MOVED = (0.02, 0.10)  # averaged: the share of items moved by +-1 value range, up or down at random
ASSUMED_LOG_NOISE = (0.5, 1.0)  # perplexity-like: sd of each document's log-likelihood, nats
SYNTHETIC_WORDS, SYNTHETIC_PERPLEXITY = 20, 20.0  # a never-scored perplexity set's stated documents
MAX_CACHE_FILE = 64 * 2**20  # bytes: a larger file in the cache is not an entry the product wrote

Pairs = tuple[list[Any], list[Any]]
Draw = Callable[[np.random.Generator, int], Pairs]


@dataclass(frozen=True)
class Noise:
    """One noise level: where it comes from, in words, and how to draw n (baseline, candidate) value pairs of an unchanged
    candidate. `discordance`: pass/fail sets' share of items answered differently (the exact sums read it, not `draw`)."""

    source: str  # "measured" | "assumed, not measured"
    label: str
    draw: Draw | None = None
    discordance: float | None = None


@dataclass(frozen=True)
class SetBaseline:
    """A set's cached baseline values and, when the noise floor scored it twice, its second scoring (item order kept)."""

    values: list[Any]
    repeat: list[Any] | None
    score: float
    model_hash: str


def cached_baselines(eval_sets: list[EvalSet], cache_dir: Path) -> dict[str, SetBaseline]:
    """Each set's baseline as the cache holds it for its current content (its sha256): the newest entry with a second
    scoring on record, else the newest entry; a set never scored is absent. The cache is read once; an entry that is not
    a regular file within MAX_CACHE_FILE, or does not parse, is skipped (the product's run-folder reader)."""
    wanted = {(eval_set.name, eval_set.sha256) for eval_set in eval_sets}
    firsts: dict[str, list[tuple[float, BaselineEntry]]] = {}
    repeats: dict[str, RepeatEntry] = {}
    for path in sorted(cache_dir.glob("*.json")) if cache_dir.is_dir() else []:
        try:
            entry = _parse_entry(read_regular(path, "baseline cache entry", MAX_CACHE_FILE))
            mtime = path.lstat().st_mtime
        except (InputError, OSError):
            continue
        if entry is None or (entry.score.eval_set, entry.score.eval_set_sha256) not in wanted:
            continue
        if isinstance(entry, RepeatEntry):
            repeats[entry.first_key] = entry
        else:
            firsts.setdefault(entry.score.eval_set, []).append((mtime, entry))
    found = {}
    for name, entries in firsts.items():
        _, first = max(entries, key=lambda candidate: (candidate[1].key in repeats, candidate[0]))
        found[name] = _set_baseline(first, repeats.get(first.key))
    return found


def _set_baseline(first: BaselineEntry, repeat: RepeatEntry | None) -> SetBaseline:
    values = [item.value for item in sorted(first.score.items, key=lambda item: item.doc_id)]
    again = None if repeat is None else [item.value for item in sorted(repeat.score.items, key=lambda item: item.doc_id)]
    if again is not None and len(again) != len(values):
        again = None
    return SetBaseline(values=values, repeat=again, score=first.score.score, model_hash=first.model_hash)


def _parse_entry(data: bytes) -> BaselineEntry | RepeatEntry | None:
    for entry_type in (RepeatEntry, BaselineEntry):
        try:
            return entry_type.model_validate_json(data)
        except ValidationError:
            continue
    return None


# --- the noise a set shows -------------------------------------------------------------------------------------------

def noise_levels(spec: MetricSpec, baseline: SetBaseline | None, baseline_score: float) -> list[Noise]:
    """The measured noise when the baseline was scored twice, else the assumed grid for the set's kind."""
    if baseline is not None and baseline.repeat is not None:
        measured = measured_noise(spec, baseline.values, baseline.repeat, baseline.model_hash)
        if spec.kind != "binary":
            return [measured]
        # a rate measured on n items is known only within its interval: the price at its upper end too
        flips = round((measured.discordance or 0.0) * len(baseline.values))
        high = rate_interval(flips, len(baseline.values))[1]
        upper = Noise("measured, upper end", f"discordance {high:.4f}: the upper end of the A/A rate's 95% interval", discordance=high)
        return [measured, upper]
    if spec.kind == "binary":
        return [Noise("assumed, not measured", f"discordance {psi:g}", discordance=psi) for psi in ASSUMED_DISCORDANCE]
    if spec.kind == "continuous":
        values = baseline.values if baseline is not None else [baseline_score]
        return [moved_noise(spec, values, share) for share in ASSUMED_MOVED]
    if spec.unbounded_items:
        documents = baseline.values if baseline is not None else [_synthetic_document(spec)]
        where = "" if baseline is not None else (
            f" (synthetic documents: {SYNTHETIC_WORDS} words or bytes at perplexity {SYNTHETIC_PERPLEXITY:g})")
        return [log_noise(documents, s, where) for s in ASSUMED_LOG_NOISE]
    if baseline is None:
        return []  # a text metric never scored: there are no texts to resample
    return [Noise("assumed, not measured", "none (identical answers; no second scoring on record)", _resampled(baseline.values, baseline.values))]


def _synthetic_document(spec: MetricSpec) -> float | list[float]:
    """A never-scored perplexity set's stated document, as lm-eval logs it: a bare log-likelihood for `perplexity`,
    [log-likelihood, words or bytes] for the weighted ones."""
    loglikelihood = -SYNTHETIC_WORDS * math.log(SYNTHETIC_PERPLEXITY)
    return loglikelihood if spec.aggregation == "perplexity" else [loglikelihood, float(SYNTHETIC_WORDS)]


def measured_noise(spec: MetricSpec, first: list[Any], second: list[Any], model_hash: str) -> Noise:
    differing = sum(1 for a, b in zip(first, second, strict=True) if a != b)
    label = f"baseline {model_hash[:12]} scored twice: {differing} of {len(first)} items differ (resampled, scorings swapped at random)"
    return Noise("measured", label, _resampled(first, second), discordance=differing / len(first) if spec.kind == "binary" else None)


def _resampled(first: list[Any], second: list[Any]) -> Draw:
    def draw(rng: np.random.Generator, n: int) -> Pairs:
        picks, swaps = rng.integers(0, len(first), n), rng.random(n) < 0.5
        pairs = [(second[i], first[i]) if swap else (first[i], second[i]) for i, swap in zip(picks, swaps, strict=True)]
        return [a for a, _ in pairs], [b for _, b in pairs]
    return draw


def moved_noise(spec: MetricSpec, values: list[Any], share: float) -> Noise:
    low, high = (0.0, 1.0) if spec.bounded_unit_interval else (float(min(values)), float(max(values)))

    def draw(rng: np.random.Generator, n: int) -> Pairs:
        base = np.asarray(values, dtype=float)[rng.integers(0, len(values), n)]
        cand = base.copy()
        moved, up = rng.random(n) < share, rng.random(n) < 0.5
        base[moved], cand[moved] = np.where(up[moved], low, high), np.where(up[moved], high, low)
        return base.tolist(), cand.tolist()
    return Noise("assumed, not measured", f"+-1 value range on {share:.0%} of items", draw)


def log_noise(documents: list[Any], s: float, where: str) -> Noise:
    def draw(rng: np.random.Generator, n: int) -> Pairs:
        picks, noise = rng.integers(0, len(documents), n), rng.normal(0.0, s, n)
        base = [documents[i] for i in picks]
        cand = [[value[0] + e, *value[1:]] if isinstance(value, list) else value + e for value, e in zip(base, noise, strict=True)]
        return base, [[float(v[0]), *v[1:]] if isinstance(v, list) else float(v) for v in cand]
    return Noise("assumed, not measured", f"log-likelihood sd {s:g} nats per document{where}", draw)


# --- the price under one noise level ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Price:
    noise: Noise
    n: int
    width_ratio: float | None  # None: no noise, normal theory's width is 0
    pass_rate: float | None
    pass_rate_se: float | None
    reps: int
    method: str  # "exact" | "simulated through judge_set"

    def as_json(self) -> dict[str, Any]:
        return {
            "noise": {"source": self.noise.source, "label": self.noise.label}, "n": self.n,
            "width_ratio": None if self.width_ratio is None else round(self.width_ratio, 3),
            "unchanged_pass_rate": None if self.pass_rate is None else round(self.pass_rate, 4),
            "unchanged_pass_rate_se": None if self.pass_rate_se is None else round(self.pass_rate_se, 4),
            "reps": self.reps, "method": self.method,
        }


def binary_price(rules: SetPolicy, higher_is_better: bool, n: int, right: int, noise: Noise) -> Price:
    """Exact: the width of the calibrated Tango bound at the expected table of an unchanged candidate (psi n / 2 losses and
    gains) over z(c) sqrt(psi / n), and 1 - P(reject) summed over the binomial tables."""
    psi = noise.discordance or 0.0
    rejected = unchanged_reject_probability(rules, higher_is_better, n, right, psi)
    ratio = None
    if psi > 0:
        half = psi * n / 2.0
        bound = -stats.tango_lower_bound(half, half, n, z=binary_critical_value(rules, n, right), confidence=rules.confidence)
        ratio = bound / (stats.z_one_sided(rules.confidence) * math.sqrt(psi / n))
    return Price(noise, n, ratio, 1.0 - rejected, 0.0, 0, "exact")


def simulated_price(name: str, spec: MetricSpec, rules: SetPolicy, n: int, noise: Noise, *, reps: int = REPS,
                    seconds: float = SECONDS, seed: int = SEED) -> Price:
    """Draws of an unchanged candidate judged by judge_set, until `reps` or `seconds` (at least one draw, unless one
    judgement is foreseen to take longer than `seconds`: then no draw, and the method says why)."""
    if noise.draw is None:
        raise ValueError(f"noise level {noise.label!r} has no draws (pass/fail sets are priced exactly: binary_price)")
    rng, started = np.random.default_rng(seed), time.monotonic()
    foreseen = judgement_seconds(spec, noise.draw(np.random.default_rng(seed), n)[0])
    if foreseen > seconds:
        return Price(noise, n, None, None, None, 0, f"not simulated: one gate judgement of this set takes about {foreseen:.0f} s, "
                                                       f"over the {seconds:g} s budget (--price-seconds)")
    passed: list[bool] = []
    ratios: list[float] = []
    while len(passed) < reps and (not passed or time.monotonic() - started < seconds):
        base, cand = noise.draw(rng, n)
        items = [PairedItem.model_construct(item_id=str(i), baseline=b, candidate=c, kl=None, baseline_repeat=None)
                 for i, (b, c) in enumerate(zip(base, cand, strict=True))]
        verdict = judge_set(SetComparison.model_construct(eval_set=name, metric=spec, items=items, kl_method=None), rules)
        passed.append(verdict.passed)
        se = spec.scale * normal_se(spec, base, cand)
        if se > 0 and verdict.worsening_bound is not None and verdict.worsening is not None:
            ratios.append((verdict.worsening_bound - verdict.worsening) / (stats.z_one_sided(rules.confidence) * se))
    rate = float(np.mean(passed))
    return Price(noise, n, float(np.median(ratios)) if ratios else None, rate, math.sqrt(rate * (1 - rate) / len(passed)),
                 len(passed), "simulated through judge_set")


def judgement_seconds(spec: MetricSpec, values: list[Any]) -> float:
    """About how long judge_set takes on `values`: a corpus metric's judgement aggregates the set once per bootstrap
    resample, for each side (a BLEU set of 250 items: minutes); the others are vectorised (0)."""
    if spec.kind != "corpus":
        return 0.0
    aggregate = corpus_aggregation(spec.aggregation)
    started = time.process_time()
    aggregate(values)
    return (time.process_time() - started) * 2 * (stats.CORPUS_RESAMPLES + 1)


def normal_se(spec: MetricSpec, base: list[Any], cand: list[Any]) -> float:
    """Normal theory's standard error of the difference, metric units: sd(d) / sqrt(n) for a mean, the jackknife's for a
    corpus aggregate (the same for a mean)."""
    n = len(base)
    if spec.kind != "corpus":
        return float(np.std(np.asarray(cand, dtype=float) - np.asarray(base, dtype=float), ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    effects = stats.deletion_effects(corpus_aggregation(spec.aggregation), base, cand)
    return float(math.sqrt((effects.size - 1) / effects.size * np.sum((effects - effects.mean()) ** 2)))


def set_prices(eval_set: EvalSet, rules: SetPolicy, baseline: SetBaseline | None, baseline_score: float, *,
               n: int | None = None, seconds: float = SECONDS, reps: int = REPS) -> list[Price]:
    """Each noise level's price for the set at n items (its own size by default), within `seconds` in all."""
    spec, size = eval_set.metric, n or eval_set.num_items
    levels = noise_levels(spec, baseline, baseline_score)
    if spec.kind == "binary":
        score = baseline.score if baseline is not None else baseline_score
        right = round(score * size)
        return [binary_price(rules, spec.higher_is_better, size, right, noise) for noise in levels]
    share = seconds / max(len(levels), 1)
    return [simulated_price(eval_set.name, spec, rules, size, noise, reps=reps, seconds=share) for noise in levels]


def price_rows(eval_sets: list[EvalSet], policy: Policy, recipe: str | RecipeIdentity | None, baseline_score: float,
               cache_dir: Path, *, seconds: float = SECONDS) -> dict[str, dict[str, Any]]:
    """Per set name: which cached baseline the noise came from (null when never scored) and each noise level's price
    (none for a set refused at load: no candidate can pass it)."""
    rows, baselines = {}, cached_baselines(eval_sets, cache_dir)
    for eval_set in eval_sets:
        baseline = baselines.get(eval_set.name)
        refused = unattainable(policy, recipe, eval_set) is not None
        prices = [] if refused else set_prices(eval_set, policy.for_set(recipe, eval_set.name), baseline, baseline_score, seconds=seconds)
        rows[eval_set.name] = {
            "price_baseline": None if baseline is None else {"model_hash": baseline.model_hash, "scored_twice": baseline.repeat is not None},
            "price": [entry.as_json() for entry in prices],
        }
    return rows
