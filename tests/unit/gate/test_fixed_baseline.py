"""The pass/fail test with the baseline's right/wrong fixed per item (the candidate loses each of the baseline's R right
items with q_lose and gains each of its n - R wrong ones with q_gain, R q_lose - (n - R) q_gain = n T): brute-force sums
over every table with scipy's binomial pmf, independent of pipelines/gate/exact.py's own sums, and the sizes above the
exactly calibrated range."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom, norm

from pipelines.gate import exact, stats

TOLERANCE = 0.055
CONFIDENCE = 0.95
# The critical value shipped for n = 216 before the fixed-baseline check (the multinomial model alone): the audit's case.
MULTINOMIAL_ONLY_Z_216 = 1.6584778274205887


def promoted(n: int, z: float) -> np.ndarray:
    """promoted[L, G]: whether Tango's score test at the tolerance passes L losses and G gains, one table at a time."""
    table = np.zeros((n + 1, n + 1), dtype=bool)
    for lost in range(n + 1):
        for gained in range(n - lost + 1):
            table[lost, gained] = stats._tango_score(-TOLERANCE, lost, gained, n) >= z
    return table


def brute_force_fixed(n: int, right: int, q_gain: float, passes: np.ndarray) -> float:
    """P(promote) by the double sum over every (L, G): L ~ Binomial(R, q_lose), G ~ Binomial(n - R, q_gain)."""
    q_lose = (n * TOLERANCE + (n - right) * q_gain) / right
    if q_lose > 1.0:
        return 0.0
    losses = binom.pmf(np.arange(right + 1), right, q_lose)
    gains = binom.pmf(np.arange(n - right + 1), n - right, q_gain)
    return float(losses @ passes[: right + 1, : n - right + 1] @ gains)


def worst_over_gains(n: int, right: int, passes: np.ndarray, points: int = 201) -> float:
    gains = np.linspace(0.0, 1.0, points) if right < n else np.array([0.0])
    return max(brute_force_fixed(n, right, float(q), passes) for q in gains)


def partial_region(n: int, z: float):
    """P(promote) under the multinomial model as a function of p_gain, for Tango's test at z (exact.py's sums)."""
    region = exact._smallest_passing_gains(n, TOLERANCE, z)
    return lambda p_gain: exact.region_probability(n, TOLERANCE, region, p_gain)


def test_one_wrong_item_at_216_breaks_the_multinomial_only_critical_value():
    # The audit's finding, reproduced by brute force: a 215/216 baseline, the candidate nearly sure to gain the one wrong
    # item, is promoted 5.228% of the time at the value that held the multinomial model (worst 4.95% there).
    n = 216
    passes = promoted(n, MULTINOMIAL_ONLY_Z_216)
    assert worst_over_gains(n, n - 1, passes) == pytest.approx(0.05228, abs=2e-5)
    multinomial, _ = exact.worst_split(partial_region(n, MULTINOMIAL_ONLY_Z_216), TOLERANCE)
    assert multinomial <= 0.05


@pytest.mark.parametrize("n", [216, 240])
def test_the_calibrated_value_holds_baselines_wrong_on_a_few_items(n):
    z = exact.critical_value(n, TOLERANCE, CONFIDENCE)
    passes = promoted(n, z)
    worst = max(worst_over_gains(n, n - wrong, passes) for wrong in range(6))
    assert worst <= 0.05 + 1e-12
    assert worst >= 0.04  # held close to 5%, not far below it
    calibration = exact.calibration(n, TOLERANCE, CONFIDENCE)
    assert calibration.fixed_rate <= 0.05 and calibration.worst_rate <= 0.05


@pytest.mark.parametrize("n", [40, 53, 60])
def test_every_baseline_of_a_small_set_holds_the_rate(n):
    # Every baseline from T n right items to all right, 41 gain rates each: the calibration checks only a few of them.
    passes = promoted(n, exact.critical_value(n, TOLERANCE, CONFIDENCE))
    rights = range(math.ceil(TOLERANCE * n), n + 1)
    worst = max(worst_over_gains(n, right, passes, points=41) for right in rights)
    assert worst <= 0.05 + 1e-12


@pytest.mark.parametrize(("n", "right", "p_gain"), [(60, 59, 0.0123), (60, 30, 0.2), (216, 215, 0.0043), (216, 173, 0.05)])
def test_the_module_s_fixed_sums_equal_the_brute_force(n, right, p_gain):
    z = exact.critical_value(n, TOLERANCE, CONFIDENCE)
    region = exact._smallest_passing_gains(n, TOLERANCE, z)
    q_gain = p_gain * n / (n - right)
    expected = brute_force_fixed(n, right, q_gain, promoted(n, z))
    assert exact.fixed_promote_probability(n, right, TOLERANCE, region, p_gain) == pytest.approx(expected, abs=1e-10)


def test_sizes_above_twenty_thousand_are_calibrated_where_z_c_broke_the_rate():
    # z(c) itself, the old fallback above 20,000 items, promotes 5.08% at n = 20,187 (the audit); the calibrated value
    # holds both models there.
    n, nominal = 20_187, float(norm.ppf(CONFIDENCE))
    old, _ = exact.worst_split(partial_region(n, nominal), TOLERANCE)
    assert old == pytest.approx(0.0508, abs=2e-4)
    calibration = exact.calibration(n, TOLERANCE, CONFIDENCE)
    assert calibration.z > nominal and calibration.worst_rate <= 0.05 and calibration.fixed_rate <= 0.05


def test_the_margin_above_the_calibrated_range_holds_both_models():
    n = exact.CALIBRATED_MAX_N + 1
    z = exact.critical_value(n, TOLERANCE, CONFIDENCE)
    assert z == pytest.approx(norm.ppf(CONFIDENCE) + exact.LATTICE_STEPS / math.sqrt(n * TOLERANCE * (1 - TOLERANCE)))
    multinomial, _ = exact.worst_split(partial_region(n, z), TOLERANCE)
    fixed, _, _ = exact.fixed_baseline_worst(n, TOLERANCE, exact._smallest_passing_gains(n, TOLERANCE, z))
    assert max(multinomial, fixed) <= 0.05
