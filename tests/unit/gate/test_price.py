"""The price of each rule (pipelines.gate.price): the width of its one-sided bound against normal theory at the same level,
and an unchanged candidate's pass rate, at the noise a set shows (measured from a second scoring, else assumed)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from fakes import make_eval_set

from pipelines.evaluation.baseline import BaselineEntry, RepeatEntry, store
from pipelines.evaluation.evaluate import ItemScore, SetScore
from pipelines.evaluation.metrics import MetricSpec
from pipelines.gate import betting, identical, price, stats
from pipelines.gate.policy import load_gate_policy
from pipelines.gate.verdict import binary_critical_value

RULES = load_gate_policy(None)[0].for_set(None, "x")  # ni_margin 5.5 points, rel_margin 0.05, c = 0.95
AVERAGED = MetricSpec(name="f1", kind="continuous")
PERPLEXITY = MetricSpec(name="word_perplexity", kind="corpus", aggregation="weighted_perplexity", higher_is_better=False)
DOCUMENTS = [[-20 * math.log(20.0), 20], [-35 * math.log(15.0), 35], [-12 * math.log(30.0), 12]]


def test_zero_noise_passes_always_where_the_identical_floor_allows_and_never_below_it():
    quiet = price.Noise("assumed, not measured", "none", discordance=0.0)
    minimum = identical.identical_items_needed("binary", 0.055, 0.95)
    assert minimum == 53
    assert price.binary_price(RULES, True, minimum, 42, quiet).pass_rate == pytest.approx(1.0)
    assert price.binary_price(RULES, True, minimum - 1, 41, quiet).pass_rate == pytest.approx(0.0)
    assert price.binary_price(RULES, True, 250, 200, quiet).width_ratio is None  # no noise: normal theory's width is 0
    averaged = price.simulated_price("x", AVERAGED, RULES, 100, price.moved_noise(AVERAGED, [0.8], 0.0), reps=3)
    assert (averaged.pass_rate, averaged.reps, averaged.width_ratio) == (1.0, 3, None)
    below = identical.identical_items_needed("continuous", 0.055, 0.95) - 1
    assert price.simulated_price("x", AVERAGED, RULES, below, price.moved_noise(AVERAGED, [0.8], 0.0), reps=2).pass_rate == 0.0
    corpus = price.simulated_price("x", PERPLEXITY, RULES, 210, price.log_noise(DOCUMENTS, 0.0, ""), reps=2)
    assert corpus.pass_rate == 1.0


def test_binary_width_is_the_calibrated_tango_bound_over_normal_theory_and_nears_1_as_n_grows():
    ratios = []
    for n in (100, 250, 500):
        entry = price.binary_price(RULES, True, n, round(0.8 * n), price.Noise("a", "psi 0.1", discordance=0.1))
        z = binary_critical_value(RULES, n, round(0.8 * n))
        bound = -stats.tango_lower_bound(0.05 * n, 0.05 * n, n, z=z)
        assert entry.width_ratio == pytest.approx(bound / (stats.z_one_sided(0.95) * math.sqrt(0.1 / n)))
        ratios.append(entry.width_ratio)
    assert ratios[0] > ratios[1] > ratios[2] and 1.0 < ratios[2] < 1.1
    # its pass rate is the exact sum the bench-gate table gives: n = 100, psi 0.10, no drop, 49%
    assert price.binary_price(RULES, True, 100, 80, price.Noise("a", "psi 0.1", discordance=0.1)).pass_rate == pytest.approx(0.49, abs=0.005)


def test_averaged_width_is_the_betting_bound_over_normal_theory_on_the_same_draw():
    noise = price.moved_noise(AVERAGED, [0.8], 0.1)
    entry = price.simulated_price("x", AVERAGED, RULES, 250, noise, reps=1, seed=7)
    base, cand = noise.draw(np.random.default_rng(7), 250)
    d = np.asarray(cand) - np.asarray(base)
    assert set(np.round(np.abs(d), 9)) <= {0.0, 1.0} and 0.05 < np.mean(d != 0) < 0.15
    low, _ = betting.mean_bounds(d, 1.0, 0.95)
    width = -low - (-d.mean())  # the worsening's bound less the worsening (higher is better)
    expected = width / (stats.z_one_sided(0.95) * d.std(ddof=1) / math.sqrt(250))
    assert entry.width_ratio == pytest.approx(expected, abs=1e-3)
    assert entry.width_ratio > 1.3  # the price of a bound valid for every distribution


def test_normal_se_of_a_corpus_mean_is_the_sd_over_root_n():
    rng = np.random.default_rng(1)
    base, cand = rng.random(60).tolist(), rng.random(60).tolist()
    as_mean = price.normal_se(MetricSpec(name="f1", kind="corpus", aggregation="mean"), base, cand)
    assert as_mean == pytest.approx(price.normal_se(AVERAGED, base, cand), rel=1e-9)


def test_measured_noise_swaps_the_two_scorings_so_the_candidate_is_unchanged():
    first, second = [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]
    noise = price.measured_noise(MetricSpec(name="acc"), first, second, "f" * 64)
    assert noise.source == "measured" and noise.discordance == 0.5 and "2 of 4 items differ" in noise.label
    base, cand = noise.draw(np.random.default_rng(0), 20_000)
    pairs = {(1.0, 1.0), (0.0, 1.0), (1.0, 0.0)}
    assert set(zip(base, cand, strict=True)) <= pairs
    assert abs(np.mean(cand) - np.mean(base)) < 0.02  # swapped at random: no drift either way


def _score(eval_set, values: list[float]) -> SetScore:
    items = [ItemScore(doc_id=i, doc_hash=f"h{i}", value=v) for i, v in enumerate(values)]
    return SetScore(eval_set=eval_set.name, eval_set_sha256=eval_set.sha256, metric=eval_set.metric, score=float(np.mean(values)),
                    n=len(values), items=items, wall_s=1.0)


def test_the_cached_baseline_with_a_second_scoring_is_the_measured_noise(tmp_path: Path):
    eval_set = make_eval_set(tmp_path / "sets", "tickets", items=120)
    cache = tmp_path / "cache"
    assert price.cached_baselines([eval_set], cache) == {}
    first = [1.0] * 100 + [0.0] * 20
    again = [0.0] * 3 + [1.0] * 97 + [0.0] * 20  # 3 items flipped between the two scorings
    store(BaselineEntry(key="a" * 64, model_hash="m" * 64, score=_score(eval_set, first), references=[]), cache)
    store(BaselineEntry(key="b" * 64, model_hash="n" * 64, score=_score(eval_set, [1.0] * 120), references=[]), cache)
    store(RepeatEntry(key="c" * 64, model_hash="m" * 64, score=_score(eval_set, again), first_key="a" * 64), cache)
    (cache / "broken.json").write_text("{not json")
    (cache / "link.json").symlink_to(cache / f"{'b' * 64}.json")  # a link is never read
    found = price.cached_baselines([eval_set], cache)["tickets"]
    assert found is not None and found.model_hash == "m" * 64 and found.repeat == again and found.score == pytest.approx(100 / 120)
    measured, upper = price.noise_levels(eval_set.metric, found, 0.8)
    assert measured.discordance == pytest.approx(3 / 120) and upper.discordance == pytest.approx(0.0712, abs=1e-3)
    prices = price.set_prices(eval_set, RULES, found, 0.8)
    assert [p.method for p in prices] == ["exact", "exact"] and prices[0].pass_rate > prices[1].pass_rate


def test_a_never_scored_set_gets_the_assumed_grid_labelled_so():
    levels = price.noise_levels(PERPLEXITY, None, 0.8)
    assert [level.source for level in levels] == ["assumed, not measured"] * 2
    assert "synthetic documents: 20 words or bytes at perplexity 20" in levels[0].label
    bare = MetricSpec(name="perplexity", kind="corpus", aggregation="perplexity", higher_is_better=False)
    for spec in (PERPLEXITY, bare):  # lm-eval's shapes: [loglikelihood, words] and a bare loglikelihood; both judged
        noise = price.noise_levels(spec, None, 0.8)[1]
        base, cand = noise.draw(np.random.default_rng(0), 3)
        assert isinstance(base[0], list) == (spec is PERPLEXITY) and base != cand
        entry = price.simulated_price("x", spec, RULES, 210, noise, reps=1)
        assert entry.reps == 1 and entry.width_ratio is not None and entry.width_ratio > 1.0
    assert [level.label for level in price.noise_levels(AVERAGED, None, 0.8)] == [
        "+-1 value range on 2% of items", "+-1 value range on 10% of items"]
    assert price.noise_levels(MetricSpec(name="bleu", kind="corpus", aggregation="bleu"), None, 0.8) == []


def test_an_averaged_set_scored_twice_is_priced_on_its_own_differences():
    rng = np.random.default_rng(3)
    first = rng.random(150).round(2).tolist()
    steady = price.measured_noise(AVERAGED, first, first, "m" * 64)
    entry = price.simulated_price("x", AVERAGED, RULES, 150, steady, reps=3)
    assert (entry.pass_rate, entry.width_ratio) == (1.0, None)  # the two scorings agree: no noise, always passes
    second = [1.0 - value if i % 5 == 0 else value for i, value in enumerate(first)]  # a fifth reflected: 50% pass
    noisy = price.simulated_price("x", AVERAGED, RULES, 150, price.measured_noise(AVERAGED, first, second, "m" * 64), reps=20)
    assert noisy.reps == 20 and noisy.width_ratio is not None and noisy.width_ratio > 1.3 and 0.2 < noisy.pass_rate < 0.8
