"""Paired statistics for comparing a candidate model with its baseline on the same items.

Every function takes per-item scores in the same order for both models (item i of `baseline` and item i
of `candidate` are the same question). Results are in the metric's own units; callers scale them.

Which interval a set gets (docs/gate-json.md, "Intervals"):
- pass/fail metrics: Tango's score interval for a difference of paired proportions (`tango_interval`); the bound the
  tolerance reads is taken at the critical value calibrated per n (pipelines.gate.exact), so that a true worsening of
  exactly the tolerance passes at most 1 - c of the time under the multinomial model, whatever the split.
- per-item numbers averaged: the betting bound for a bounded mean (pipelines.gate.betting), valid at every n for every
  distribution of the changes (skewed, heavy-tailed, a few items broken outright).
- corpus-level metrics (f1, bleu, perplexity...): a paired percentile bootstrap of the difference of the two
  aggregates over resampled items, each end moved out by a rare-damage allowance (-ln(1 - c) times the largest pull
  of one item, found by leaving each out) and kept at least the zero-count floor from the estimate; beside it the
  concentrated-damage rule (pipelines.gate.concentrated) bounds a worsening whatever its severities.

Confidence: a two-sided interval at level L has each bound a one-sided bound at (1 + L) / 2; the gate's
rules read one-sided bounds at the policy's `confidence` (0.95: the two-sided 90% interval's bounds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import brentq
from scipy.stats import beta, binom, binomtest, norm

from pipelines.gate import betting

CONFIDENCE = 0.95
RESAMPLES = 10_000
CORPUS_RESAMPLES = 2_000
JACKKNIFE_GROUPS = 2_000
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
    """The two-sided quantile: z(1 - (1 - confidence) / 2), 1.960 at 0.95."""
    return float(norm.ppf(1.0 - (1.0 - confidence) / 2.0))


def z_one_sided(confidence: float) -> float:
    """The one-sided quantile z(confidence): 1.645 at 0.95."""
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"a one-sided confidence lies in [0.5, 1) (got {confidence})")
    return float(norm.ppf(confidence))


def two_sided_level(confidence: float) -> float:
    """The two-sided interval whose bounds are one-sided bounds at `confidence`: 2 c - 1 (0.90 for 0.95)."""
    return 2.0 * confidence - 1.0


def _tango_score(delta0: float, losses: float, gains: float, n: int) -> float:
    """Tango's score statistic for H0: p(gain) - p(loss) = delta0, with p(loss) at its restricted MLE.

    The restricted MLE of p(loss) is the positive root of
    2n x^2 + (-(losses + gains) + delta0 (2n + losses - gains)) x - losses delta0 (1 - delta0) = 0.
    """
    b_coef = -(losses + gains) + delta0 * (2 * n + losses - gains)
    c_coef = -losses * delta0 * (1.0 - delta0)
    p_loss = (np.sqrt(max(b_coef * b_coef - 8.0 * n * c_coef, 0.0)) - b_coef) / (4.0 * n)
    variance = n * (2.0 * p_loss + delta0 * (1.0 - delta0))
    return float((gains - losses - n * delta0) / np.sqrt(max(variance, 1e-300)))


_EDGE = 1e-12


def _tango_end(losses: float, gains: float, n: int, z: float, side: int) -> float:
    """One end of Tango's interval: the delta0 on `side` (-1 low, +1 high) where |score| reaches z."""
    estimate = (gains - losses) / n

    def excess(delta0: float) -> float:
        if abs(delta0 - estimate) < _EDGE:
            return -z
        return abs(_tango_score(delta0, losses, gains, n)) - z

    if side < 0:
        if estimate <= -1.0 + _EDGE or excess(-1.0 + _EDGE) < 0:
            return -1.0
        return float(brentq(excess, -1.0 + _EDGE, estimate, xtol=1e-12))
    if estimate >= 1.0 - _EDGE or excess(1.0 - _EDGE) < 0:
        return 1.0
    return float(brentq(excess, estimate, 1.0 - _EDGE, xtol=1e-12))


def _check_table(losses: float, gains: float, n: int) -> None:
    if not (losses >= 0 and gains >= 0 and losses + gains <= n * (1 + 1e-12) and n > 0):
        raise ValueError(f"need 0 <= losses + gains <= n (got {losses}, {gains}, {n})")


