"""Known-answer tests for the paired statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipelines import stats


def pass_fail(right_to_wrong: int, wrong_to_right: int, both_right: int, both_wrong: int) -> tuple[np.ndarray, np.ndarray]:
    """Baseline and candidate 0/1 vectors with the given cell counts of the 2x2 table."""
    base = [1] * right_to_wrong + [0] * wrong_to_right + [1] * both_right + [0] * both_wrong
    cand = [0] * right_to_wrong + [1] * wrong_to_right + [1] * both_right + [0] * both_wrong
    return np.array(base, dtype=float), np.array(cand, dtype=float)


def test_mcnemar_exact_p_matches_hand_computed_binomial():
    # 1 vs 9 discordant pairs: p = 2 * (C(10,0) + C(10,1)) / 2^10 = 22 / 1024.
    assert stats.mcnemar_exact_p(1, 9) == pytest.approx(22 / 1024, abs=1e-12)
    assert stats.mcnemar_exact_p(9, 1) == pytest.approx(22 / 1024, abs=1e-12)


def test_mcnemar_exact_p_balanced_and_empty():
    # 3 vs 3: the observed split is the most likely one, so p = 1.
    assert stats.mcnemar_exact_p(3, 3) == pytest.approx(1.0)
    assert stats.mcnemar_exact_p(0, 0) == 1.0
    # 0 vs 5: p = 2 / 32; five one-sided flips are not enough at alpha 0.05, six are.
    assert stats.mcnemar_exact_p(5, 0) == pytest.approx(2 / 32)
    assert stats.mcnemar_exact_p(6, 0) == pytest.approx(2 / 64)


def test_flips_counts_and_rates():
    base, cand = pass_fail(right_to_wrong=4, wrong_to_right=2, both_right=90, both_wrong=4)
    flipped = stats.flips(base, cand)
    assert (flipped.right_to_wrong, flipped.wrong_to_right, flipped.n) == (4, 2, 100)
    assert flipped.right_to_wrong_rate == pytest.approx(0.04)
    assert flipped.wrong_to_right_rate == pytest.approx(0.02)
    assert flipped.discordance_rate == pytest.approx(0.06)


def test_flips_refuses_continuous_scores():
    with pytest.raises(ValueError, match="pass/fail"):
        stats.flips([0.5, 1.0], [1.0, 1.0])


def test_identical_scores_give_zero_delta_and_degenerate_interval():
    base, cand = pass_fail(0, 0, 180, 20)
    assert stats.paired_bootstrap_ci(base, cand) == (0.0, 0.0, 0.0)


def test_bootstrap_interval_matches_normal_theory_on_constructed_case():
    # 30 right->wrong, 15 wrong->right of 300: delta = -0.05; the per-item difference has variance
    # psi - delta^2 = 0.15 - 0.0025, so the 95% interval is about -0.05 +/- 1.96 * sqrt(0.1475 / 300).
    base, cand = pass_fail(30, 15, 230, 25)
    delta, low, high = stats.paired_bootstrap_ci(base, cand)
    half_width = 1.96 * math.sqrt((0.15 - 0.05**2) / 300)
    assert delta == pytest.approx(-0.05)
    assert low < -0.05 < high
    assert low == pytest.approx(-0.05 - half_width, abs=0.004)
    assert high == pytest.approx(-0.05 + half_width, abs=0.004)


def test_bootstrap_is_reproducible_with_a_seed_and_varies_without():
    base, cand = pass_fail(20, 10, 200, 20)
    assert stats.paired_bootstrap_ci(base, cand, seed=3) == stats.paired_bootstrap_ci(base, cand, seed=3)
    assert stats.paired_bootstrap_ci(base, cand, seed=3) != stats.paired_bootstrap_ci(base, cand, seed=4)


def test_bootstrap_interval_covers_true_delta_about_95_percent_of_the_time():
    # Draw 200 sets of 250 items from a population whose true delta is -0.02.
    rng = np.random.default_rng(11)
    p_lose, p_gain, true_delta = 0.05, 0.03, -0.02
    covered = 0
    for trial in range(200):
        cells = rng.multinomial(250, [p_lose, p_gain, 0.8, 1 - p_lose - p_gain - 0.8])
        base, cand = pass_fail(*cells)
        _, low, high = stats.paired_bootstrap_ci(base, cand, resamples=2000, seed=trial)
        covered += low <= true_delta <= high
    assert 0.89 <= covered / 200 <= 0.99


def test_bootstrap_works_in_blocks_for_large_sets():
    rng = np.random.default_rng(0)
    base = rng.random(5000)
    cand = base + rng.normal(-0.01, 0.05, 5000).clip(-base, 1 - base)
    delta, low, high = stats.paired_bootstrap_ci(base, cand, resamples=2000)
    standard_error = np.std(cand - base, ddof=1) / np.sqrt(5000)
    assert low < delta < high
    assert high - low == pytest.approx(2 * 1.96 * standard_error, rel=0.1)


def test_paired_inputs_must_match():
    with pytest.raises(ValueError, match="equal length"):
        stats.paired_bootstrap_ci([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        stats.paired_bootstrap_ci([], [])


def test_kl_summary_mean_max_and_missing_values():
    summary = stats.kl_summary([0.01, None, 0.05, 0.03])
    assert summary is not None
    assert (summary.mean, summary.max, summary.items) == (pytest.approx(0.03), 0.05, 3)
    assert stats.kl_summary([None, None]) is None


def test_min_detectable_drop_uses_observed_discordance():
    # k = z(0.975) + z(0.8) = 1.95996 + 0.84162 = 2.80158; drop = k * sqrt(0.1 / 100).
    assert stats.min_detectable_drop_binary(100, 0.10) == pytest.approx(2.80158 * math.sqrt(0.001), rel=1e-4)


def test_min_detectable_drop_floor_when_nothing_flipped():
    # With no observed flips the drop itself is the discordance: drop = k^2 / n.
    assert stats.min_detectable_drop_binary(250, 0.0) == pytest.approx(2.80158**2 / 250, rel=1e-4)
    assert stats.min_detectable_drop_binary(20, 0.0) > 0.35


def test_min_detectable_drop_shrinks_with_more_items_and_stricter_power_grows_it():
    small = stats.min_detectable_drop_binary(100, 0.1)
    assert stats.min_detectable_drop_binary(400, 0.1) == pytest.approx(small / 2)
    assert stats.min_detectable_drop_binary(100, 0.1, power=0.9) > small


def test_min_detectable_drop_has_about_the_stated_power():
    # Simulate the exact McNemar test at the computed drop: power should be close to 0.8.
    n, psi = 250, 0.05
    drop = stats.min_detectable_drop_binary(n, psi)
    cells = np.random.default_rng(2).multinomial(n, [(psi + drop) / 2, (psi - drop) / 2, 1 - psi], size=2000)
    detected = sum(lose > gain and stats.mcnemar_exact_p(int(lose), int(gain)) < 0.05 for lose, gain, _ in cells)
    assert 0.72 <= detected / 2000 <= 0.88


def test_min_detectable_drop_continuous():
    assert stats.min_detectable_drop_continuous(100, 0.2) == pytest.approx(2.80158 * 0.02, rel=1e-4)
