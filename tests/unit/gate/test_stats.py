"""Known-answer tests for the paired statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipelines.gate import betting, stats


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
    assert flipped.discordance_rate == pytest.approx(0.06)


def test_flips_refuses_continuous_scores():
    with pytest.raises(ValueError, match="pass/fail"):
        stats.flips([0.5, 1.0], [1.0, 1.0])


def test_tango_interval_matches_published_values():
    # Fagerland, Lydersen and Laake (2014), Cavo et al. (2012) data: n12 = 6, n21 = 16, N = 161;
    # estimate -0.0621, Tango 95% CI -0.1240 to -0.0054.
    low, high = stats.tango_interval(losses=16, gains=6, n=161)
    assert (round(low, 4), round(high, 4)) == (-0.1240, -0.0054)


@pytest.mark.parametrize("n", [1, 5, 20, 60, 250, 1000])
def test_tango_interval_without_discordant_pairs_has_its_closed_form_width(n):
    # With b = c = 0 the score test inverts to |delta| = z^2 / (n + z^2): never a zero-width interval.
    z2 = 1.959964**2
    low, high = stats.tango_interval(0, 0, n)
    assert low == pytest.approx(-z2 / (n + z2), abs=1e-6) and high == pytest.approx(z2 / (n + z2), abs=1e-6)


@pytest.mark.parametrize(("losses", "gains", "n"), [(3, 0, 20), (12, 4, 250), (40, 20, 160), (0, 7, 50)])
def test_tango_bounds_are_where_the_score_statistic_equals_z(losses, gains, n):
    low, high = stats.tango_interval(losses, gains, n)
    assert low < (gains - losses) / n < high
    assert abs(stats._tango_score(low, losses, gains, n)) == pytest.approx(1.959964, abs=1e-4)
    assert abs(stats._tango_score(high, losses, gains, n)) == pytest.approx(1.959964, abs=1e-4)


def test_tango_interval_reaches_the_edge_when_everything_flipped():
    assert stats.tango_interval(20, 0, 20)[0] == -1.0
    assert stats.tango_interval(0, 20, 20)[1] == 1.0
    with pytest.raises(ValueError):
        stats.tango_interval(15, 10, 20)


@pytest.mark.parametrize(("n", "drop", "discordance"), [(20, 0.0, 0.05), (50, 0.02, 0.06), (100, 0.02, 0.04), (250, 0.02, 0.04)])
def test_tango_interval_covers_the_true_delta_about_95_percent_of_the_time(n, drop, discordance):
    # The bootstrap it replaces covered 0.64 at n = 50 and 0.86 at n = 100 for a true 2-point drop.
    rng = np.random.default_rng(7)
    lose, gain = (discordance + drop) / 2, (discordance - drop) / 2
    cells = rng.multinomial(n, [lose, gain, 1 - lose - gain], size=2000)
    covered = np.mean([low <= -drop <= high for low, high in (stats.tango_interval(int(b), int(c), n) for b, c, _ in cells)])
    assert covered >= 0.92


def test_one_sided_bounds_are_the_ends_of_the_two_sided_interval_at_2c_minus_1():
    assert stats.tango_lower_bound(17, 13, 240, confidence=0.95) == pytest.approx(stats.tango_interval(17, 13, 240, confidence=0.90)[0], abs=1e-10)
    assert stats.z_one_sided(0.95) == pytest.approx(1.644854, abs=1e-6)
    # No discordant pair: the bound is z^2 / (n + z^2) with the one-sided z, 4.31 points at n = 60.
    assert stats.tango_lower_bound(0, 0, 60) == pytest.approx(-stats.identical_floor(60), abs=1e-9)
    assert stats.identical_floor(60) == pytest.approx(1.6448536**2 / (60 + 1.6448536**2), abs=1e-8)


def test_exact_lower_bound_is_binomtest_s_clopper_pearson_bound():
    # The Beta quantile against scipy's binomtest (its own root search, two-sided at 2c - 1) over a grid of tables.
    from scipy.stats import binomtest

    for n in (1, 7, 47, 250, 1000):
        for k in sorted({0, 1, min(2, n), n // 3, n - 1, n}):
            for confidence in (0.9, 0.95, 0.99):
                expected = binomtest(k, n).proportion_ci(confidence_level=2 * confidence - 1, method="exact").low
                assert stats.exact_lower_bound(k, n, confidence=confidence) == pytest.approx(expected, abs=1e-9), (k, n, confidence)
    assert stats.exact_lower_bound(20, 20, confidence=0.95) == pytest.approx(0.05 ** (1 / 20), abs=1e-12)  # all n: P(X = n | p) = p^n = 1 - c
    for bad in ((-1, 10), (11, 10), (0, 0), (1.5, 10)):
        with pytest.raises(ValueError):
            stats.exact_lower_bound(*bad)


def test_zero_count_floor_is_clopper_pearson_s_bound_of_a_rate_never_seen():
    # 1 - 0.05^(1/n): 5.5 points need 53 items (0.945^53 = 0.0499 <= 5% < 0.945^52), 5 points 59, 3 points 99.
    from scipy.stats import beta

    assert stats.zero_count_bound(250) == pytest.approx(beta.ppf(0.95, 1, 250), abs=1e-12)
    assert [stats.zero_count_items_needed(t) for t in (0.055, 0.05, 0.03)] == [53, 59, 99]
    for tolerance in (0.01, 0.03, 0.055, 0.2):
        n = stats.zero_count_items_needed(tolerance)
        assert stats.zero_count_bound(n) <= tolerance < stats.zero_count_bound(n - 1)


def test_items_needed_is_nam_s_formula_and_has_the_stated_power():
    # Nam (1997): n = ((z_c sqrt(V0) + z_b sqrt(psi)) / T)^2; with psi = 0 it reduces to the identical-model minimum.
    # With psi = 0 it is the asymptotic identical minimum z^2 (1 - T) / T: 47 for 5.5 points (the gate reports at least the
    # calibrated test's exact minimum, 53).
    assert stats.items_needed(0.055, 0.0) == 47
    assert stats.items_needed(0.055, 0.04) == 126
    assert stats.certifiable_tolerance(126, 0.04) <= 0.055 < stats.certifiable_tolerance(125, 0.04)
    # Power by exact summation over the binomial tables: Tango's bound within 5.5 points for an unchanged candidate.
    from pipelines.benchmarks import gate_oc
    from pipelines.gate.policy import SetPolicy

    rules = SetPolicy(max_abs_drop=None, max_rel_drop=None, non_inferiority=True, ni_margin=5.5, max_flip_rate=None, max_kl=None, min_items=1)
    for discordance in (0.04, 0.1):
        n = stats.items_needed(0.055, discordance)
        assert 0.77 <= gate_oc.promote_rate(rules, n, 0.0, discordance, baseline_score=0.8) <= 0.86


def test_table_probability_matches_the_direct_double_sum():
    from scipy.stats import binom

    def rejects(lost: int, gained: int) -> bool:
        return lost - gained > 3 or lost > 9

    direct = sum(
        binom.pmf(lost, 80, 0.07) * binom.pmf(gained, 20, 0.2)
        for lost in range(81) for gained in range(21) if rejects(lost, gained)
    )
    assert stats.table_probability(rejects, 100, 80, 0.07, 0.2) == pytest.approx(direct, abs=1e-10)
    assert stats.unchanged_flip_probabilities(0.04, 80, 100) == (pytest.approx(0.025), pytest.approx(0.1))
    assert stats.unchanged_flip_probabilities(0.04, 100, 100) == (0.0, 0.0)  # a 100% baseline: no unchanged flip
    assert stats.any_rejects([0.1, 0.2]) == pytest.approx(1 - 0.9 * 0.8)


def test_mean_difference_interval_of_an_unchanged_set_is_the_betting_bound_of_zeros():
    base = np.full(20, 0.5)
    delta, low, high = stats.mean_difference_interval(base, base, value_range=1.0)
    assert delta == 0.0 and high == pytest.approx(-low) and high == pytest.approx(betting.identical_bound(20, 0.975), abs=1e-9)
    assert high == pytest.approx(0.189539, abs=1e-5)


def test_mean_difference_interval_is_a_little_wider_than_normal_theory_on_a_large_set():
    # The price of holding for every distribution: about 1.2x the normal-theory interval on 2,000 smooth differences.
    rng = np.random.default_rng(0)
    base = rng.random(2000)
    cand = (base + rng.normal(-0.01, 0.05, 2000)).clip(0, 1)
    delta, low, high = stats.mean_difference_interval(base, cand, value_range=1.0)
    standard_error = np.std(cand - base, ddof=1) / np.sqrt(2000)
    assert low < delta < high
    assert 1.0 <= (high - low) / (2 * 1.96 * standard_error) <= 1.5


def test_mean_difference_interval_is_deterministic():
    base, cand = pass_fail(20, 10, 200, 20)
    assert stats.mean_difference_interval(base, cand, value_range=1.0) == stats.mean_difference_interval(base, cand, value_range=1.0)


def test_betting_bound_knows_its_answer_on_constant_values():
    # Every value equal: the same bound whatever the order, rising towards the value as n grows; 62 unchanged items are
    # the fewest whose bound is within 5.5 points.
    assert betting.lower_bound(np.ones(400), 0.95) > 0.98
    assert betting.identical_bound(1000, 0.95) < betting.identical_bound(100, 0.95) < betting.identical_bound(20, 0.95)
    assert betting.identical_items_needed(0.055, 0.95) == 62
    assert betting.identical_bound(62, 0.95) <= 0.055 < betting.identical_bound(61, 0.95)


@pytest.mark.parametrize(("n", "broken", "nudged", "nudge"), [
    (100, 0.08, 0.9, "normal"), pytest.param(250, 0.05, 0.9, "normal", marks=pytest.mark.slow),
    pytest.param(250, 0.05, 0.6, "t2", marks=pytest.mark.slow),
])
def test_the_averaged_bound_covers_one_sided_when_a_few_items_break_outright(n, broken, nudged, nudge):
    # Known answer by simulation: a population whose true mean worsening is exactly the tolerance (5.5 points), a few
    # items broken outright and many nudged slightly (normal or t(2) nudges); its one-sided 95% bound is missed (bound <
    # truth: the candidate promoted) at most 5% of the time, + 2 simulation standard errors. Tango's score interval on
    # effective counts, which it replaced, missed 8.3% / 7.9% in the first two cases. 300 seeded sets each.
    from pipelines.benchmarks.gate_guarantees import skewed_miss

    miss = skewed_miss(n, broken, nudged, nudge, 0.055, reps=300, confidence=0.95, seed=n)
    assert miss <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 300)


COVERAGE_CASES = [  # (share of items changed, size of a change: "uniform" U(0, 1) or "one" 1.0, P(a change is down))
    (0.05, "one", 0.5), (0.1, "uniform", 0.8), (0.1, "uniform", 1.0), (0.3, "uniform", 0.8), (1.0, "uniform", 0.5),
]


@pytest.mark.slow
@pytest.mark.parametrize("n", [50, 250])
def test_the_per_item_interval_covers_at_least_93_percent_with_few_or_many_changed_items(n):
    # The BCa bootstrap it replaced covered 0.918 at n = 250 with 10% of items changed. Known answer: the true mean
    # difference of the simulated population, share x E[size] x (1 - 2 P(down)). 300 seeded sets per case.
    rng = np.random.default_rng(n)
    for share, size, down in COVERAGE_CASES:
        truth = share * (0.5 if size == "uniform" else 1.0) * (1 - 2 * down)
        hits = 0
        for _ in range(300):
            moved = rng.random(n) < share
            magnitude = rng.random(n) if size == "uniform" else np.ones(n)
            diffs = np.where(moved, np.where(rng.random(n) < down, -1.0, 1.0) * magnitude, 0.0)
            _, low, high = stats.mean_difference_interval(np.zeros(n), diffs, value_range=1.0)
            hits += low <= truth <= high
        assert hits / 300 >= 0.93, (n, share, size, down, hits / 300)


def test_corpus_interval_resamples_pairs_and_aggregates_each_model():
    # Aggregate = share of "hits" in the pooled list: a corpus-level statistic, not a per-item mean.
    def share(values: list) -> float:
        return sum(v[0] for v in values) / sum(v[1] for v in values)

    base = [[1, 2]] * 100
    cand = [[1, 2]] * 80 + [[0, 2]] * 20
    base_score, cand_score, low, high = stats.corpus_difference_interval(share, base, cand, value_range=1.0, resamples=500)
    assert (base_score, cand_score) == (0.5, 0.4)
    assert low < -0.1 < high < 0


def test_paired_inputs_must_match():
    with pytest.raises(ValueError, match="equal length"):
        stats.mean_difference_interval([1.0, 0.0], [1.0], value_range=1.0)
    with pytest.raises(ValueError, match="non-empty"):
        stats.mean_difference_interval([], [], value_range=1.0)
    with pytest.raises(ValueError, match="equal length"):
        stats.corpus_difference_interval(len, [[1]], [], value_range=1.0)


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
