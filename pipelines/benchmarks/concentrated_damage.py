"""Populations whose worsening is exactly the tolerance and whose concentration share is exactly damage_share, and the
false-pass rate of the gate on samples drawn from them (`python -m pipelines.benchmarks.gate_guarantees concentrated`).

Families:
- perplexity: word perplexity (lm-eval weighted_perplexity) of documents with lognormal lengths; a share q of documents
  damaged, per-word loss rise drawn from the severity shape (per document, fixed in the population), every document
  with per-word noise N(0, 0.3 / sqrt(words / 20));
- bleu, chrf, ter: real sacrebleu on synthetic sentences: references of 5 to 25 words, the baseline's prediction the
  reference with each word replaced with probability 0.3, the candidate the same prediction that "runs on" for a share q
  of prompts: appended garbage tokens (a vocabulary the references never use), their count drawn from the shape.
Severity shapes: equal, exponential, lognormal (sigma 1), Pareto (alpha 1.5). For each, the severities are scaled so
that the population's worsening is the tolerance (largest scale at or below it: a conservative side for a false-pass
rate), and q is the smallest share whose concentration share (the smallest fraction of items carrying more than half of
the worsening, measured on the population's exact contributions: pipelines.gate.concentrated) reaches damage_share.

A set is judged by `judge`: "set" runs judge_set itself (the bootstrap, the clipped bound and every other rule); "rule"
runs only the concentrated-damage rule (the very functions judge_set calls), whose pass is necessary for judge_set's, so
its rate bounds judge_set's from above: BLEU's paired bootstrap re-scores 2,000 resamples (about a minute a set here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pipelines.evaluation.metrics import MetricSpec, make_spec
from pipelines.gate import concentrated
from pipelines.gate.policy import SetPolicy
from pipelines.gate.verdict import PairedItem, SetComparison, judge_set, tolerance

Shape = Literal["equal", "exponential", "lognormal", "pareto"]
SHAPES: tuple[Shape, ...] = ("equal", "exponential", "lognormal", "pareto")
FAMILIES = ("perplexity", "bleu", "chrf", "ter")
PERPLEXITY_POOL = 20_000
SENTENCE_POOL = 4_000
_VOCABULARY = [f"w{index}" for index in range(300)]
_GARBAGE = " XQZ"


def severities(shape: Shape, size: int, rng: np.random.Generator) -> np.ndarray:
    """Positive severities of mean about 1 in the shape asked for."""
    if shape == "equal":
        return np.ones(size)
    if shape == "exponential":
        return rng.exponential(1.0, size)
    if shape == "lognormal":
        return rng.lognormal(-0.5, 1.0, size)
    return (rng.pareto(1.5, size) + 1.0) / 3.0


def concentration_share(contributions: np.ndarray) -> float:
    """The smallest fraction of items whose contributions carry more than half of the total (module docstring)."""
    ordered = np.sort(contributions)[::-1]
    carried = np.cumsum(ordered)
    return float((np.searchsorted(carried, carried[-1] / 2.0, side="right") + 1) / ordered.size)


@dataclass(frozen=True)
class Population:
    """Paired values of every item of the pool, and what was measured on it."""

    spec: MetricSpec
    baseline: list
    candidate: list
    worsening: float  # the population's true worsening, a share of the tolerance (1 = exactly the tolerance)
    share: float  # its concentration share
    damaged: float  # the share of items damaged
    statistics: tuple[np.ndarray, np.ndarray] | None = None  # sentence families: sacrebleu's per-item statistics, both models


def _spec(family: str) -> MetricSpec:
    if family == "perplexity":
        return make_spec("word_perplexity", "weighted_perplexity", higher_is_better=False)
    return make_spec(family, family, higher_is_better=family != "ter")


def _fit(worsening_at: Callable[[float, float], float], share_at: Callable[[float, float], float], damage_share: float) -> tuple[float, float]:
    """(q, scale): the smallest damaged share q whose concentration share reaches damage_share, and for each q the largest
    severity scale whose worsening is at most 1 (a share of the tolerance). Bisection on both."""

    def scale_for(q: float) -> float:
        low, high = 0.0, 1.0
        while worsening_at(q, high) < 1.0:
            high *= 2.0
        for _ in range(40):
            middle = (low + high) / 2.0
            low, high = (middle, high) if worsening_at(q, middle) <= 1.0 else (low, middle)
        return low

    low, high = damage_share, 1.0
    for _ in range(14):
        middle = (low + high) / 2.0
        low, high = (middle, high) if share_at(middle, scale_for(middle)) < damage_share else (low, middle)
    return high, scale_for(high)


def perplexity_population(shape: Shape, damage_share: float, relative: float, seed: int) -> Population:
    rng = np.random.default_rng(seed)
    words = np.maximum(5, np.round(rng.lognormal(math.log(80.0), 0.8, PERPLEXITY_POOL))).astype(int)
    base = -words * rng.gamma(4.0, 0.5, PERPLEXITY_POOL)
    noise = words * rng.normal(0.0, 0.3, PERPLEXITY_POOL) / np.sqrt(words / 20.0)
    rank, severity = rng.random(PERPLEXITY_POOL), severities(shape, PERPLEXITY_POOL, rng)
    tau = math.log1p(relative)

    def damage(q: float, scale: float) -> np.ndarray:
        return noise + np.where(rank < q, words * scale * severity, 0.0)

    def worsening(q: float, scale: float) -> float:
        return float(damage(q, scale).sum() / words.sum() / tau)

    q, scale = _fit(worsening, lambda q, scale: concentration_share(damage(q, scale)), damage_share)
    cand = base - damage(q, scale)
    return Population(
        spec=_spec("perplexity"), baseline=[[float(b), int(w)] for b, w in zip(base, words, strict=True)],
        candidate=[[float(c), int(w)] for c, w in zip(cand, words, strict=True)], worsening=worsening(q, scale),
        share=concentration_share(damage(q, scale)), damaged=q,
    )


def sentence_population(family: str, shape: Shape, damage_share: float, relative: float, seed: int) -> Population:
    """BLEU, chrF or TER: candidate statistics are the baseline's plus g times one garbage token's (exact for BLEU and
    chrF, whose statistics grow linearly with a garbage the references never share; TER's edits grow at most linearly, so
    the fitted worsening is at most the tolerance: the measured population figures are exact)."""
    rng = np.random.default_rng(seed)
    spec = _spec(family)
    metric = concentrated._sacrebleu_metric(family)
    refs = [" ".join(rng.choice(_VOCABULARY, int(rng.integers(5, 26)))) for _ in range(SENTENCE_POOL)]
    preds = [" ".join(word if rng.random() > 0.3 else str(rng.choice(_VOCABULARY)) for word in ref.split()) for ref in refs]
    base_stats = concentrated._sacrebleu_statistics(metric, [[r, p] for r, p in zip(refs, preds, strict=True)])
    step = concentrated._sacrebleu_statistics(metric, [[r, p + _GARBAGE] for r, p in zip(refs, preds, strict=True)]) - base_stats
    rank, severity = rng.random(SENTENCE_POOL), severities(shape, SENTENCE_POOL, rng)
    base_score = float(metric._compute_score_from_stats(list(base_stats.sum(axis=0))).score)
    allowed = relative * abs(base_score)
    sign = -1.0 if spec.higher_is_better else 1.0

    def garbage(q: float, scale: float) -> np.ndarray:
        return np.where(rank < q, np.round(scale * severity), 0.0)

    def pseudo_values(q: float, scale: float) -> np.ndarray:
        cand_stats = base_stats + garbage(q, scale)[:, None] * step
        return sign * _pseudo_values(metric, base_stats, cand_stats)

    def worsening(q: float, scale: float) -> float:
        cand_total = (base_stats + garbage(q, scale)[:, None] * step).sum(axis=0)
        return sign * (float(metric._compute_score_from_stats(list(cand_total)).score) - base_score) / allowed

    q, scale = _fit(worsening, lambda q, scale: concentration_share(pseudo_values(q, scale)), damage_share)
    runs = garbage(q, scale).astype(int)
    baseline = [[r, p] for r, p in zip(refs, preds, strict=True)]
    candidate = [[r, p + _GARBAGE * g] for r, p, g in zip(refs, preds, runs, strict=True)]
    cand_stats = concentrated._sacrebleu_statistics(metric, candidate)
    cand_score = float(metric._compute_score_from_stats(list(cand_stats.sum(axis=0))).score)
    return Population(spec=spec, baseline=baseline, candidate=candidate, worsening=sign * (cand_score - base_score) / allowed,
                      share=concentration_share(sign * _pseudo_values(metric, base_stats, cand_stats)), damaged=q,
                      statistics=(base_stats, cand_stats))


def _pseudo_values(metric: object, base_stats: np.ndarray, cand_stats: np.ndarray) -> np.ndarray:
    n = base_stats.shape[0]
    found = []
    for rows in (base_stats, cand_stats):
        total = rows.sum(axis=0)
        whole = float(metric._compute_score_from_stats(list(total)).score)  # type: ignore[attr-defined]
        out = np.asarray([float(metric._compute_score_from_stats(list(total - row)).score) for row in rows])  # type: ignore[attr-defined]
        found.append((whole, out))
    (base_whole, base_out), (cand_whole, cand_out) = found
    return n * (cand_whole - base_whole) - (n - 1) * (cand_out - base_out)


def population(family: str, shape: Shape, damage_share: float, relative: float, seed: int) -> Population:
    if family == "perplexity":
        return perplexity_population(shape, damage_share, relative, seed)
    return sentence_population(family, shape, damage_share, relative, seed)


def passes(found: Population, picks: np.ndarray, rules: SetPolicy, judge: Literal["rule", "set"]) -> bool:
    """Whether the sample `picks` of the population passes: judge_set itself, or the concentrated-damage rule alone."""
    baseline = [found.baseline[i] for i in picks]
    candidate = [found.candidate[i] for i in picks]
    if judge == "set":
        items = [PairedItem(item_id=str(index), baseline=b, candidate=c) for index, (b, c) in enumerate(zip(baseline, candidate, strict=True))]
        return judge_set(SetComparison(eval_set="simulated", metric=found.spec, items=items), rules).passed
    if found.statistics is not None:  # the same pseudo-values concentrated.contributions finds, from the pool's statistics
        metric = concentrated._sacrebleu_metric(found.spec.aggregation)
        base_stats, cand_stats = (rows[picks] for rows in found.statistics)
        base_score = float(metric._compute_score_from_stats(list(base_stats.sum(axis=0))).score)
        allowed = tolerance(found.spec.in_points, rules, base_score)
        assert allowed is not None, "the rules give this set no tolerance"
        sign = -1.0 if found.spec.higher_is_better else 1.0
        damage = sign * _pseudo_values(metric, base_stats, cand_stats)
        contributions = concentrated.Contributions(damage=damage, weight=np.ones(damage.size), tolerance=allowed)
    else:
        from pipelines.evaluation.metrics import corpus_aggregation

        base_score = float(corpus_aggregation(found.spec.aggregation)(baseline))
        allowed = tolerance(found.spec.in_points, rules, base_score)
        assert allowed is not None, "the rules give this set no tolerance"
        contributions = concentrated.contributions(found.spec.aggregation, baseline, candidate,
                                                   higher_is_better=found.spec.higher_is_better, allowed=allowed, baseline_score=base_score)
    return concentrated.clipped_bound(contributions, rules.damage_share, rules.confidence).passed


def pass_rate(found: Population, n: int, rules: SetPolicy, *, reps: int, seed: int, judge: Literal["rule", "set"] = "rule") -> float:
    """P(pass) over `reps` samples of n items drawn with replacement from the population."""
    rng = np.random.default_rng(seed)
    size = len(found.baseline)
    return sum(passes(found, rng.integers(0, size, n), rules, judge) for _ in range(reps)) / reps


def unchanged_population(family: str, relative: float, seed: int) -> Population:
    """The same pool with no damage (severity scale 0): perplexity keeps its per-word noise; a sentence candidate equals
    its baseline."""
    rng = np.random.default_rng(seed)
    if family == "perplexity":
        words = np.maximum(5, np.round(rng.lognormal(math.log(80.0), 0.8, PERPLEXITY_POOL))).astype(int)
        base = -words * rng.gamma(4.0, 0.5, PERPLEXITY_POOL)
        cand = base - words * rng.normal(0.0, 0.3, PERPLEXITY_POOL) / np.sqrt(words / 20.0)
        return Population(spec=_spec(family), baseline=[[float(b), int(w)] for b, w in zip(base, words, strict=True)],
                          candidate=[[float(c), int(w)] for c, w in zip(cand, words, strict=True)], worsening=0.0, share=1.0, damaged=0.0)
    refs = [" ".join(rng.choice(_VOCABULARY, int(rng.integers(5, 26)))) for _ in range(SENTENCE_POOL)]
    def rephrase(ref: str) -> str:
        return " ".join(word if rng.random() > 0.3 else str(rng.choice(_VOCABULARY)) for word in ref.split())

    baseline = [[r, rephrase(r)] for r in refs]
    candidate = [[r, rephrase(r)] for r in refs]
    metric = concentrated._sacrebleu_metric(family)
    statistics = (concentrated._sacrebleu_statistics(metric, baseline), concentrated._sacrebleu_statistics(metric, candidate))
    return Population(spec=_spec(family), baseline=baseline, candidate=candidate, worsening=0.0, share=1.0, damaged=0.0,
                      statistics=statistics)
