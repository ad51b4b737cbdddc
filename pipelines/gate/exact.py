"""Pass/fail sets: Tango's score test at the tolerance with its critical value calibrated per n, and the exact
probability that a candidate is promoted under the multinomial model.

The sampling model: n items drawn independently from a population in which the candidate loses an item the
baseline had right with probability p_lose and gains one it had wrong with probability p_gain, so (losses, gains,
concordant) ~ Multinomial(n, (p_lose, p_gain, 1 - p_lose - p_gain)); the true worsening is p_lose - p_gain. Tango's
interval is derived under this model; the project's older figures held the baseline's score fixed instead
(`pipelines.gate.stats.table_probability`).

A set passes its tolerance T when the one-sided bound of the worsening is within T, which is Tango's score test of
H0: worsening >= T rejected: Z_T(L, G) >= z, Z_T the score statistic at delta0 = -T. With z the normal quantile
z(c) the test is asymptotic: at small n a candidate that only loses answers (p_gain = 0, where Tango's bound is
Wilson's) passes a true worsening of T up to 7% of the time at c = 0.95. `critical_value(n, T, c)` is the smallest
z >= z(c) with

    sup over p_gain in [0, (1 - T) / 2] of P(Z_T(L, G) >= z | p_lose = p_gain + T) <= 1 - c,

an exact unconditional test in the sense of Berger and Boos (the supremum over the nuisance parameter; Z_T orders
the tables). The supremum is taken on a grid of splits and then checked on a finer grid and by local maximisation
(scipy's bounded minimize_scalar) around the largest values; where the check finds an excess the critical value
moves up to the next table. The same z must also hold the rate with the baseline's right/wrong fixed per item
(`fixed_region_probability`: L ~ Binomial(R, q_lose) among its R right items, G ~ Binomial(n - R, q_gain) among the
rest, R q_lose - (n - R) q_gain = n T): checked for baselines wrong on 1 to FEW_WRONG items, where that model's
supremum sits (one wrong item reached 5.23% at n = 216 under the multinomial-only value), and at the scores of
FIXED_BASELINES; an excess moves z above that model's own boundary. Above COARSE_START_MAX_N items the search starts
at z(c); above CALIBRATED_MAX_N z is z(c) plus a stated margin. When no z can hold the rate (fewer than
ln(1 - c) / ln(1 - T) items: a candidate losing a share T of items shows no loss at all more than 1 - c of the
time) it is infinite: nothing passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import bdtrc, gammaln, xlog1py, xlogy
from scipy.stats import binom, norm

# Up to this many items the search starts from the boundaries of a coarse grid of splits (many tables to cross at
# small n); above it from z(c), a few tables below the answer, and the checks move it there (z(c) itself passed 5.08%).
COARSE_START_MAX_N = 20_000
# Calibrated exactly up to this many items (6 s at most); above it z(c) plus LATTICE_STEPS steps of the loss count's
# lattice, 1 / sqrt(n T (1 - T)) each in Z: the excess of z(c) is at most about one step (one pmf term of the losses
# at the edge, plus a skewness shift of about a quarter step), checked by exact sums at sampled sizes to 2,000,000
# (`gate_guarantees large`). Exact calibration costs 39 s and 0.2 GB at 1,000,000 items, 244 s and 4 GB at 2,000,000.
CALIBRATED_MAX_N = 200_000
LATTICE_STEPS = 2.0
# The fixed-baseline model is checked at these baselines: wrong on 1..FEW_WRONG items, and these scores.
FEW_WRONG = 4
FIXED_BASELINES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
_FIXED_SPLITS = 41
_COARSE_SPLITS = 32
_FINE_SPLITS = 128
_TAIL = 1e-12  # probability left out on each side of a binomial when the tables are enumerated
_TIE = 1e-11  # Z values closer than this are one value
_WHOLE_RANGE = 400


def tango_statistic(losses: np.ndarray, gains: np.ndarray, n: int, tolerance: float) -> np.ndarray:
    """Tango's score statistic for H0: p_gain - p_lose = -tolerance, vectorised (pipelines.gate.stats._tango_score)."""
    delta0 = -tolerance
    losses, gains = np.asarray(losses, dtype=float), np.asarray(gains, dtype=float)
    b_coef = -(losses + gains) + delta0 * (2 * n + losses - gains)
    c_coef = -losses * delta0 * (1.0 - delta0)
    p_loss = (np.sqrt(np.maximum(b_coef * b_coef - 8.0 * n * c_coef, 0.0)) - b_coef) / (4.0 * n)
    variance = n * (2.0 * p_loss + delta0 * (1.0 - delta0))
    return (gains - losses - n * delta0) / np.sqrt(np.maximum(variance, 1e-300))


