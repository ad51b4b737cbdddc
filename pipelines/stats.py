"""Paired statistics for comparing a candidate model with its baseline on the same items.

Every function takes per-item scores in the same order for both models (item i of `baseline` and item i
of `candidate` are the same question). Results are in the metric's own units; callers scale them.

Which interval a set gets (docs/gate-json.md, "Intervals"):
- pass/fail metrics: Tango's asymptotic score interval for a difference of paired proportions
  (`tango_interval`). It depends only on the discordant counts and n, and keeps a width of
  z^2 / (n + z^2) on each side when nothing flipped (0.161 at n = 20, 0.015 at n = 250).
- per-item numbers averaged: a paired BCa bootstrap (scipy.stats.bootstrap), widened to at least
  `width_floor` on each side, so that a set on which nothing moved cannot show non-inferiority alone.
- corpus-level metrics (f1, bleu, perplexity...): a paired percentile bootstrap of the difference of
  the two aggregates over resampled items, with the same floor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import brentq
from scipy.stats import binomtest, bootstrap, norm

CONFIDENCE = 0.95
RESAMPLES = 10_000
CORPUS_RESAMPLES = 2_000
SEED = 0
ALPHA = 0.05
POWER = 0.8
Aggregate = Callable[[list], float]


def _paired(baseline: ArrayLike, candidate: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    base = np.asarray(baseline, dtype=float)
    cand = np.asarray(candidate, dtype=float)
    if base.ndim != 1 or base.shape != cand.shape or base.size == 0:
        raise ValueError(f"need two non-empty 1-d arrays of equal length (got {base.shape} and {cand.shape})")
    return base, cand


@dataclass(frozen=True)
class Flips:
    """Pass/fail items whose outcome changed: right->wrong (lost) and wrong->right (gained)."""

    right_to_wrong: int
    wrong_to_right: int
    n: int

    @property
    def right_to_wrong_rate(self) -> float:
        return self.right_to_wrong / self.n

    @property
    def wrong_to_right_rate(self) -> float:
        return self.wrong_to_right / self.n

    @property
    def discordance_rate(self) -> float:
        """Fraction of items on which the two models disagree."""
        return (self.right_to_wrong + self.wrong_to_right) / self.n


def flips(baseline: ArrayLike, candidate: ArrayLike) -> Flips:
    """Count outcome changes between two 0/1 score vectors (1 = right)."""
    base, cand = _paired(baseline, candidate)
    if not np.isin(base, (0.0, 1.0)).all() or not np.isin(cand, (0.0, 1.0)).all():
        raise ValueError("flips need pass/fail scores (0 or 1)")
    return Flips(
        right_to_wrong=int(np.sum((base == 1) & (cand == 0))),
        wrong_to_right=int(np.sum((base == 0) & (cand == 1))),
        n=base.size,
    )


def mcnemar_exact_p(right_to_wrong: int, wrong_to_right: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of the discordant pairs against p = 1/2.

    Concordant items carry no information about a difference; with no discordant pair p is 1.
    """
    discordant = right_to_wrong + wrong_to_right
    if discordant == 0:
        return 1.0
    return float(binomtest(right_to_wrong, discordant, 0.5, alternative="two-sided").pvalue)


@dataclass(frozen=True)
class KLSummary:
    mean: float
    max: float
    items: int


def kl_summary(per_item_kl: list[float | None]) -> KLSummary | None:
    """Mean and max of per-item mean per-token KL (nats/token); items weigh equally. None if none measured."""
    measured = np.asarray([value for value in per_item_kl if value is not None], dtype=float)
    if measured.size == 0:
        return None
    return KLSummary(mean=float(measured.mean()), max=float(measured.max()), items=int(measured.size))


def _z_sum(alpha: float, power: float) -> float:
    """z(1 - alpha/2) + z(power): 1.960 + 0.842 = 2.80 at the defaults."""
    normal = NormalDist()
    return normal.inv_cdf(1.0 - alpha / 2.0) + normal.inv_cdf(power)


