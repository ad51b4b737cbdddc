"""Figures no server or tool can produce are refused where the product reads them: a number too large for a float (`1e999`,
read as infinity) in any JSON or JSON Lines file (spec.json, load-test results, eval-set fields, a registry's evidence).
A negative gauge on a metrics page makes its window invalid (tests/unit/watch/test_watch_hostile.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.errors import InputError
from pipelines.files.jsonio import parse_json_strict
from pipelines.files.jsonl import iter_jsonl


@pytest.mark.parametrize("text", ['{"p95_ttft_ms": 1e999}', '{"x": [-1E400]}', '{"limit": NaN}'])
def test_a_json_number_that_is_not_finite_is_refused(text: str) -> None:
    with pytest.raises(InputError, match="not a finite number|not a number JSON allows") as caught:
        parse_json_strict(text.encode(), "spec.json")
    assert caught.value.file == "spec.json"


def test_a_json_lines_number_too_large_for_a_float_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"answer": 1.5}\n{"answer": 1e999}\n')
    with pytest.raises(InputError, match="not a finite number") as caught:
        list(iter_jsonl(path))
    assert caught.value.field == "line 2"


def test_lm_evals_own_samples_file_keeps_its_non_finite_values(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text('{"v": NaN}\n{"v": 1e999}\n')
    values = [row["v"] for _, row in iter_jsonl(path, non_finite=True)]
    assert values[1] == float("inf") and values[0] != values[0]
