"""scripts/hostile_cases.py, two of its cases for real (the `quantize` command line as a subprocess): a forged state.json
naming a stranger's pid (serve stop must refuse it and leave the process alive) and a symlinked `watch --out` (refused,
nothing written through the link); the table row of each, and the judge's verdict on outcomes that break."""

from __future__ import annotations

import importlib
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from pipelines.paths import REPO_ROOT

SCRIPTS = REPO_ROOT / "scripts"


@pytest.fixture(scope="module")
def hostile():
    before = list(sys.path)  # the script puts its own folder and the test folders first: not for the tests after this one
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module("hostile_cases")
    finally:
        sys.path[:] = before


@pytest.mark.slow
def test_two_cases_run_through_the_real_command_line_are_ok(hostile):
    rows = []
    with hostile.workspace(seed=False) as ws:
        for builder in (hostile.hostile_inputs.stop_unrecorded_start, hostile.hostile_inputs.watch_linked_out):
            with ExitStack() as stack:
                rows.append(hostile.run(ws, builder(ws, stack)))
    for row in rows:
        assert row.outcome.code == 2 and row.ok, (row.problems, row.outcome.stderr)
        assert row.outcome.stderr.startswith("quantize: error:") and row.outcome.cpu_s > 0
    table = hostile.table(rows).splitlines()
    assert len(table) == 4 and all(line.endswith("| OK |") for line in table[2:])
    assert "is not running" in table[2] and "symbolic link" in table[3]


def test_the_judge_calls_a_wrong_code_a_hang_a_traceback_a_long_line_and_a_failed_check_breaks(hostile):
    case = hostile.Case("c", ["x"], expect=(2,), limit_s=5, cpu_limit_s=1, check=lambda outcome: "alias moved" if outcome.stdout else None)
    outcome = hostile.Outcome
    assert hostile.judge(case, outcome(code=2, seconds=1, cpu_s=0.5, stdout="", stderr="quantize: error: x\n")) == []
    assert hostile.judge(case, outcome(code=0, seconds=1, cpu_s=0.5, stdout="", stderr="")) == ["exit 0, expected 2"]
    assert hostile.judge(case, outcome(code=None, seconds=5, cpu_s=0.5, stdout="", stderr="")) == ["killed at 5 s"]
    assert hostile.judge(case, outcome(code=2, seconds=1, cpu_s=3, stdout="", stderr="")) == ["3 s of CPU (bound 1 s)"]
    assert hostile.judge(case, outcome(code=2, seconds=1, cpu_s=0, stdout="", stderr="Traceback (most recent call last):\n")) == ["traceback"]
    assert hostile.judge(case, outcome(code=2, seconds=1, cpu_s=0, stdout="", stderr="e" * 3000)) == ["a 3,000-character stderr line"]
    assert hostile.judge(case, outcome(code=2, seconds=1, cpu_s=0, stdout="moved", stderr="")) == ["alias moved"]
    assert Path(hostile.QUANTIZE).name == "quantize"
