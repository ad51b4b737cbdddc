"""Concentrated damage on corpus metrics: a bound that keeps its promise wherever the worsening sits.

A corpus score (perplexities, bits_per_byte, BLEU, chrF, TER, f1...) can be moved by a few items: a candidate that rambles
on 2% of prompts, or whose loss explodes on a few documents. The paired bootstrap reads such damage only when the
sample holds enough of those items, and how much it under-reads depends on how unequal the damaged items are. This rule
is stated for where the damage is, not for how many items it touches.

Definition. Per item i, its contribution to the corpus worsening in the tolerance's unit (`contributions`): d_i with a
weight w_i, the corpus worsening being sum d / sum w (the true one: E[d] / E[w]) and the tolerance tau:
- perplexity (lm-eval `perplexity`, a bare loglikelihood per item): d_i = ll_base - ll_cand in nats, w_i = 1, and a
  relative tolerance r on the perplexity is tau = ln(1 + r) on Delta log PPL = mean d;
- weighted_perplexity (word/byte perplexity): w_i the item's words or bytes, Delta log PPL = sum d / sum w, tau = ln(1 + r);
- bits_per_byte (linear in the loss): a relative rise r means sum d <= r sum(-ll_base): w_i = -ll_base, tau = r;
- every other corpus score: the jackknife pseudo-value of the worsening, d_i = n W - (n - 1) W_(-i) (W the worsening of
  the whole set, W_(-i) without item i), w_i = 1, tau the tolerance in the metric's unit. sacrebleu's metrics (bleu,
  chrf, chrf++, ter) get them from their additive sentence statistics (n leave-one-out scores of summed statistics,
  0.1 s at 2,000 items); others by leaving items out (stats.deletion_effects, in groups above 2,000 items).
The *concentration share* of a worsening is the smallest fraction of items whose contributions together carry more than
half of the total worsening.

Lemma. Take a population of N items with mean contribution tau (> 0), whose top p N items (the largest contributions)
carry at most half of the total N tau, and clip every contribution to [-c, c] with c = tau / (2 p). Then the clipped mean
is at least tau / 2. Proof: the other items carry at least N tau / 2; each of them is at most the smallest of the top
items, which is at most their mean, at most (N tau / 2) / (p N) = c, so clipping leaves them unchanged from above. The
top items are all >= 0 (were one negative, every other item would be too, and they could not carry N tau / 2 > 0), so
min(x, c) >= 0 on them. Hence sum min(x, c) >= N tau / 2, and clipping from below at -c only raises a value.
With weights the same holds for d in place of x with c = tau E[w] / (2 p): E[clip(d)] >= tau E[w] / 2.

Rule. With p = damage_share, C = tau w_bar / (2 p) (w_bar the set's mean weight, 1 where w = 1) and
v_i = clip(d_i, -C, C) - (tau / 2) w_i, the candidate passes only if the betting upper bound (pipelines.gate.betting,
one-sided at the policy's confidence, over v's range [-C - tau/2 max w, C - tau/2 min w]) of E[v] is at most 0: at a
true worsening of tau with concentration share >= p, E[v] >= 0 by the lemma, so it passes at most 1 - c of the time,
whatever the severities of the damaged items (equal, exponential, lognormal, Pareto) and the lengths. Ratio-free: the
worsening's denominator E[w] enters E[v] linearly and needs no bound of its own; the clip level is the one plug-in:
the lemma holds for any clip >= tau E[w] / (2 p), and the set's mean weight stands for E[w], so where the set's mean
falls below it the clip is slightly short of the lemma's (not "a larger clip raises the clipped mean": with items that
improve it need not). The simulations (lognormal lengths) include that plug-in. The rule alone is stated at a
worsening of exactly tau; above it the bootstrap bound, which it is paired with, is what grows with the worsening.
The price: spread damage is read at half its size against a range of about
tau / p, so a set needs about twice the items a bound of the plain mean would (docs/guarantees.md gives the figures).

Minimum size: an identical candidate (every d_i = 0, w_i = 1) passes from betting.identical_items_needed(p) items: 173
at damage_share 0.02, 115 at 0.03, 68 at 0.05 (at 95%); `items_needed`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from pipelines.gate import betting, stats

# lm-eval corpus aggregations of loglikelihoods: their contributions are exact, not pseudo-values.
LOGLIKELIHOOD_AGGREGATIONS = frozenset({"perplexity", "weighted_perplexity", "bits_per_byte"})
# The share of the tolerance the clipped mean must stay under (the lemma's half).
LIMIT = 0.5


@dataclass(frozen=True)
class Contributions:
    """Per-item worsening `damage` (d_i) and `weight` (w_i): the corpus worsening is sum d / sum w; `tolerance` (tau) is
    the tightest tolerance in force in that unit."""

    damage: np.ndarray
    weight: np.ndarray
    tolerance: float


@dataclass(frozen=True)
class ClippedBound:
    """`bound`: the one-sided upper bound of the clipped mean worsening E[clip(d)] / w_bar, a share of the tolerance (the
    set passes at most LIMIT); `clip`: C / w_bar, the clip level in the same share (1 / (2 damage_share))."""

    bound: float
    clip: float

    @property
    def passed(self) -> bool:
        return self.bound <= LIMIT + 1e-9


def items_needed(damage_share: float, confidence: float) -> int:
    """The fewest items with which an identical candidate passes the rule (module docstring)."""
    needed = betting.identical_items_needed(damage_share, confidence)
    if needed is None:  # pragma: no cover - damage_share > 0 always has a size
        raise ValueError(f"no set size passes damage_share {damage_share}")
    return needed


def clipped_bound(found: Contributions, damage_share: float, confidence: float) -> ClippedBound:
    """The rule's bound (module docstring) for these contributions."""
    d, w, tau = found.damage, found.weight, found.tolerance
    if tau <= 0 or not 0.0 < damage_share <= 1.0:
        raise ValueError(f"need a positive tolerance and a damage_share in (0, 1] (got {tau}, {damage_share})")
    mean_weight = float(np.mean(w))
    clip = tau * mean_weight / (2.0 * damage_share)
    v = np.clip(d, -clip, clip) - (tau / 2.0) * w
    low, high = -clip - (tau / 2.0) * float(np.max(w)), clip - (tau / 2.0) * float(np.min(w))
    scaled = (v - low) / (high - low)
    upper = low + (high - low) * (1.0 - betting.lower_bound(1.0 - scaled, confidence))
    return ClippedBound(bound=(upper / mean_weight + tau / 2.0) / tau, clip=clip / mean_weight / tau)


