"""The runtime's noise floor: the A/A figures, the candidate against the mean of both baseline passes, the refusal of a
tolerance under the floor, the policy switch, and the charging rule's error rates by simulation against known answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from scipy.stats import beta

from pipelines.benchmarks import noise_rule
from pipelines.errors import InputError
from pipelines.evaluation.metrics import make_spec
from pipelines.gate import noise
from pipelines.gate.policy import Policy, RuleOverrides, SetPolicy
from pipelines.gate.verdict import PairedItem, SetComparison, judge_set

EXACT_MATCH = make_spec("exact_match")
RULES = SetPolicy(max_abs_drop=None, max_rel_drop=None, non_inferiority=True, ni_margin=5.5, max_flip_rate=None, max_kl=None, min_items=1)


def comparison(cells: list[tuple[float, float, float | None]], metric=EXACT_MATCH) -> SetComparison:
    """(first pass, second pass or None, candidate) per item."""
    items = [PairedItem(item_id=f"{i}:h{i}", baseline=b, baseline_repeat=again, candidate=c) for i, (b, again, c) in enumerate(cells)]
    return SetComparison(eval_set="tickets", metric=metric, items=items)


def test_the_a_a_figures_count_both_directions_and_list_the_items_that_flipped():
    first, second = [1, 1, 0, 0, 1, 0] * 20, [1, 0, 0, 1, 1, 0] * 20
    ids = [f"{i}:h" for i in range(120)]
    floor = noise.measure_floor(ids, first, second, kind="binary", scale=100.0, in_points=True, candidate=[1] * 120)
    assert (floor.flips, floor.right_to_wrong, floor.wrong_to_right, floor.n) == (40, 20, 20, 120)
    assert floor.unstable_items == [ids[i] for i in range(120) if i % 6 in (1, 3)]
    assert floor.rate == pytest.approx(40 / 120) and floor.floor == pytest.approx(100 * 40 / 120, abs=1e-6)
    # Clopper-Pearson: the Beta quantiles, two-sided 95%
    assert floor.rate_low == pytest.approx(beta.ppf(0.025, 40, 81), abs=1e-9)
    assert floor.rate_high == pytest.approx(beta.ppf(0.975, 41, 80), abs=1e-9)
    # the candidate differs from the first pass on the first pass's 60 wrong items, 20 of them items the runtime flipped
    assert (floor.candidate_flips, floor.candidate_flips_on_unstable) == (60, 20)


def test_no_flip_has_an_exact_interval_from_zero():
    floor = noise.measure_floor(["a", "b"], [1, 0], [1, 0], kind="binary", scale=100.0, in_points=True)
    assert (floor.flips, floor.rate_low, floor.unstable_items, floor.candidate_flips) == (0, 0.0, [], None)
    assert floor.rate_high == pytest.approx(1 - 0.025 ** (1 / 2))


def test_the_candidate_is_compared_with_the_mean_of_both_passes_in_halves():
    # 200 stable right, 40 stable wrong, 10 the runtime flipped (right in the first pass, wrong in the second);
    # the candidate loses 6 stable items and is wrong on the 10 unstable ones.
    cells = [(1.0, 1.0, 0.0)] * 6 + [(1.0, 1.0, 1.0)] * 194 + [(0.0, 0.0, 0.0)] * 40 + [(1.0, 0.0, 0.0)] * 10
    verdict = judge_set(comparison(cells), RULES)
    once = judge_set(comparison([(b, None, c) for b, _, c in cells]), RULES)
    assert verdict.baseline_score == pytest.approx(100 * 205 / 250) and once.baseline_score == pytest.approx(100 * 210 / 250)
    assert verdict.delta == pytest.approx(-100 * 11 / 250) and once.delta == pytest.approx(-100 * 16 / 250)
    assert verdict.worsening_bound < once.worsening_bound  # half of the runtime's losses charged, not all
    assert (verdict.flips_right_to_wrong, verdict.flips_wrong_to_right) == (16, 0) == (once.flips_right_to_wrong, once.flips_wrong_to_right)
    assert verdict.noise_floor is not None and verdict.noise_floor.flips == 10 and once.noise_floor is None
    assert verdict.noise_floor.candidate_flips_on_unstable == 10 and verdict.noise_floor.reference == "mean of both passes"


def test_two_passes_that_agree_judge_exactly_as_one():
    cells = [(1.0, 1.0, 0.0)] * 5 + [(0.0, 0.0, 1.0)] * 3 + [(1.0, 1.0, 1.0)] * 200 + [(0.0, 0.0, 0.0)] * 42
    twice, once = judge_set(comparison(cells), RULES), judge_set(comparison([(b, None, c) for b, _, c in cells]), RULES)
    assert twice.model_dump(exclude={"noise_floor"}) == once.model_dump(exclude={"noise_floor"})
    assert twice.noise_floor is not None and twice.noise_floor.flips == 0


def test_a_second_pass_must_cover_every_item_with_values_of_the_metric():
    with pytest.raises(ValidationError, match="holds some items, not all"):
        comparison([(1.0, 1.0, 1.0), (1.0, None, 1.0)])
    with pytest.raises(ValidationError, match="binary metric"):
        comparison([(1.0, 0.5, 1.0)])


def test_averaged_metrics_take_the_mean_and_corpus_metrics_only_the_report():
    f1 = make_spec("f1")
    verdict = judge_set(comparison([(0.8, 0.6, 0.7), (0.5, 0.5, 0.5)] * 60, f1), RULES.model_copy(update={"non_inferiority": False}))
    assert verdict.baseline_score == pytest.approx(100 * 0.6) and verdict.noise_floor.flips == 60
    assert verdict.noise_floor.floor is None  # only pass/fail flips are a floor in points


def test_a_tolerance_under_the_floor_is_refused_in_one_line_naming_the_file_and_field():
    policy = Policy(defaults=RULES, eval_sets={"tickets": RuleOverrides(ni_margin=1.0)})
    floor = noise.measure_floor([str(i) for i in range(240)], [1] * 240, [0] * 3 + [1] * 237, kind="binary", scale=100.0, in_points=True)
    error = noise.floor_refusal(
        floor, 1.0, eval_set="tickets", unit="points", policy=policy, policy_path=Path("p.yaml"), recipe=None, rule="ni_margin",
    )
    assert isinstance(error, InputError) and error.field == "eval_sets.tickets.ni_margin" and "\n" not in str(error)
    assert str(error).startswith("p.yaml") and "tolerance 1 points is smaller than the runtime's own noise floor 1.25 points (3 of 240" in str(error)
    assert noise.floor_refusal(floor, 1.25, eval_set="tickets", unit="points", policy=policy, policy_path=None, recipe=None, rule="ni_margin") is None


def test_the_policy_switch_defaults_to_pass_fail_sets_and_is_overridable_per_set():
    auto = SetPolicy.model_validate(RULES.model_dump())
    assert auto.noise_floor == "auto" and auto.noise_floor_for("binary") and not auto.noise_floor_for("continuous")
    assert not auto.noise_floor_for("corpus")
    policy = Policy(defaults=RULES, eval_sets={"essays": RuleOverrides(noise_floor=True), "tickets": RuleOverrides(noise_floor=False)})
    assert policy.for_set(None, "essays").noise_floor_for("corpus") and not policy.for_set(None, "tickets").noise_floor_for("binary")
    for bad in (None, "sometimes"):
        with pytest.raises(ValidationError):
            RuleOverrides(noise_floor=bad)


# --- the charging rule, simulated against known answers (the full figure: make bench-noise, docs/guarantees.md) ---

ONE_OR_TWO = ("first pass", "mean of passes")


def _rates(scenario: noise_rule.Scenario, trials: int, ways: tuple[str, ...] = ONE_OR_TWO) -> dict[str, tuple[float, float, float]]:
    counts = noise_rule.promote_rates(scenario, noise_rule.tolerance_only(), 240, trials, ways=ways)
    return {rule: (count / trials, *noise.rate_interval(count, trials)) for rule, count in counts.items()}


def _scenario(name: str) -> noise_rule.Scenario:
    return next(s for s in noise_rule.scenarios(0.055) if s.name == name)


def test_the_rule_keeps_the_tolerance_guarantee_with_the_damage_on_the_unstable_items():
    rates = _rates(_scenario("worsening T on unstable items only, 20% unstable"), 150)
    assert rates["mean of passes"][1] <= 0.05  # not above 1 - confidence


@pytest.mark.slow
def test_dropping_the_unstable_items_breaks_the_guarantee():
    rates = _rates(_scenario("worsening T on unstable items only, 20% unstable"), 150, ways=("drop unstable",))
    assert rates["drop unstable"][1] > 0.15  # damage on the borderline items goes unseen (each kept n calibrated: slow)


def test_the_rule_rejects_an_unchanged_candidate_no_more_often_than_the_first_pass_alone():
    rates = _rates(_scenario("unchanged, 20% unstable"), 150)
    assert rates["mean of passes"][0] >= rates["first pass"][0]
    assert rates["first pass"][0] < 0.95  # the runtime's noise alone does reject an unchanged candidate at this level


@pytest.mark.slow
def test_the_rule_holds_every_scenario_at_a_larger_trial_count():
    for scenario in noise_rule.scenarios(0.055):
        rates = _rates(scenario, 2000)
        if scenario.worsening() > 0:
            assert rates["mean of passes"][1] <= 0.05, scenario.name
        elif scenario.unstable >= 0.2:  # fewer false rejections where the noise is large
            assert rates["mean of passes"][0] > rates["first pass"][0], scenario.name
        else:  # at about the measured noise neither way rejects an unchanged candidate (a set in 2,000 may move either way)
            assert min(rates["mean of passes"][0], rates["first pass"][0]) >= 0.995, scenario.name
