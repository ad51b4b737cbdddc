"""Pairing integrity: baseline and candidate must hold exactly the set's items, the same docs, each once."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.errors import EvalError, InputError
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import ItemScore, SetScore
from pipelines.evaluation.metrics import MetricSpec, make_spec
from pipelines.gate.pairing import pair_set

EXACT_MATCH = make_spec("exact_match", "mean", True)


def eval_set(num_items: int = 5, metric: MetricSpec = EXACT_MATCH, name: str = "payment") -> EvalSet:
    folder = Path("eval_sets") / name
    return EvalSet(
        name=name, folder=folder, task_yaml=folder / f"{name}.yaml", data=folder / "data.jsonl", config={"task": name},
        task_name=name, output_type="generate_until", metric=metric, num_items=num_items, sha256="s" * 64,
    )


def score(values: dict[int, float | list], of: EvalSet, hashes: dict[int, str] | None = None) -> SetScore:
    items = [ItemScore(doc_id=doc, doc_hash=(hashes or {}).get(doc, f"h{doc}"), value=value) for doc, value in values.items()]
    return SetScore(eval_set=of.name, eval_set_sha256=of.sha256, metric=of.metric, score=0.0, n=len(items), items=items, wall_s=1.0)


def test_items_pair_by_doc_id_with_their_kl() -> None:
    target = eval_set(3)
    baseline = score({2: 1.0, 0: 1.0, 1: 0.0}, target)
    candidate = score({0: 1.0, 1: 1.0, 2: 0.0}, target)
    comparison = pair_set(target, baseline, candidate, {0: 0.01, 1: None, 2: 0.3}, "top-20")
    assert comparison.eval_set == "payment" and comparison.metric == EXACT_MATCH and comparison.kl_method == "top-20"
    assert [(i.item_id, i.baseline, i.candidate, i.kl) for i in comparison.items] == [
        ("0:h0", 1.0, 1.0, 0.01), ("1:h1", 0.0, 1.0, None), ("2:h2", 1.0, 0.0, 0.3),
    ]


def test_a_missing_candidate_item_is_an_error_with_the_counts() -> None:
    target = eval_set(5)
    with pytest.raises(EvalError) as caught:
        pair_set(target, score(dict.fromkeys(range(5), 1.0), target), score(dict.fromkeys([0, 1, 2, 4], 1.0), target), {}, None)
    assert caught.value.one_line() == "eval set payment: baseline has 5 items, candidate 4, the set 5; missing from candidate: doc 3"
    assert caught.value.exit_code == 2


def test_runs_that_agree_but_miss_items_of_the_set_are_an_error() -> None:
    target = eval_set(250)
    both = dict.fromkeys(range(243), 1.0)
    with pytest.raises(EvalError) as caught:
        pair_set(target, score(both, target), score(both, target), {}, None)
    assert caught.value.one_line() == (
        "eval set payment: baseline has 243 items, candidate 243, the set 250; "
        "missing from baseline: docs 243, 244, 245, 246, 247, ... (7 in all); "
        "missing from candidate: docs 243, 244, 245, 246, 247, ... (7 in all)"
    )


def test_an_item_outside_the_set_is_an_error() -> None:
    target = eval_set(2)
    with pytest.raises(EvalError, match="baseline has 3 items, candidate 2, the set 2; not in the set: doc 7"):
        pair_set(target, score({0: 1.0, 1: 1.0, 7: 1.0}, target), score({0: 1.0, 1: 1.0}, target), {}, None)


def test_a_doc_hash_mismatch_is_an_error_naming_the_doc() -> None:
    target = eval_set(3)
    baseline = score(dict.fromkeys(range(3), 1.0), target)
    candidate = score(dict.fromkeys(range(3), 1.0), target, hashes={1: "other"})
    with pytest.raises(EvalError, match=r"eval set payment: 1 item\(s\) differ between the baseline and candidate runs \(doc_hash\): doc 1"):
        pair_set(target, baseline, candidate, {}, None)


def test_identical_docs_are_two_pairs_by_position() -> None:
    target = eval_set(3)
    same = {0: "h", 1: "h", 2: "x"}
    comparison = pair_set(target, score({0: 1.0, 1: 0.0, 2: 1.0}, target, same), score({0: 0.0, 1: 1.0, 2: 1.0}, target, same), {}, None)
    assert [(i.item_id, i.baseline, i.candidate) for i in comparison.items] == [("0:h", 1.0, 0.0), ("1:h", 0.0, 1.0), ("2:x", 1.0, 1.0)]


def test_a_doc_logged_twice_is_an_error() -> None:
    target = eval_set(2)
    baseline = score({0: 1.0, 1: 1.0}, target)
    doubled = baseline.model_copy(update={"items": [*baseline.items, baseline.items[0]]})
    with pytest.raises(EvalError, match="the candidate holds doc 0 more than once"):
        pair_set(target, baseline, doubled, {}, None)


def test_scores_of_another_set_version_or_metric_are_never_paired() -> None:
    target = eval_set(2)
    good = score({0: 1.0, 1: 1.0}, target)
    with pytest.raises(EvalError, match="the baseline was scored on set 'payment' \\(hash 000000000000\\)"):
        pair_set(target, good.model_copy(update={"eval_set_sha256": "0" * 64}), good, {}, None)
    with pytest.raises(EvalError, match="the candidate was scored with"):
        pair_set(target, good, good.model_copy(update={"metric": make_spec("exact_match", "mean", False)}), {}, None)


def test_kl_for_a_doc_outside_the_set_is_an_error() -> None:
    target = eval_set(2)
    both = score({0: 1.0, 1: 1.0}, target)
    with pytest.raises(EvalError, match="KL measured for items not in the set: doc 5"):
        pair_set(target, both, both, {0: 0.1, 5: 0.2}, "top-20")


def test_corpus_values_pair_as_lm_eval_logged_them() -> None:
    target = eval_set(2, make_spec("f1", "f1", True))
    comparison = pair_set(target, score({0: [1, 1], 1: [0, 1]}, target), score({0: [1, 0], 1: [0, 0]}, target), {}, None)
    assert [(i.baseline, i.candidate) for i in comparison.items] == [([1, 1], [1, 0]), ([0, 1], [0, 0])]


def test_a_non_finite_baseline_value_is_one_error_line_naming_the_file_and_doc() -> None:
    target = eval_set(2)
    with pytest.raises(EvalError) as caught:
        pair_set(target, score({0: 1.0, 1: float("nan")}, target), score({0: 1.0, 1: 1.0}, target), {}, None)
    line = caught.value.one_line()
    assert line.startswith("eval_sets/payment/data.jsonl: doc 1: eval set payment: the baseline's exact_match is not finite")
    assert "\n" not in str(caught.value) and caught.value.exit_code == 2


def test_a_non_finite_candidate_value_pairs_for_the_gate_to_reject() -> None:
    target = eval_set(2, make_spec("word_perplexity", "weighted_perplexity", False))
    comparison = pair_set(target, score({0: [-5.0, 4], 1: [-6.0, 3]}, target), score({0: [float("-inf"), 4], 1: [-6.0, 3]}, target), {}, None)
    assert comparison.items[0].candidate[0] == float("-inf")


@pytest.mark.parametrize(("metric", "base", "cand", "message"), [
    (make_spec("word_perplexity", "weighted_perplexity", False), [-6.0, 3], [-6.0, 4],
     "doc 1: the baseline's word count is 3, the candidate's 4; per-item word count must agree"),
    (make_spec("bits_per_byte", "bits_per_byte", False), [-6.0, 30], [-6.0, 29], "the baseline's byte count is 30, the candidate's 29"),
    (make_spec("bleu", "bleu", True), ["ref a", "hyp"], ["ref b", "hyp"], "the baseline's gold is 'ref a', the candidate's 'ref b'"),
])
def test_per_item_counts_must_agree_between_the_models(metric, base, cand, message) -> None:
    target = eval_set(2, metric)
    first = [-5.0, 4] if metric.aggregation != "bleu" else ["ref", "hyp"]
    with pytest.raises(EvalError, match=message):
        pair_set(target, score({0: first, 1: base}, target), score({0: first, 1: cand}, target), {}, None)


def test_a_comparison_the_gate_refuses_is_one_input_error_line() -> None:
    target = eval_set(2)
    with pytest.raises(InputError) as caught:
        pair_set(target, score({0: 1.0, 1: 0.5}, target), score({0: 1.0, 1: 1.0}, target), {}, None)
    assert caught.value.one_line().startswith("eval set payment: ") and "binary metric" in caught.value.one_line()