def _pmf(k: np.ndarray, n: np.ndarray | int, p: float) -> np.ndarray:
    """Binomial pmf through log-gamma (scipy.stats' own pmf costs more in argument checks than in arithmetic here)."""
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    log = gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1) + xlogy(k, p) + xlog1py(n - k, -p)
    return np.where((k >= 0) & (k <= n), np.exp(log), 0.0)


def _sf(k: np.ndarray, n: np.ndarray | int, p: float) -> np.ndarray:
    """P(Binomial(n, p) > k) (scipy.special.bdtrc), 1 for k < 0 and 0 for k >= n."""
    k, n = np.asarray(k, dtype=np.int64), np.asarray(n, dtype=np.int64)
    inside = (k >= 0) & (k < n)
    return np.where(inside, bdtrc(np.where(inside, k, 0), np.where(inside, n, 1), p), np.where(k < 0, 1.0, 0.0))


def _splits(tolerance: float, count: int) -> np.ndarray:
    """p_gain from 0 (losses only) to (1 - T) / 2, denser near 0 where the discreteness bites (as worst_split's grid)."""
    return (1.0 - tolerance) / 2.0 * np.linspace(0.0, 1.0, count) ** 2


def _gain_share(p_gain: float, tolerance: float) -> float:
    """P(gain | not a loss): the conditional binomial of gains once the losses are drawn."""
    rest = 1.0 - p_gain - tolerance
    return min(p_gain / rest, 1.0) if rest > 0 else 1.0


def _loss_range(n: int, p_lose: float) -> np.ndarray:
    """Loss counts outside the negligible tails of Binomial(n, p_lose)."""
    return _tail_range(n, p_lose)