# --- per-item contributions -----------------------------------------------------------------------------------------

def contributions(
    aggregation: str, baseline: Sequence[Any], candidate: Sequence[Any], *, higher_is_better: bool, allowed: float,
    baseline_score: float,
) -> Contributions:
    """The contributions of a corpus set (module docstring). `allowed`: the tightest tolerance in force in the metric's
    own units (a relative one already multiplied by |baseline_score|)."""
    if aggregation in LOGLIKELIHOOD_AGGREGATIONS:
        return _loglikelihood_contributions(aggregation, baseline, candidate, allowed / abs(baseline_score))
    sign = -1.0 if higher_is_better else 1.0
    metric = _sacrebleu_metric(aggregation)
    raw = (_jackknife_pseudo_values(aggregation, baseline, candidate) if metric is None
           else _sacrebleu_pseudo_values(metric, baseline, candidate))
    return Contributions(damage=sign * raw, weight=np.ones(raw.size), tolerance=allowed)


def _loglikelihood_contributions(aggregation: str, baseline: Sequence[Any], candidate: Sequence[Any], relative: float) -> Contributions:
    if aggregation == "perplexity":
        base = np.asarray([_number(value) for value in baseline], dtype=float)
        cand = np.asarray([_number(value) for value in candidate], dtype=float)
        return Contributions(damage=base - cand, weight=np.ones(base.size), tolerance=math.log1p(relative))
    base = np.asarray([value[0] for value in baseline], dtype=float)
    cand = np.asarray([value[0] for value in candidate], dtype=float)
    if aggregation == "bits_per_byte":  # bpb_cand <= (1 + r) bpb_base  <=>  sum d <= r sum(-ll_base)
        return Contributions(damage=base - cand, weight=-base, tolerance=relative)
    weight = np.asarray([value[1] for value in baseline], dtype=float)
    return Contributions(damage=base - cand, weight=weight, tolerance=math.log1p(relative))


def _number(value: Any) -> float:
    return float(value[0]) if isinstance(value, list) else float(value)


@cache
def _sacrebleu_metric(aggregation: str) -> Any:
    """The sacrebleu metric lm-eval's aggregation of this name computes (its defaults), or None."""
    from sacrebleu.metrics import BLEU, CHRF, TER  # heavy: imported when used

    found = {"bleu": BLEU, "chrf": CHRF, "ter": TER}.get(aggregation)
    if aggregation == "chrf++":
        return CHRF(word_order=2)
    return None if found is None else found()


def _sacrebleu_statistics(metric: Any, items: Sequence[Any]) -> np.ndarray:
    """Per-sentence statistics, formatted as lm-eval's aggregation formats [reference, prediction] items."""
    from lm_eval.api.metrics import _sacreformat  # heavy: imported when used

    refs, preds = _sacreformat([item[0] for item in items], [item[1] for item in items])
    return np.asarray(metric._extract_corpus_statistics(preds, refs), dtype=float)


def _sacrebleu_pseudo_values(metric: Any, baseline: Sequence[Any], candidate: Sequence[Any]) -> np.ndarray:
    """n D - (n - 1) D_(-i), D = score(candidate) - score(baseline), from additive sentence statistics."""
    scores = []
    for items in (baseline, candidate):
        rows = _sacrebleu_statistics(metric, items)
        total = rows.sum(axis=0)
        whole = float(metric._compute_score_from_stats(list(total)).score)
        left_out = np.asarray([float(metric._compute_score_from_stats(list(total - row)).score) for row in rows])
        scores.append((whole, left_out))
    (base_whole, base_out), (cand_whole, cand_out) = scores
    n = len(baseline)
    return n * (cand_whole - base_whole) - (n - 1) * (cand_out - base_out)


def _jackknife_pseudo_values(aggregation: str, baseline: Sequence[Any], candidate: Sequence[Any]) -> np.ndarray:
    """Pseudo-values of D = aggregate(candidate) - aggregate(baseline) by leaving items (or groups) out."""
    from pipelines.evaluation.metrics import corpus_aggregation

    aggregate = corpus_aggregation(aggregation)
    whole = float(aggregate(list(candidate))) - float(aggregate(list(baseline)))
    effects = stats.deletion_effects(aggregate, list(baseline), list(candidate))
    groups = effects.size
    return whole - (groups - 1) * effects
