"""The paired comparison's statistics: the interval of a ratio from paired runs, when to stop, and what it says.

Each pair is one run of the baseline and one of the candidate, back to back, on the same prompts; its ratio is
candidate / baseline (output tokens per second, or p95 TTFT). The estimate is the geometric mean of the pairs' ratios;
the interval is a t-interval on their logarithms, exp(mean +- c x sd / sqrt(n)).

Sequential use. Pairs are added until the interval is within `margin` of its estimate (half-width in logs at most
log(1 + margin)), from `min_pairs` on. That rule reads only the interval's width, never where it lies, so it cannot
hunt for a verdict; but stopping when the sample's spread happens to be small makes the plain 95% t-interval miss
more often than 5% (simulated with normal log ratios: up to 9.8% from 3 pairs, 8.3% from 4). The critical value `c`
is therefore the 99th t-percentile (a 98% two-sided interval at a fixed size), which with min_pairs >= 4 keeps the
miss rate of the interval at the stopping time at or below 5% at every spread (simulated: worst 4.2% near a
log-ratio sd of 0.15; `sequential_miss_rate` reproduces it, and tests/unit/loadtest/test_sequential.py checks it).
A wrong direction (`slower` for a candidate that is not) is one tail of that: about 2.5% at most.

Assumptions: the pairs' log ratios are independent and roughly normal with one spread; the random order within a
pair removes the machine's slow drift from the ratio's expectation (a drift that favours the model run second falls
on either model with probability 1/2).

Outcomes, for a ratio where higher is faster (throughput; for TTFT, lower is faster):
- `no difference`: the interval lies within [1 / (1 + margin), 1 + margin];
- `faster` / `slower`: the interval lies wholly on one side of 1 (and not within the margin);
- `inconclusive`: neither (the interval straddles 1 and reaches beyond the margin), or fewer than two pairs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Literal

import numpy as np
from scipy import stats

from pipelines.loadtest.results import RatioInterval

NOMINAL_CONFIDENCE = 0.95
# The critical value's own confidence (see the module docstring): calibrated so that the interval at the stopping
# time covers the true ratio at least NOMINAL_CONFIDENCE of the time when min_pairs >= 4.
CRITICAL_CONFIDENCE = 0.98
Outcome = Literal["faster", "slower", "no difference", "inconclusive"]
METHOD = (
    "geometric mean of paired candidate/baseline runs (same prompts, back to back, order drawn per pair); 95% interval "
    "exp(mean +- t(0.99, n-1) x sd / sqrt(n)) on the log ratios, the critical value raised from t(0.975) because pairs "
    "are added until the interval is narrow (simulated miss rate <= 5% from 4 pairs)"
)


def critical_value(pairs: int, confidence: float = CRITICAL_CONFIDENCE) -> float:
    return float(stats.t.ppf(0.5 + confidence / 2, pairs - 1))


def ratio_interval(candidate: Sequence[float], baseline: Sequence[float], confidence: float = CRITICAL_CONFIDENCE) -> RatioInterval | None:
    """Paired ratios candidate[i] / baseline[i]; None when there is no pair or a value is not positive."""
    pairs = list(zip(candidate, baseline, strict=True))
    if not pairs or any(not (c > 0 and b > 0) for c, b in pairs):
        return None
    logs = [math.log(c / b) for c, b in pairs]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return RatioInterval(estimate=math.exp(mean), pairs=1)
    half = critical_value(len(logs), confidence) * statistics.stdev(logs) / math.sqrt(len(logs))
    return RatioInterval(estimate=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half), pairs=len(logs))


def precise(interval: RatioInterval | None, margin: float) -> bool:
    """The stopping rule: an interval within `margin` of its estimate on either side (in logs)."""
    if interval is None or interval.low is None or interval.high is None:
        return False
    return math.log(interval.high / interval.low) / 2 <= math.log1p(margin) + 1e-12


def outcome(interval: RatioInterval | None, margin: float, higher_is_faster: bool = True) -> Outcome:
    if interval is None or interval.low is None or interval.high is None:
        return "inconclusive"
    if interval.low >= 1 / (1 + margin) and interval.high <= 1 + margin:
        return "no difference"
    if interval.high < 1:
        return "slower" if higher_is_faster else "faster"
    if interval.low > 1:
        return "faster" if higher_is_faster else "slower"
    return "inconclusive"


def against_limit(interval: RatioInterval | None, limit: float, *, at_least: bool) -> Literal["passed", "failed", "inconclusive"]:
    """A policy limit read on the interval: passed when all of it meets the limit, failed when none of it does."""
    if interval is None or interval.low is None or interval.high is None:
        return "inconclusive"
    low, high = (interval.low, interval.high) if at_least else (1 / interval.high, 1 / interval.low)
    bound = limit if at_least else 1 / limit
    if low >= bound - 1e-12:
        return "passed"
    if high < bound:
        return "failed"
    return "inconclusive"


def sequential_miss_rate(sd: float, *, margin: float = 0.10, min_pairs: int = 4, max_pairs: int = 30,
                         confidence: float = CRITICAL_CONFIDENCE, trials: int = 20_000, seed: int = 0) -> float:
    """Simulated share of comparisons whose interval at the stopping time misses the true ratio (normal log ratios
    with standard deviation `sd`; the rule of this module, max_pairs standing in for the time budget)."""
    rng = np.random.default_rng(seed)
    logs = rng.normal(0.0, sd, size=(trials, max_pairs))
    counts = np.arange(1, max_pairs + 1)
    means = np.cumsum(logs, axis=1) / counts
    squares = np.cumsum(logs**2, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        variances = (squares - counts * means**2) / (counts - 1)
        critical = np.array([critical_value(int(n), confidence) if n >= 2 else np.inf for n in counts])
        halves = critical * np.sqrt(np.maximum(variances, 0.0) / counts)
    stoppable = (halves <= math.log1p(margin)) & (counts >= min_pairs)
    stoppable[:, -1] = True
    stop = np.argmax(stoppable, axis=1)
    rows = np.arange(trials)
    return float(np.mean(np.abs(means[rows, stop]) > halves[rows, stop]))
