"""The concentrated-damage rule for corpus metrics (pipelines.gate.concentrated): its lemma, its contributions, its
minimum sizes, and a short simulation of its false-pass rate at a tolerance-sized worsening."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipelines.benchmarks import concentrated_damage
from pipelines.evaluation.metrics import corpus_aggregation, make_spec
from pipelines.gate import concentrated
from pipelines.gate.policy import DEFAULT_POLICY, load_policy, unseen_damage
from pipelines.gate.verdict import PairedItem, SetComparison, judge_set

RULES = load_policy(DEFAULT_POLICY).for_set("w8a8", "(a corpus set)")
WORD_PERPLEXITY = make_spec("word_perplexity", "weighted_perplexity", higher_is_better=False)


def _largest_half_share(x: np.ndarray) -> int:
    """The most top items whose contributions together carry at most half of the total."""
    carried = np.cumsum(np.sort(x)[::-1])
    return int(np.searchsorted(carried, carried[-1] / 2.0, side="right"))


@pytest.mark.parametrize("seed", range(40))
def test_the_lemma_holds_on_random_populations(seed):
    # Any population with a positive mean whose top p N items carry at most half of the total: clipped to
    # [-tau / (2p), tau / (2p)], its mean is at least tau / 2. Severities of every shape, some items improved.
    rng = np.random.default_rng(seed)
    size = int(rng.integers(50, 3000))
    shape = concentrated_damage.SHAPES[seed % 4]
    x = concentrated_damage.severities(shape, size, rng) * (rng.random(size) < rng.uniform(0.05, 1.0))
    x = x - rng.exponential(rng.uniform(0.0, 0.5), size) * (rng.random(size) < 0.3)
    tau = float(x.mean())
    if tau <= 0:
        return
    top = _largest_half_share(x)
    assert top >= 1
    clip = tau / (2.0 * top / size)
    assert np.clip(x, -clip, clip).mean() >= tau / 2.0 - 1e-12
    assert concentration_is_just_above(x, top)


def concentration_is_just_above(x: np.ndarray, top: int) -> bool:
    return concentrated_damage.concentration_share(x) == (top + 1) / x.size


@pytest.mark.parametrize(("share", "needed"), [(0.02, 173), (0.03, 115), (0.05, 68)])
def test_an_identical_candidate_passes_from_the_minimum_size(share, needed):
    assert concentrated.items_needed(share, 0.95) == needed
    for n, passes in ((needed, True), (needed - 1, False)):
        same = concentrated.Contributions(damage=np.zeros(n), weight=np.ones(n), tolerance=math.log1p(0.05))
        assert concentrated.clipped_bound(same, share, 0.95).passed is passes
    rules = RULES.model_copy(update={"damage_share": share})
    assert unseen_damage(WORD_PERPLEXITY, needed, rules) is None
    assert unseen_damage(make_spec("bleu", "bleu"), needed - 1, rules) == (
        f"{needed - 1} items cannot rule out a worsening concentrated in {share:.0%} of items (damage_share {share:g}) at 95% "
        f"confidence even against an identical model; it needs at least {needed} items"
    )


def test_perplexity_contributions_add_up_to_the_log_perplexity_change():
    rng = np.random.default_rng(3)
    words = rng.integers(5, 300, 200)
    base = -words * rng.gamma(4.0, 0.5, 200)
    cand = base - words * rng.normal(0.05, 0.2, 200)
    baseline = [[float(b), int(w)] for b, w in zip(base, words, strict=True)]
    candidate = [[float(c), int(w)] for c, w in zip(cand, words, strict=True)]
    aggregate = corpus_aggregation("weighted_perplexity")
    found = concentrated.contributions("weighted_perplexity", baseline, candidate, higher_is_better=False, allowed=0.05 * aggregate(baseline),
                                       baseline_score=aggregate(baseline))
    assert found.damage.sum() / found.weight.sum() == pytest.approx(math.log(aggregate(candidate) / aggregate(baseline)), rel=1e-9)
    assert found.tolerance == pytest.approx(math.log(1.05))
    bits = corpus_aggregation("bits_per_byte")
    per_byte = concentrated.contributions("bits_per_byte", baseline, candidate, higher_is_better=False, allowed=0.05 * bits(baseline),
                                          baseline_score=bits(baseline))
    assert per_byte.damage.sum() / per_byte.weight.sum() == pytest.approx(bits(candidate) / bits(baseline) - 1.0, rel=1e-9)


@pytest.mark.parametrize("metric", ["bleu", "chrf", "ter"])
def test_sacrebleu_pseudo_values_are_lm_eval_s_leave_one_out(metric):
    rng = np.random.default_rng(5)
    words = [f"w{i}" for i in range(40)]
    refs = [" ".join(rng.choice(words, int(rng.integers(4, 12)))) for _ in range(25)]
    baseline = [[r, " ".join(w if rng.random() > 0.3 else "x" for w in r.split())] for r in refs]
    candidate = [[r, p + (" QQ" * int(rng.integers(1, 9)) if rng.random() < 0.2 else "")] for r, p in baseline]
    aggregate = corpus_aggregation(metric)
    found = concentrated.contributions(metric, baseline, candidate, higher_is_better=metric != "ter", allowed=1.0,
                                       baseline_score=aggregate(baseline))
    sign = 1.0 if metric == "ter" else -1.0
    whole = aggregate(candidate) - aggregate(baseline)
    for i in (0, 7, 24):
        left = aggregate(candidate[:i] + candidate[i + 1:]) - aggregate(baseline[:i] + baseline[i + 1:])
        assert found.damage[i] == pytest.approx(sign * (25 * whole - 24 * left), abs=1e-9)


def test_a_tolerance_sized_worsening_rarely_passes_and_an_unchanged_candidate_often_does():
    # 200 sets of 400 documents from a population whose rise is exactly 5% with concentration share exactly 2% (Pareto
    # severities): at most 5% + 3 standard errors may pass; the unchanged candidate (noise only) must pass most of the time.
    worse = concentrated_damage.perplexity_population("pareto", 0.02, 0.05, seed=1)
    assert worse.worsening == pytest.approx(1.0, abs=1e-3) and worse.share == pytest.approx(0.02, abs=1e-4)
    assert concentrated_damage.pass_rate(worse, 400, RULES, reps=200, seed=4) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 200)
    same = concentrated_damage.unchanged_population("perplexity", 0.05, seed=1)
    assert concentrated_damage.pass_rate(same, 400, RULES, reps=100, seed=4) >= 0.6


def test_the_verdict_names_the_rule_when_damage_is_concentrated():
    # 250 documents, 5 of them (2%) ruined: the clipped bound rejects, naming the set, both numbers and damage_share.
    items = [PairedItem(item_id=str(i), baseline=[-200.0, 100], candidate=[-200.0 - (400.0 if i < 5 else 0.0), 100]) for i in range(250)]
    verdict = judge_set(SetComparison(eval_set="wiki", metric=WORD_PERPLEXITY, items=items), RULES)
    assert not verdict.passed and verdict.concentrated_clip == 25.0 and verdict.concentrated_bound is not None
    reason = next(reason for reason in verdict.reasons if "concentrated" in reason)
    assert reason.startswith("wiki: a worsening concentrated in 2% of items is not ruled out: with each item's contribution clipped at 25x")
    assert f"{verdict.concentrated_bound:.3f} of the tolerance (95% one-sided bound) > 0.5 (damage_share 0.02)" in reason