def tango_interval(losses: float, gains: float, n: int, *, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Tango's (1998) asymptotic score interval for delta = p(candidate right) - p(baseline right).

    `losses`: items right -> wrong, `gains`: wrong -> right, of n paired items (counts; real numbers are
    accepted, see paired_score_interval). The interval is every delta0 the score test does not reject; its
    bounds are found with brentq. Known answer (Fagerland, Lydersen and Laake 2014, Cavo et al. data):
    losses 16, gains 6, n 161 -> (-0.1240, -0.0054).
    """
    _check_table(losses, gains, n)
    z = _z(confidence)
    return _tango_end(losses, gains, n, z, -1), _tango_end(losses, gains, n, z, +1)


def tango_lower_bound(losses: float, gains: float, n: int, *, confidence: float = CONFIDENCE, z: float | None = None) -> float:
    """One-sided lower confidence bound of delta at `confidence` (the low end of the 2c - 1 two-sided interval), or at the
    critical value `z` when given (pipelines.gate.exact.critical_value: calibrated per n; infinite: -1, nothing passes)."""
    _check_table(losses, gains, n)
    critical = z_one_sided(confidence) if z is None else z
    return -1.0 if math.isinf(critical) else _tango_end(losses, gains, n, critical, -1)


def exact_lower_bound(successes: int, n: int, *, confidence: float = CONFIDENCE) -> float:
    """One-sided Clopper-Pearson lower confidence bound of a binomial proportion (scipy's binomtest, method "exact"):
    the `1 - confidence` quantile of Beta(successes, n - successes + 1), 0 with no success. P(bound > true p) <= 1 - c
    for every p (Wilson's bound exceeds that by discreteness: 7.6% at p = 0.03, n = 250). The quantile itself
    (scipy.stats.beta), not binomtest's root search for it: the same bound within 1e-9 (tests/unit/gate/test_stats.py),
    and the gate's every-size audit, which evaluates it for every table, ran 5x faster (391 s -> 76 s)."""
    if not (isinstance(n, int | np.integer) and isinstance(successes, int | np.integer) and 0 <= successes <= n and n >= 1):
        raise ValueError(f"exact_lower_bound needs 0 <= successes <= n and n >= 1 (got {successes} of {n})")
    return 0.0 if successes == 0 else float(beta.ppf(1.0 - confidence, successes, n - successes + 1))


def mean_difference_interval(
    baseline: ArrayLike,
    candidate: ArrayLike,
    *,
    value_range: float,
    confidence: float = CONFIDENCE,
) -> tuple[float, float, float]:
    """(delta, low, high) of mean(candidate - baseline): the betting bounds (pipelines.gate.betting), each end one-sided
    at (1 + confidence) / 2, for per-item values within a range of `value_range`.

    It replaced Tango's score interval on effective counts, whose one-sided miss reached 11% when a few items broke
    outright and many moved slightly (and, before it, a BCa bootstrap that covered 0.918 at n = 250)."""
    base, cand = _paired(baseline, candidate)
    diffs = cand - base
    low, high = betting.mean_bounds(diffs, value_range, (1.0 + confidence) / 2.0)
    return float(diffs.mean()), low, high


def corpus_bootstrap(
    aggregate: Aggregate, baseline: list, candidate: list, *, resamples: int = CORPUS_RESAMPLES, seed: int = SEED,
) -> tuple[float, float, np.ndarray]:
    """(baseline score, candidate score, resampled differences): items resampled in pairs (numpy's default_rng(seed)),
    each resample's difference aggregate(candidate) - aggregate(baseline)."""
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError(f"need two non-empty lists of equal length (got {len(baseline)} and {len(candidate)})")
    n = len(baseline)
    base_score, cand_score = float(aggregate(baseline)), float(aggregate(candidate))
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    for index in range(resamples):
        picks = rng.integers(0, n, size=n)
        diffs[index] = aggregate([candidate[i] for i in picks]) - aggregate([baseline[i] for i in picks])
    return base_score, cand_score, diffs


def deletion_effects(aggregate: Aggregate, baseline: list, candidate: list, *, max_groups: int = JACKKNIFE_GROUPS) -> np.ndarray:
    """For each item, D(without it) - D, D = aggregate(candidate) - aggregate(baseline): how much the item pulls the
    difference down (positive) or up (negative). Above `max_groups` items, consecutive groups of ceil(n / max_groups)
    items are left out instead (n aggregate calls would cost more than the bootstrap)."""
    n = len(baseline)
    whole = float(aggregate(candidate)) - float(aggregate(baseline))
    if n < 2:
        return np.zeros(1)
    size = math.ceil(n / max_groups)
    effects = []
    for start in range(0, n, size):
        kept = list(range(start)) + list(range(start + size, n))
        if not kept:
            effects.append(0.0)
            continue
        effects.append(float(aggregate([candidate[i] for i in kept])) - float(aggregate([baseline[i] for i in kept])) - whole)
    return np.asarray(effects)


def percentile_interval(
    diffs: np.ndarray, estimate: float, n: int, *, value_range: float, confidence: float = CONFIDENCE, effects: np.ndarray | None = None,
) -> tuple[float, float]:
    """The percentile interval of resampled differences (numpy's default quantile), each end moved out by the rare-damage
    allowance (rare_damage_allowance, when `effects` are given) and kept at least value_range x zero_count_bound from
    the estimate (the one-sided level of each end: (1 + confidence) / 2)."""
    tail = (1.0 - confidence) / 2.0
    low, high = (float(q) for q in np.quantile(diffs, [tail, 1.0 - tail]))
    if effects is not None:
        low -= rare_damage_allowance(effects, 1.0 - tail)
        high += rare_damage_allowance(-effects, 1.0 - tail)
    floor = value_range * zero_count_bound(n, confidence=1.0 - tail)
    return min(low, estimate - floor), max(high, estimate + floor)


def rare_damage_allowance(effects: np.ndarray, one_sided: float) -> float:
    """-ln(1 - c) times the largest pull one item has (max of effects, 0 if none pulls): room for damage the sample
    holds fewer of than the population. When damage sits in a few items, each pulling the score by about D, a sample
    that drew k of them gives a bootstrap bound of about D (k + z sqrt(k)); the exact (Poisson) bound on their count
    is about D (k + z sqrt(k) + 1.6 to 3): -ln(1 - c) = 3.0 items of the worst one seen covers the difference. Where
    the change is spread over many items the largest pull is small and so is the allowance."""
    return float(-math.log(1.0 - one_sided) * max(0.0, float(np.max(effects)) if effects.size else 0.0))


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
    Percentile interval with the rare-damage allowance and the zero-count floor (percentile_interval). Returns the
    full-set scores, not the resample mean.
    """
    base_score, cand_score, diffs = corpus_bootstrap(aggregate, baseline, candidate, resamples=resamples, seed=seed)
    effects = deletion_effects(aggregate, baseline, candidate)
    low, high = percentile_interval(
        diffs, cand_score - base_score, len(baseline), value_range=value_range, confidence=confidence, effects=effects,
    )
    return base_score, cand_score, low, high


def min_detectable_drop_from_interval(
    half_width: float, *, confidence: float = CONFIDENCE, alpha: float = ALPHA, power: float = POWER
) -> float:
    """Normal theory on an interval's half-width: the standard error (half-width / z) times k."""
    return float(half_width / _z(confidence) * _z_sum(alpha, power))


# --- sizing: what a set of n items can certify --------------------------------------------------------------

def identical_floor(n: int, *, confidence: float = CONFIDENCE, z: float | None = None) -> float:
    """The one-sided bound (a fraction of the value range) Tango's test gives an identical candidate: z^2 / (n + z^2),
    z = z(confidence) or the critical value given (1 when it is infinite)."""
    critical = z_one_sided(confidence) if z is None else z
    return 1.0 if math.isinf(critical) else critical * critical / (n + critical * critical)


def zero_count_bound(n: int, *, confidence: float = CONFIDENCE) -> float:
    """Clopper-Pearson's one-sided upper bound of a rate never seen in n draws: 1 - (1 - c)^(1/n) (about 3 / n at 0.95).

    The floor of the averaged and corpus bounds, as a fraction of one item's reach: a set on which nothing changed cannot
    rule out that this share of items would change elsewhere. It fits a tolerance T from n >= ln(1 - c) / ln(1 - T)
    items, the exact minimum of the pass/fail test too (a candidate losing a share T of items shows no loss at all with
    probability (1 - T)^n)."""
    return float(1.0 - (1.0 - confidence) ** (1.0 / n))


def zero_count_items_needed(tolerance: float, *, confidence: float = CONFIDENCE) -> int:
    """Fewest items with zero_count_bound(n) <= tolerance: ceil(ln(1 - c) / ln(1 - T))."""
    if tolerance <= 0.0:
        raise ValueError("tolerance must be positive")
    if tolerance >= 1.0:
        return 1
    return max(1, math.ceil(math.log(1.0 - confidence) / math.log(1.0 - tolerance) - 1e-9))


def tango_null_variance(tolerance: float, discordance: float) -> float:
    """Per-item variance of the paired difference at Tango's restricted MLE under H0: delta = -tolerance, for a
    table whose losses and gains are discordance / 2 each (Nam 1997's planning value)."""
    delta0, half = -tolerance, discordance / 2.0
    b_coef = -discordance + 2.0 * delta0
    c_coef = -half * delta0 * (1.0 - delta0)
    p_loss = (math.sqrt(max(b_coef * b_coef - 8.0 * c_coef, 0.0)) - b_coef) / 4.0
    return 2.0 * p_loss + delta0 * (1.0 - delta0)


def items_needed(tolerance: float, discordance: float, *, confidence: float = CONFIDENCE, power: float = POWER) -> int:
    """Items an unchanged candidate (true delta 0, discordance psi) needs to pass a tolerance T with probability `power`.

    Nam (1997), non-inferiority of paired proportions with Tango's score test:
        n = ((z(c) sqrt(V0) + z(power) sqrt(psi)) / T)^2,
    V0 = tango_null_variance(T, psi). With psi = 0 it is ceil(z_c^2 (1 - T) / T), the asymptotic identical minimum
    (callers take at least the calibrated test's exact one: pipelines.gate.identical).
    """
    if not 0.0 < tolerance < 1.0:
        raise ValueError(f"tolerance must lie in (0, 1) (got {tolerance})")
    if not 0.0 <= discordance <= 1.0:
        raise ValueError(f"discordance must lie in [0, 1] (got {discordance})")
    root = z_one_sided(confidence) * math.sqrt(tango_null_variance(tolerance, discordance)) + norm.ppf(power) * math.sqrt(discordance)
    return max(1, math.ceil((root / tolerance) ** 2 - 1e-9))


def certifiable_tolerance(n: int, discordance: float, *, confidence: float = CONFIDENCE, power: float = POWER) -> float:
    """The smallest tolerance (a fraction) n items certify for an unchanged candidate with `power`: items_needed inverted."""
    if n <= 0:
        raise ValueError("n must be positive")

    def gap(tolerance: float) -> float:
        root = z_one_sided(confidence) * math.sqrt(tango_null_variance(tolerance, discordance)) + norm.ppf(power) * math.sqrt(discordance)
        return root / tolerance - math.sqrt(n)

    if gap(1.0 - 1e-9) > 0:
        return 1.0
    return float(brentq(gap, 1e-9, 1.0 - 1e-9, xtol=1e-12))


def normal_certifiable_tolerance(se: float, floor: float, *, confidence: float = CONFIDENCE, power: float = POWER) -> float:
    """The same for an interval with standard error `se` and a floor on its one-sided reach:
    max(z(c) se, floor) + z(power) se (an unchanged candidate's estimate is N(0, se))."""
    return max(z_one_sided(confidence) * se, floor) + float(norm.ppf(power)) * se


def smallest_n(fits: Callable[[int], bool], *, start: int = 1, limit: int = 10**9) -> int | None:
    """The smallest n >= start with fits(n), for fits monotone in n (False then True); None if not even at `limit`."""
    if not fits(limit):
        return None
    low, high = start, limit
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return low


# --- how often a candidate is rejected: exact over the binomial distribution of the 2x2 table ----------------

def unchanged_flip_probabilities(discordance: float, baseline_right: int, n: int) -> tuple[float, float]:
    """(P(lose) per baseline-right item, P(gain) per baseline-wrong item) of an unchanged candidate (true delta 0)
    that disagrees with the baseline on a fraction psi of items: psi/2 / score and psi/2 / (1 - score). psi is capped
    at 2 min(score, 1 - score), the most an unchanged candidate can disagree (none on a baseline of 100%)."""
    score = baseline_right / n
    psi = min(discordance, 2.0 * min(score, 1.0 - score))
    lose = psi / 2.0 / score if score > 0 else 0.0
    gain = psi / 2.0 / (1.0 - score) if score < 1 else 0.0
    return min(lose, 1.0), min(gain, 1.0)


def table_probability(
    rejects: Callable[[int, int], bool], n: int, baseline_right: int, p_lose: float, p_gain: float, *, mass: float = 1e-12,
) -> float:
    """P(rejects(L, G)) for L ~ Binomial(baseline_right, p_lose) and G ~ Binomial(n - baseline_right, p_gain),
    independent (scipy.stats.binom), where rejects is non-decreasing in L and non-increasing in G (more losses never
    help, more gains never hurt): every rule of the gate on a pass/fail set is.

    For each G with pmf above `mass` (ascending) the smallest rejected L is found (by bisection for the first G, then
    by stepping up from the previous one), and P(L >= it) is added, weighted by P(G): exact up to the dropped tails
    (at most `mass` per G value)."""
    wrong = n - baseline_right
    gains = np.arange(wrong + 1)
    gain_pmf = binom.pmf(gains, wrong, p_gain)
    loss_dist = binom(baseline_right, p_lose)
    total, threshold = 0.0, None
    for gain in gains[gain_pmf > mass]:
        g = int(gain)
        if threshold is None:
            low, high = 0, baseline_right + 1  # high: "no L rejects"
            while low < high:
                middle = (low + high) // 2
                if rejects(middle, g):
                    high = middle
                else:
                    low = middle + 1
            threshold = low
        else:
            while threshold <= baseline_right and not rejects(threshold, g):
                threshold += 1
        if threshold > baseline_right:
            break  # no L rejects at this G, nor at any larger G
        total += float(gain_pmf[g]) * float(loss_dist.sf(threshold - 1))
    return min(max(total, 0.0), 1.0)


def any_rejects(probabilities: list[float]) -> float:
    """P(at least one of independent events): 1 - prod(1 - p)."""
    return float(1.0 - np.prod([1.0 - p for p in probabilities]))
