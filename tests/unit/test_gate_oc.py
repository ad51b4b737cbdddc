"""The operating-characteristics benchmark simulates the real gate: checked against exact binomial sums."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binom

from pipelines.benchmarks import gate_oc
from pipelines.policy import SetPolicy

POINT_RULE_ONLY = SetPolicy(
    max_abs_drop=3.0, max_rel_drop=None, non_inferiority=False, ni_margin=5.0, max_flip_rate=None, max_kl=None, min_items=1
)


def exact_promote_rate(n: int, drop: float, discordance: float, baseline_score: float, max_drop_items: int) -> float:
    """P(lost - gained <= max_drop_items), lost ~ Bin(right, p_lose / score), gained ~ Bin(n - right, p_gain / (1 - score))."""
    right = round(baseline_score * n)
    lost = binom(right, (discordance + drop) / 2 / baseline_score).pmf(np.arange(right + 1))
    gained = binom(n - right, (discordance - drop) / 2 / (1 - baseline_score)).pmf(np.arange(n - right + 1))
    return float(sum(p_lost * gained[max(0, k - max_drop_items):].sum() for k, p_lost in enumerate(lost)))


@pytest.mark.parametrize(("drop", "discordance"), [(0.0, 0.04), (0.02, 0.06), (0.04, 0.08)])
def test_simulated_promote_rate_matches_the_exact_rate_of_a_point_estimate_rule(drop, discordance):
    # 100 items, max_abs_drop 3 points: promoted while lost - gained <= 3.
    simulated = gate_oc.promote_rate(POINT_RULE_ONLY, 100, drop, discordance, baseline_score=0.8, reps=20_000)
    assert simulated == pytest.approx(exact_promote_rate(100, drop, discordance, 0.8, 3), abs=0.01)


def test_impossible_candidates_are_not_simulated():
    # A 4-point drop needs at least 4% of items to flip.
    assert gate_oc.promote_rate(POINT_RULE_ONLY, 100, 0.04, 0.02, baseline_score=0.8, reps=10) is None
    assert gate_oc.cell_probabilities(0.0, 0.04, 0.8) == pytest.approx([0.78, 0.02, 0.02, 0.18])


def test_false_reject_over_sets_combines_independent_sets():
    sets = [("a", 100, POINT_RULE_ONLY), ("b", 100, POINT_RULE_ONLY)]
    one = 1 - exact_promote_rate(100, 0.0, 0.06, 0.8, 3)
    combined = gate_oc.false_reject_over_sets(sets, 0.06, baseline_score=0.8, reps=20_000)
    assert combined == pytest.approx(1 - (1 - one) ** 2, abs=0.015)
