import math

import pytest

from pipelines.divergence import Reference, coarse_kl, item_kl


def _log(probabilities: dict[str, float]) -> dict[str, float]:
    return {token: math.log(p) for token, p in probabilities.items()}


def test_identical_distributions_have_zero_kl():
    p = _log({"a": 0.6, "b": 0.3})
    assert coarse_kl(p, p) == pytest.approx(0.0, abs=1e-12)


def test_kl_on_top_k_plus_rest_matches_hand_computation():
    # p = (.5, .3, rest .2), q = (.3, .5, rest .2): KL = .5 ln(5/3) + .3 ln(3/5) + .2 ln(1)
    expected = 0.5 * math.log(5 / 3) + 0.3 * math.log(3 / 5)
    assert coarse_kl(_log({"a": 0.5, "b": 0.3}), _log({"a": 0.3, "b": 0.5})) == pytest.approx(expected)


def test_token_missing_from_candidate_top_k_uses_its_kth_probability():
    baseline = _log({"a": 0.9})
    candidate = _log({"b": 0.5, "c": 0.05})  # "a" absent: bounded by 0.05
    q_rest = 1 - 0.05
    expected = 0.9 * math.log(0.9 / 0.05) + 0.1 * math.log(0.1 / q_rest)
    assert coarse_kl(baseline, candidate) == pytest.approx(expected)


def test_item_kl_averages_positions_and_handles_empty_paths():
    p, q = _log({"a": 0.5, "b": 0.3}), _log({"a": 0.3, "b": 0.5})
    reference = Reference(doc_id=0, prompt_ids=[1], generated_ids=[2, 3], baseline_topk=[p, p])
    assert item_kl(reference, [p, q]) == pytest.approx(coarse_kl(p, q) / 2)
    empty = Reference(doc_id=1, prompt_ids=[1], generated_ids=[], baseline_topk=[])
    assert item_kl(empty, []) == 0.0