def min_detectable_drop_binary(n: int, discordance_rate: float, *, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest drop (fraction) in a pass/fail score that n paired items detect at this alpha and power.

    Normal approximation to McNemar's test (Connor 1987): the per-item difference d in {-1, 0, 1} has
    variance psi - delta^2, where psi is the discordance rate; dropping the delta^2 term (conservative)
    gives  drop = k * sqrt(psi / n),  k = z(1 - alpha/2) + z(power).
    psi is the observed discordance rate, but never below the drop itself: a true drop of delta needs
    at least a fraction delta of items to flip right->wrong. Solving that gives
        drop = max(k * sqrt(psi_observed / n), k^2 / n),
    so a candidate identical to its baseline still gets an honest floor of k^2/n (3.1 points at n=250).
    """
    if n <= 0:
        raise ValueError("n must be positive")
    k = _z_sum(alpha, power)
    return float(max(k * np.sqrt(discordance_rate / n), k * k / n))


def min_detectable_drop_continuous(
    n: int, diff_sd: float, *, alpha: float = ALPHA, power: float = POWER
) -> float:
    """Smallest mean drop that n paired items detect: k * sd(differences) / sqrt(n) (normal approximation)."""
    if n <= 0:
        raise ValueError("n must be positive")
    return float(_z_sum(alpha, power) * diff_sd / np.sqrt(n))


def _z(confidence: float) -> float:
    return float(norm.ppf(1.0 - (1.0 - confidence) / 2.0))


def _tango_score(delta0: float, losses: int, gains: int, n: int) -> float:
    """Tango's score statistic for H0: p(gain) - p(loss) = delta0, with p(loss) at its restricted MLE.

    The restricted MLE of p(loss) is the positive root of
    2n x^2 + (-(losses + gains) + delta0 (2n + losses - gains)) x - losses delta0 (1 - delta0) = 0.
    """
    b_coef = -(losses + gains) + delta0 * (2 * n + losses - gains)
    c_coef = -losses * delta0 * (1.0 - delta0)
    p_loss = (np.sqrt(max(b_coef * b_coef - 8.0 * n * c_coef, 0.0)) - b_coef) / (4.0 * n)
    variance = n * (2.0 * p_loss + delta0 * (1.0 - delta0))
    return float((gains - losses - n * delta0) / np.sqrt(max(variance, 1e-300)))


def tango_interval(losses: int, gains: int, n: int, *, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Tango's (1998) asymptotic score interval for delta = p(candidate right) - p(baseline right).

    `losses`: items right -> wrong, `gains`: wrong -> right, of n paired items. The interval is every
    delta0 the score test does not reject; its bounds are found with brentq. Known answer (Fagerland,
    Lydersen and Laake 2014, Cavo et al. data): losses 16, gains 6, n 161 -> (-0.1240, -0.0054).
    """
    if not (losses >= 0 and gains >= 0 and losses + gains <= n and n > 0):
        raise ValueError(f"need 0 <= losses + gains <= n (got {losses}, {gains}, {n})")
    z = _z(confidence)
    estimate = (gains - losses) / n
    edge = 1e-12

    def excess(delta0: float) -> float:
        if abs(delta0 - estimate) < edge:
            return -z
        return abs(_tango_score(delta0, losses, gains, n)) - z

    low = -1.0 if estimate <= -1.0 + edge or excess(-1.0 + edge) < 0 else brentq(excess, -1.0 + edge, estimate, xtol=1e-12)
    high = 1.0 if estimate >= 1.0 - edge or excess(1.0 - edge) < 0 else brentq(excess, estimate, 1.0 - edge, xtol=1e-12)
    return float(low), float(high)


def wilson_lower_bound(successes: int, n: int, *, confidence: float = CONFIDENCE) -> float:
    """One-sided lower confidence bound of a binomial proportion (Wilson score, via scipy)."""
    two_sided = 1.0 - 2.0 * (1.0 - confidence)
    return float(binomtest(successes, n).proportion_ci(confidence_level=two_sided, method="wilson").low)


def width_floor(n: int, value_range: float, *, confidence: float = CONFIDENCE) -> float:
    """Smallest half-width an interval may claim: value_range * z^2 / (n + z^2).

    The zero-discordance width of Tango's interval, scaled by how far one item can move the mean: a
    set on which nothing changed cannot rule out that up to z^2/(n+z^2) of items would change elsewhere.
    """
    z = _z(confidence)
    return float(value_range * z * z / (n + z * z))


def _floored(estimate: float, low: float, high: float, floor: float) -> tuple[float, float]:
    return min(low, estimate - floor), max(high, estimate + floor)


def mean_difference_interval(
    baseline: ArrayLike,
    candidate: ArrayLike,
    *,
    value_range: float,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """(delta, low, high) of mean(candidate - baseline): paired BCa bootstrap widened to width_floor."""
    base, cand = _paired(baseline, candidate)
    diffs = cand - base
    delta = float(diffs.mean())
    if np.ptp(diffs) == 0 or diffs.size < 3:
        low, high = delta, delta  # BCa is undefined on constant data; the floor gives the width
    else:
        result = bootstrap(
            (diffs,), np.mean, confidence_level=confidence, n_resamples=resamples, method="BCa",
            rng=np.random.default_rng(seed), vectorized=True,
        )
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    low, high = _floored(delta, low, high, width_floor(diffs.size, value_range, confidence=confidence))
    return delta, low, high


def corpus_difference_interval(
    aggregate: Aggregate,
    baseline: list,
    candidate: list,
    *,
    value_range: float,
    confidence: float = CONFIDENCE,
    resamples: int = CORPUS_RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float, float, float]:
    """(baseline score, candidate score, low, high) for a corpus-level metric.

    Items are resampled in pairs; each resample's difference is aggregate(candidate) - aggregate(baseline).
    Percentile interval widened to width_floor. Returns the full-set scores, not the resample mean.
    """
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError(f"need two non-empty lists of equal length (got {len(baseline)} and {len(candidate)})")
    n = len(baseline)
    base_score, cand_score = float(aggregate(baseline)), float(aggregate(candidate))
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    for index in range(resamples):
        picks = rng.integers(0, n, size=n)
        diffs[index] = aggregate([candidate[i] for i in picks]) - aggregate([baseline[i] for i in picks])
    tail = (1.0 - confidence) / 2.0
    low, high = (float(q) for q in np.quantile(diffs, [tail, 1.0 - tail]))
    low, high = _floored(cand_score - base_score, low, high, width_floor(n, value_range, confidence=confidence))
    return base_score, cand_score, low, high



def min_detectable_drop_from_interval(
    half_width: float, *, confidence: float = CONFIDENCE, alpha: float = ALPHA, power: float = POWER
) -> float:
    """Normal theory on an interval's half-width: the standard error (half-width / z) times k."""
    return float(half_width / _z(confidence) * _z_sum(alpha, power))