def _tables(n: int, p_gain: float, tolerance: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(losses, gains, probability) of every 2x2 table outside the negligible tails, under the multinomial model:
    L ~ Binomial(n, p_lose), then G | L ~ Binomial(n - L, p_gain / (1 - p_lose))."""
    p_lose, share = p_gain + tolerance, _gain_share(p_gain, tolerance)
    losses = _loss_range(n, p_lose)
    rest = n - losses
    g_low = np.maximum(binom.ppf(_TAIL, rest, share) - 1, 0).astype(np.int64)
    g_high = np.minimum(binom.isf(_TAIL, rest, share) + 1, rest).astype(np.int64)
    counts = g_high - g_low + 1
    grid_l = np.repeat(losses, counts)
    grid_g = np.repeat(g_low, counts) + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    weight = _pmf(grid_l, n, p_lose) * _pmf(grid_g, n - grid_l, share)
    return grid_l, grid_g, weight


def _split_boundary(n: int, p_gain: float, tolerance: float, alpha: float) -> float:
    """The largest Z value whose upper tail P(Z_T >= value) exceeds alpha at one split (-inf when none does): a valid
    critical value must lie above it."""
    return _boundary(n, tolerance, alpha, *_tables(n, p_gain, tolerance))


def _fixed_boundary(n: int, right: int, tolerance: float, p_gain: float, alpha: float) -> float:
    """_split_boundary under the fixed-baseline model (baseline right on `right` items, fixed_promote_probability's split)."""
    q_lose, q_gain = _fixed_rates(n, right, tolerance, p_gain)
    losses = _tail_range(right, q_lose)
    wrong_gains = _tail_range(n - right, q_gain)
    grid_l, grid_g = (grid.ravel() for grid in np.meshgrid(losses, wrong_gains, indexing="ij"))
    weight = _pmf(grid_l, right, q_lose) * _pmf(grid_g, n - right, q_gain)
    return _boundary(n, tolerance, alpha, grid_l, grid_g, weight)


def _tail_range(count: int, p: float) -> np.ndarray:
    """Outcomes of Binomial(count, p) outside its negligible tails; every outcome up to _WHOLE_RANGE trials (cheaper
    than binom.ppf, whose argument checks cost more than the sums there)."""
    if count <= _WHOLE_RANGE:
        return np.arange(count + 1)
    low, high = (int(v) for v in binom.ppf([_TAIL, 1 - _TAIL], count, p))
    return np.arange(max(low - 1, 0), min(high + 1, count) + 1)


def _boundary(n: int, tolerance: float, alpha: float, losses: np.ndarray, gains: np.ndarray, weight: np.ndarray) -> float:
    values = np.round(tango_statistic(losses, gains, n, tolerance) / _TIE) * _TIE
    unique, inverse = np.unique(values, return_inverse=True)
    tail = np.cumsum(np.bincount(inverse, weights=weight, minlength=unique.size)[::-1])[::-1]  # P(Z >= unique[i])
    over = np.flatnonzero(tail > alpha)
    return float(unique[over[-1]]) if over.size else -math.inf


def _smallest_passing_gains(n: int, tolerance: float, z: float) -> np.ndarray:
    """For each loss count L, the fewest gains with Z_T(L, G) >= z (n - L + 1 when none): Z_T rises with G."""
    losses = np.arange(n + 1)
    low, high = np.zeros(n + 1, dtype=np.int64), n - losses + 1  # answer in [low, high]; high: "none passes"
    while np.any(low < high):
        middle = (low + high) // 2
        passes = tango_statistic(losses, np.minimum(middle, n - losses), n, tolerance) >= z
        passes &= middle <= n - losses
        high = np.where(passes & (low < high), middle, high)
        low = np.where(~passes & (low < high), middle + 1, low)
    return low


def region_probability(n: int, tolerance: float, passing_gains: np.ndarray, p_gain: float) -> float:
    """P(promote) under the multinomial model at p_lose = p_gain + T, for a region {G >= passing_gains[L]}."""
    losses = _loss_range(n, p_gain + tolerance)
    fewest = passing_gains[losses]
    weight = _pmf(losses, n, p_gain + tolerance)
    passing = _sf(fewest - 1, n - losses, _gain_share(p_gain, tolerance))
    return float(np.sum(weight * np.where(fewest <= n - losses, passing, 0.0)))


def worst_split(
    probability: Callable[[float], float], tolerance: float, *, splits: int = _FINE_SPLITS, top: float | None = None,
) -> tuple[float, float]:
    """(sup over p_gain in [0, top] of probability(p_gain), the p_gain reaching it): a grid (denser near 0; top defaults to
    (1 - T) / 2, every split), then a bounded local maximisation around each of the three largest grid values."""
    highest = (1.0 - tolerance) / 2.0 if top is None else top
    grid = highest * np.linspace(0.0, 1.0, splits) ** 2
    values = np.array([probability(float(p)) for p in grid])
    best_value, best_split = float(values.max()), float(grid[int(values.argmax())])
    for index in np.argsort(values)[-3:]:
        low, high = grid[max(index - 1, 0)], grid[min(index + 1, grid.size - 1)]
        if high <= low:
            continue
        found = minimize_scalar(lambda p: -probability(float(p)), bounds=(low, high), method="bounded", options={"xatol": 1e-9})
        if -found.fun > best_value:
            best_value, best_split = float(-found.fun), float(found.x)
    return best_value, best_split


def fixed_region_probability(n: int, right: int, passing_gains: np.ndarray, p_lose: float, p_gain: float) -> float:
    """P(promote) with the baseline's score held fixed: L ~ Binomial(right, p_lose) among its right items, G ~
    Binomial(n - right, p_gain) among its wrong ones, for a region {G >= passing_gains[L]}."""
    if p_lose > 1.0 or p_gain > 1.0:
        return 0.0
    losses = _tail_range(right, p_lose)
    fewest = passing_gains[losses]
    passing = _sf(fewest - 1, n - right, p_gain) if right < n else (fewest <= 0).astype(float)
    return float(np.sum(_pmf(losses, right, p_lose) * np.where(fewest <= n - losses, passing, 0.0)))


def _fixed_rates(n: int, right: int, tolerance: float, p_gain: float) -> tuple[float, float]:
    """(q_lose per right item, q_gain per wrong item) of a fixed baseline right on `right` of n items, at a true worsening
    of T and an expected gain of p_gain n items."""
    return (p_gain + tolerance) * n / right, (p_gain * n / (n - right) if right < n else 0.0)


def fixed_promote_probability(n: int, right: int, tolerance: float, passing: np.ndarray, p_gain: float) -> float:
    """P(promote) for the region {G >= passing[L]} with the baseline right on `right` of n items held fixed, true
    worsening T, expected gains p_gain n (_fixed_rates)."""
    return fixed_region_probability(n, right, passing, *_fixed_rates(n, right, tolerance, p_gain))


def fixed_baseline_rights(n: int, tolerance: float) -> list[int]:
    """The baselines the calibration checks, as right counts: wrong on 1..FEW_WRONG items, and FIXED_BASELINES' scores
    (a baseline right on fewer than T n items cannot lose T n of them; wrong on none is the multinomial's losses only)."""
    rights = {n - wrong for wrong in range(1, FEW_WRONG + 1)} | {round(score * n) for score in FIXED_BASELINES}
    return sorted(right for right in rights if tolerance * n <= right < n)


def fixed_baseline_worst(n: int, tolerance: float, passing: np.ndarray, rights: list[int] | None = None) -> tuple[float, int, float]:
    """(worst P(promote), the baseline's right count, p_gain) with the baseline fixed, over `rights` (default
    fixed_baseline_rights) and every split each allows (p_gain up to the fewer of its spare right and its wrong items)."""
    worst = (0.0, n, 0.0)
    for right in fixed_baseline_rights(n, tolerance) if rights is None else rights:
        probability = partial(fixed_promote_probability, n, right, tolerance, passing)
        top = min(right / n - tolerance, (n - right) / n)
        rate, split = worst_split(probability, tolerance, splits=_FIXED_SPLITS, top=top) if top > 0 else (probability(0.0), 0.0)
        if rate > worst[0]:
            worst = (rate, right, split)
    return worst


@dataclass(frozen=True)
class Calibration:
    """The critical value of one (n, T, c) and the worst P(promote) it leaves (the rate it guarantees) under each model."""

    z: float
    worst_rate: float  # multinomial model
    worst_gain: float  # the p_gain where the worst rate is reached (0: losses only)
    fixed_rate: float = math.nan  # fixed-baseline model, over fixed_baseline_rights
    fixed_right: int = 0  # the baseline's right count where fixed_rate is reached


def _calibrate(n: int, tolerance: float, confidence: float) -> Calibration:
    alpha, nominal = 1.0 - confidence, float(norm.ppf(confidence))
    boundary = -math.inf
    if n <= COARSE_START_MAX_N:
        boundary = max(_split_boundary(n, float(p), tolerance, alpha) for p in _splits(tolerance, _COARSE_SPLITS))
    while True:
        z = max(nominal, _above(n, tolerance, boundary))
        if math.isinf(z):
            return Calibration(z=math.inf, worst_rate=0.0, worst_gain=0.0)
        passing = _smallest_passing_gains(n, tolerance, z)
        rate, split = worst_split(partial(region_probability, n, tolerance, passing), tolerance)
        if rate > alpha + 1e-12:  # the fine check found a split the coarse grid missed: its own boundary lies at or above z
            boundary = max(boundary, _split_boundary(n, split, tolerance, alpha), z)
            continue
        fixed, right, fixed_split = fixed_baseline_worst(n, tolerance, passing)
        if fixed <= alpha + 1e-12:
            return Calibration(z=z, worst_rate=rate, worst_gain=split, fixed_rate=fixed, fixed_right=right)
        boundary = max(boundary, _fixed_boundary(n, right, tolerance, fixed_split, alpha), z)


def _above(n: int, tolerance: float, value: float) -> float:
    """Midway between `value` and the next larger Z value of any table (infinity when none is larger): a critical value
    that no table's statistic comes near, so the rounding of the bound cannot move a table across it."""
    if value == -math.inf:
        return -math.inf
    return (value + _next_table_value(n, tolerance, value)) / 2.0


def _next_table_value(n: int, tolerance: float, value: float) -> float:
    """The smallest Z value of any table above `value` (infinity when none is)."""
    losses = np.arange(n + 1)
    gains = _smallest_passing_gains(n, tolerance, value + _TIE)
    at_edge = gains <= n - losses
    if not at_edge.any():
        return math.inf
    return float(tango_statistic(losses[at_edge], gains[at_edge], n, tolerance).min())


@lru_cache(maxsize=4096)
def calibration(n: int, tolerance: float, confidence: float) -> Calibration:
    """The calibrated critical value of Tango's test at the tolerance (module docstring); above CALIBRATED_MAX_N z(c) plus
    a margin of LATTICE_STEPS lattice steps (worst rates not computed: nan)."""
    if n <= 0 or not 0.0 < tolerance < 1.0:
        raise ValueError(f"need n > 0 and a tolerance in (0, 1) (got {n}, {tolerance})")
    if n > CALIBRATED_MAX_N:
        margin = LATTICE_STEPS / math.sqrt(n * tolerance * (1.0 - tolerance))
        return Calibration(z=float(norm.ppf(confidence)) + margin, worst_rate=math.nan, worst_gain=math.nan)
    return _calibrate(n, tolerance, confidence)


def critical_value(n: int, tolerance: float, confidence: float) -> float:
    return calibration(n, round(tolerance, 12), confidence).z


def identical_passes(n: int, tolerance: float, confidence: float) -> bool:
    """Whether a candidate identical to its baseline (no loss, no gain) passes the calibrated test."""
    return bool(tango_statistic(np.array([0]), np.array([0]), n, tolerance)[0] >= critical_value(n, tolerance, confidence))


def identical_items_needed(tolerance: float, confidence: float) -> int:
    """The fewest items with which an identical candidate passes: at least ln(1 - c) / ln(1 - T) (a candidate losing
    a share T shows no loss with probability (1 - T)^n), found by stepping up from there."""
    if tolerance >= 1.0:
        return 1
    n = max(1, math.ceil(math.log(1.0 - confidence) / math.log(1.0 - tolerance) - 1e-9))
    while not identical_passes(n, tolerance, confidence) and n <= COARSE_START_MAX_N:
        n += 1
    return n


# --- P(promote) through any decision function, under the multinomial model --------------------------------------

def passing_gains(promotes: Callable[[int, int], bool], n: int) -> np.ndarray:
    """For each loss count L, the fewest gains G with promotes(L, G) (n - L + 1 when none), for a decision that more
    losses never help and more gains never hurt (every rule of the gate on a pass/fail set). Steps along the boundary:
    O(n) calls."""
    fewest = n - np.arange(n + 1) + 1  # "none" until found
    gain = 0
    for lost in range(n + 1):
        while gain <= n - lost and not promotes(lost, gain):
            gain += 1
        if gain > n - lost:
            break  # nothing promotes at this many losses, nor at more
        fewest[lost] = gain
    return fewest


def promote_at_tolerance(promotes: Callable[[int, int], bool], n: int, tolerance: float, *, max_discordance: float = 1.0) -> tuple[float, float]:
    """(worst P(promote), the p_gain reaching it) of a candidate whose true worsening is `tolerance`, over every split
    of its discordance into losses and gains with p_lose + p_gain <= max(max_discordance, tolerance) (losses only
    included), exact sums over the multinomial tables judged by `promotes`."""
    gains = passing_gains(promotes, n)
    top = max(0.0, (min(max(max_discordance, tolerance), 1.0) - tolerance) / 2.0)
    if top == 0.0:
        return region_probability(n, tolerance, gains, 0.0), 0.0
    return worst_split(lambda p: region_probability(n, tolerance, gains, p), tolerance, splits=120, top=top)
