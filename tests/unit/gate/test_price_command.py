"""`quantize eval-sets power` states each set's price: its bound's width against normal theory and an unchanged candidate's
pass rate, with where the noise came from (docs/gate-json.md, "Sizing")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import cli
from pipelines.evaluation.baseline import BaselineEntry, RepeatEntry, store
from pipelines.evaluation.evaluate import ItemScore, SetScore
from pipelines.settings import current


def power(capsys, root: Path, *extra: str) -> tuple[int, str, str]:
    code = cli.main(["eval-sets", "power", "--root", str(root), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_never_scored_set_is_priced_on_the_assumed_grid_exactly(capsys, sets_root):
    code, out, err = power(capsys, sets_root, "--discordance", "0.1", "--json")
    assert code == 0, err
    tickets, tiny = json.loads(out)["sets"]
    assert tickets["price_baseline"] is None and tiny["price"] == []  # tiny is refused at load: nothing can pass it
    low, high = tickets["price"]
    assert [entry["noise"] for entry in (low, high)] == [
        {"source": "assumed, not measured", "label": "discordance 0.02"}, {"source": "assumed, not measured", "label": "discordance 0.1"}]
    assert set(high) == {"noise", "n", "width_ratio", "unchanged_pass_rate", "unchanged_pass_rate_se", "reps", "method"}
    assert high["method"] == "exact" and high["n"] == 120 and high["width_ratio"] > 1.0
    # the same exact sum as the whole-run figure of this one set at discordance 0.1 and the same baseline score (tiny rejects always)
    document = json.loads(power(capsys, sets_root, "--eval-sets", "tickets", "--discordance", "0.1", "--json")[1])
    assert high["unchanged_pass_rate"] == pytest.approx(1.0 - document["whole_run"][0]["reject_probability"], abs=1e-4)
    assert 0.0 < high["unchanged_pass_rate"] < low["unchanged_pass_rate"] <= 1.0


def test_a_baseline_scored_twice_is_the_measured_noise(capsys, sets_root):
    from pipelines.evaluation.evalsets import validate_folder

    eval_set = validate_folder(sets_root / "tickets")
    first, again = [1.0] * 100 + [0.0] * 20, [0.0] * 2 + [1.0] * 98 + [0.0] * 20

    def score(values: list[float]) -> SetScore:
        return SetScore(eval_set="tickets", eval_set_sha256=eval_set.sha256, metric=eval_set.metric, score=sum(values) / 120, n=120,
                        items=[ItemScore(doc_id=i, doc_hash=f"h{i}", value=v) for i, v in enumerate(values)], wall_s=1.0)

    cache = current().baseline_cache_dir
    store(BaselineEntry(key="a" * 64, model_hash="m" * 64, score=score(first), references=[]), cache)
    store(RepeatEntry(key="b" * 64, model_hash="m" * 64, score=score(again), first_key="a" * 64), cache)
    code, out, err = power(capsys, sets_root, "--eval-sets", "tickets", "--json")
    assert code == 0, err
    (row,) = json.loads(out)["sets"]
    assert row["price_baseline"] == {"model_hash": "m" * 64, "scored_twice": True}
    measured, upper = row["price"]
    assert measured["noise"]["source"] == "measured" and "2 of 120 items differ" in measured["noise"]["label"]
    assert upper["noise"]["source"] == "measured, upper end" and upper["unchanged_pass_rate"] <= measured["unchanged_pass_rate"]
    code, text, _ = power(capsys, sets_root, "--eval-sets", "tickets")
    assert code == 0 and "Price" in text and "measured" in text and "(exact)" in text


def test_price_seconds_out_of_range_is_an_input_error(capsys, sets_root):
    code, _, err = power(capsys, sets_root, "--price-seconds", "0")
    assert code == 2 and "--price-seconds" in err
