"""A one-sided confidence bound for the mean of bounded per-item values, valid at every n for every distribution.

Averaged metrics (token F1, ROUGE-like scores, any per-item number averaged) are judged on the mean of the per-item
differences d_i = candidate_i - baseline_i, each within [-R, R] (R the metric's value range). Normal-theory and
bootstrap bounds miss when the change is skewed: a few items broken outright and many nudged slightly put the
mean's sampling distribution far from normal, and they undercover one side. This bound makes no such assumption.

Method: the betting confidence bound of Waudby-Smith and Ramdas ("Estimating means of bounded random variables by
betting", JRSS-B 2024), one-sided. With x_i = (d_i / R + 1) / 2 in [0, 1] and a candidate mean m, a bettor who
starts with 1 and stakes lambda_i (x_i - m) on each item in turn ends with K(m) = prod(1 + lambda_i (x_i - m));
when the true mean is m, K(m) is a nonnegative martingale with expectation 1, so P(K(m) >= 1 / (1 - c)) <= 1 - c
(Markov). The lower bound is the smallest m with K(m) < 1 / (1 - c): it is below the true mean with probability
at least c whatever the distribution of the x_i (items drawn independently from the set's population).
The stakes are the paper's predictable plug-in, one-sided and tuned to the set's size:
lambda_i = min(sqrt(2 ln(1 / (1 - c)) / (n s_{i-1}^2)), TRUNCATION / m), s^2 the running variance estimate.
K depends on the items' order; the bound averages K over PERMUTATIONS seeded orders (an average of e-values is an
e-value, so the guarantee holds for the average), which makes it a function of the set alone.
"""

from __future__ import annotations

import math

import numpy as np

TRUNCATION = 0.9  # of 1 / m: a bettor never stakes more than 90% of what a value of 0 would cost
PERMUTATIONS = 16
SEED = 0
_GRID = 64
_CELLS = 4_000_000  # floats per step of the wealth computation


def _orders(n: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    return np.stack([np.arange(n)] + [rng.permutation(n) for _ in range(PERMUTATIONS - 1)])


def _stakes(x: np.ndarray, confidence: float) -> np.ndarray:
    """The predictable plug-in stakes, before truncation: one row per order."""
    n = x.shape[-1]
    count = np.arange(1, n + 1)
    running_mean = (0.5 + np.cumsum(x, axis=-1)) / (count + 1)
    running_variance = (0.25 + np.cumsum((x - running_mean) ** 2, axis=-1)) / (count + 1)
    variance_before = np.concatenate([np.full((*x.shape[:-1], 1), 0.25), running_variance[..., :-1]], axis=-1)
    return np.sqrt(2.0 * math.log(1.0 / (1.0 - confidence)) / (n * variance_before))


def _log_wealth(x: np.ndarray, stakes: np.ndarray, means: np.ndarray) -> np.ndarray:
    """log of the average over orders of K(m), for each m in `means` (in chunks: means x orders x items stays small)."""
    chunk = max(1, _CELLS // x.size)
    result = np.empty(means.size)
    for start in range(0, means.size, chunk):
        part = means[start:start + chunk]
        lam = np.minimum(stakes[None, ...], TRUNCATION / part[:, None, None])
        log_k = np.log1p(lam * (x[None, ...] - part[:, None, None])).sum(axis=-1)  # (means, orders)
        top = log_k.max(axis=1)
        result[start:start + chunk] = top + np.log(np.exp(log_k - top[:, None]).mean(axis=1))
    return result


def lower_bound(x: np.ndarray, confidence: float) -> float:
    """The betting lower confidence bound of E[x] for values x in [0, 1] (module docstring)."""
    x = np.clip(np.asarray(x, dtype=float), 0.0, 1.0)
    if x.size == 0:
        raise ValueError("need at least one value")
    ordered = x[_orders(x.size)]
    stakes = _stakes(ordered, confidence)
    threshold = math.log(1.0 / (1.0 - confidence))

    def rejected(means: np.ndarray) -> np.ndarray:
        return _log_wealth(ordered, stakes, means) >= threshold

    grid = np.linspace(0.0, 1.0, _GRID + 1)[1:]  # m = 0 is never rejected from below (x >= 0)
    kept = np.flatnonzero(~rejected(grid))
    if kept.size == 0:
        return 1.0
    first = int(kept[0])
    # the smallest m not rejected lies between the grid point before the first kept one and that one: bisection
    low, high = (float(grid[first - 1]) if first > 0 else 0.0), float(grid[first])
    for _ in range(30):
        middle = (low + high) / 2.0
        if rejected(np.array([middle]))[0]:
            low = middle
        else:
            high = middle
    return low


def mean_bounds(diffs: np.ndarray, value_range: float, confidence: float) -> tuple[float, float]:
    """(lower, upper) one-sided bounds of E[d] at `confidence` each, for differences d in [-value_range, value_range]."""
    d = np.asarray(diffs, dtype=float)
    scaled = (d / value_range + 1.0) / 2.0
    low = value_range * (2.0 * lower_bound(scaled, confidence) - 1.0)
    high = value_range * (1.0 - 2.0 * lower_bound(1.0 - scaled, confidence))
    return low, high


def identical_bound(n: int, confidence: float) -> float:
    """The bound an unchanged set of n items gets (every difference 0), as a fraction of the value range. Every order
    of identical values is the same order, so one is computed (any n)."""
    x = np.full((1, n), 0.5)
    stakes = _stakes(x, confidence)
    threshold = math.log(1.0 / (1.0 - confidence))
    low, high = 0.0, 0.5  # m = 0.5 (the mean) is never rejected, m -> 0 always is
    for _ in range(50):
        middle = (low + high) / 2.0
        if _log_wealth(x, stakes, np.array([middle]))[0] >= threshold:
            low = middle
        else:
            high = middle
    return 1.0 - 2.0 * low


def identical_items_needed(tolerance: float, confidence: float, *, limit: int = 10**6) -> int | None:
    """The fewest items whose identical_bound is within `tolerance` (a fraction of the range); None beyond `limit`.
    Doubling from 2 / T, then bisection (the bound falls as n grows)."""
    if tolerance >= 1.0:
        return 1
    high = max(2, int(2.0 / tolerance))
    while identical_bound(high, confidence) > tolerance:
        if high >= limit:
            return None
        high = min(2 * high, limit)
    low = 1
    while low < high:
        middle = (low + high) // 2
        if identical_bound(middle, confidence) <= tolerance:
            high = middle
        else:
            low = middle + 1
    return low
