"""Paired statistics for comparing a candidate model with its baseline on the same items.

Every function takes per-item scores in the same order for both models (item i of `baseline` and item i
of `candidate` are the same question). Scores are fractions in [0, 1]; callers convert to points.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import binomtest

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
ALPHA = 0.05
POWER = 0.8
# Largest block of bootstrap indices (resamples x items) held at once: 32 MB.
_BLOCK_CELLS = 4_000_000


def _paired(baseline: ArrayLike, candidate: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    base = np.asarray(baseline, dtype=float)
    cand = np.asarray(candidate, dtype=float)
    if base.ndim != 1 or base.shape != cand.shape or base.size == 0:
        raise ValueError(f"need two non-empty 1-d arrays of equal length (got {base.shape} and {cand.shape})")
    return base, cand


def paired_bootstrap_ci(
    baseline: ArrayLike,
    candidate: ArrayLike,
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """Mean difference (candidate - baseline) and its percentile bootstrap confidence interval.

    Items are resampled in pairs, with replacement, `resamples` times (vectorised, in blocks that
    bound memory). Returns (delta, low, high) in score units; the same seed gives the same interval.
    """
    base, cand = _paired(baseline, candidate)
    diffs = cand - base
    n = diffs.size
    rng = np.random.default_rng(seed)
    block = max(1, _BLOCK_CELLS // n)
    means = np.concatenate(
        [
            diffs[rng.integers(0, n, size=(min(block, resamples - start), n))].mean(axis=1)
            for start in range(0, resamples, block)
        ]
    )
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(diffs.mean()), float(low), float(high)


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
