"""Pairing a set's baseline and candidate items, refusing anything that would make the comparison unsound.

Items pair by doc_id, their position in the set: two identical items (same doc_hash) are two pairs,
never one. Both runs must hold exactly the set's items, each once, and each item's doc_hash must agree
(lm-eval hashes the item it loaded, so a differing hash means the two runs scored different data).
"""

from __future__ import annotations

from pydantic import ValidationError

from pipelines.errors import EvalError, InputError, from_validation_error
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import ItemScore, SetScore
from pipelines.gate.verdict import PairedItem, SetComparison, non_finite

_SHOWN = 5  # doc ids named in an error before "..."


def pair_set(
    eval_set: EvalSet, baseline: SetScore, candidate: SetScore, kl_by_doc: dict[int, float | None], kl_method: str | None,
    repeat: SetScore | None = None,
) -> SetComparison:
    """The set's paired items; EvalError (exit 2) naming the set if the runs do not hold the same items. `repeat`: the
    baseline's second scoring (the noise floor), checked against the baseline like the candidate is."""
    runs = [("candidate", candidate)] + ([("baseline's second scoring", repeat)] if repeat is not None else [])
    _check_scored_on(eval_set, "baseline", baseline)
    base = _by_doc(eval_set, "baseline", baseline)
    _check_baseline_finite(eval_set, base)
    by_role = {}
    for role, score in runs:
        _check_scored_on(eval_set, role, score)
        by_role[role] = other = _by_doc(eval_set, role, score)
        _check_same_items(eval_set, base, other, role)
        _check_same_docs(eval_set, base, other, role)
        _check_same_counts(eval_set, base, other)
    if repeat is not None:
        _check_baseline_finite(eval_set, by_role["baseline's second scoring"])
    cand, again = by_role["candidate"], by_role.get("baseline's second scoring")
    stray = sorted(set(kl_by_doc) - set(base))
    if stray:
        raise EvalError(f"eval set {eval_set.name}: KL measured for items not in the set: {_docs(stray)}")
    items = [_paired(eval_set, base[doc], cand[doc], kl_by_doc.get(doc), again[doc] if again else None) for doc in sorted(base)]
    try:
        return SetComparison(eval_set=eval_set.name, metric=eval_set.metric, items=items, kl_method=kl_method)
    except ValidationError as error:  # the gate's checks of the whole set: their message, not the input echoed
        raise InputError(error.errors()[0]["msg"].removeprefix("Value error, "), field=f"eval set {eval_set.name}") from None


def _paired(eval_set: EvalSet, base: ItemScore, cand: ItemScore, kl: float | None, again: ItemScore | None) -> PairedItem:
    try:
        return PairedItem(item_id=base.item_id, baseline=base.value, candidate=cand.value, kl=kl,
                          baseline_repeat=again.value if again is not None else None)
    except ValidationError as error:
        raise from_validation_error(error, f"eval set {eval_set.name}: item {base.item_id}") from None


def _check_scored_on(eval_set: EvalSet, role: str, score: SetScore) -> None:
    """A score of another set, another version of it or another metric is never paired."""
    if (score.eval_set, score.eval_set_sha256) != (eval_set.name, eval_set.sha256):
        raise EvalError(
            f"eval set {eval_set.name}: the {role} was scored on set {score.eval_set!r} "
            f"(hash {score.eval_set_sha256[:12]}), not this one (hash {eval_set.sha256[:12]})"
        )
    if score.metric != eval_set.metric:
        raise EvalError(f"eval set {eval_set.name}: the {role} was scored with {score.metric!r}, the set says {eval_set.metric!r}")


def _by_doc(eval_set: EvalSet, role: str, score: SetScore) -> dict[int, ItemScore]:
    items: dict[int, ItemScore] = {}
    for item in score.items:
        if item.doc_id in items:
            raise EvalError(f"eval set {eval_set.name}: the {role} holds doc {item.doc_id} more than once")
        items[item.doc_id] = item
    return items


def _check_same_items(eval_set: EvalSet, base: dict[int, ItemScore], cand: dict[int, ItemScore], role: str = "candidate") -> None:
    expected = set(range(eval_set.num_items))
    if set(base) == set(cand) == expected:
        return
    gaps = {
        "missing from baseline": expected - set(base),
        f"missing from {role}": expected - set(cand),
        "not in the set": (set(base) | set(cand)) - expected,
    }
    detail = "; ".join(f"{label}: {_docs(sorted(docs))}" for label, docs in gaps.items() if docs)
    raise EvalError(
        f"eval set {eval_set.name}: baseline has {len(base)} items, {role} {len(cand)}, the set {eval_set.num_items}; {detail}"
    )


def _check_same_docs(eval_set: EvalSet, base: dict[int, ItemScore], cand: dict[int, ItemScore], role: str = "candidate") -> None:
    differing = [doc for doc in sorted(base) if base[doc].doc_hash != cand[doc].doc_hash]
    if differing:
        raise EvalError(
            f"eval set {eval_set.name}: {len(differing)} item(s) differ between the baseline and {role} runs "
            f"(doc_hash): {_docs(differing)}"
        )


def _check_baseline_finite(eval_set: EvalSet, base: dict[int, ItemScore]) -> None:
    """The baseline is the reference: a NaN or infinite value in it leaves nothing to compare against (exit 2, naming the
    items). A candidate's non-finite values are the gate's to reject."""
    broken = [doc for doc in sorted(base) if non_finite(base[doc].value)]
    if broken:
        first = base[broken[0]].value
        raise EvalError(
            f"eval set {eval_set.name}: the baseline's {eval_set.metric.name} is not finite (NaN or infinite) on "
            f"{_docs(broken)} (first: {first!r}); the baseline cannot be compared against", file=eval_set.data, field=f"doc {broken[0]}",
        )


# The corpus aggregations whose per-item values are [loglikelihood, count]: the count (words or bytes of the item's
# text) is the same text measured twice, so it must agree; the others log [gold, prediction]: the gold must agree.
COUNTED_AGGREGATIONS = frozenset({"weighted_perplexity", "bits_per_byte"})


def _check_same_counts(eval_set: EvalSet, base: dict[int, ItemScore], cand: dict[int, ItemScore]) -> None:
    """Per-item word/byte counts (and the gold of [gold, prediction] values) must agree between the two runs: a count
    that differs means the models were scored on different text, and the aggregate would weigh them differently."""
    if eval_set.metric.kind != "corpus":
        return
    index = 1 if eval_set.metric.aggregation in COUNTED_AGGREGATIONS else 0
    what = _counted(eval_set.metric.name) if index == 1 else "gold"
    for doc in sorted(base):
        b, c = base[doc].value, cand[doc].value
        if isinstance(b, list) and isinstance(c, list) and len(b) > index and len(c) > index and b[index] != c[index]:
            raise EvalError(
                f"eval set {eval_set.name}: doc {doc}: the baseline's {what} is {b[index]!r}, the candidate's {c[index]!r}; "
                f"per-item {what} must agree between the two models (the same text, measured twice)",
                file=eval_set.data, field=f"doc {doc}",
            )


def _counted(metric: str) -> str:
    return "byte count" if "byte" in metric else "word count" if "word" in metric else "count"


def _docs(doc_ids: list[int]) -> str:
    shown = ", ".join(str(doc) for doc in doc_ids[:_SHOWN])
    more = f", ... ({len(doc_ids)} in all)" if len(doc_ids) > _SHOWN else ""
    return f"doc{'s' if len(doc_ids) > 1 else ''} {shown}{more}"
