"""One command renders eval-set templates for a TOTAL of COMMAND_SECONDS of CPU, whatever the item count: a budget grown
by every rendering let 100,000 items of a 0.7 ms template run 131 s and exit 0."""

from __future__ import annotations

import gc
import time

import pytest
from fakes import TASK_CONFIG, write_eval_set

from pipelines.cli import main
from pipelines.evaluation import budget
from pipelines.evaluation.templates import CommandBudgetError, RenderBudget, compile_template

# about 0.2-0.5 ms a rendering: far inside the 2 s per item and the set's 10 s + 1 ms a rendering
SLOWISH = "{% for i in range(200) %}{% endfor %}{{q}}"


def test_the_command_budget_is_not_grown_by_renderings():
    command = budget.CommandBudget(0.05)
    template = compile_template("Q: {{ q }}")
    rendering = RenderBudget(command=command)
    # A collection of the worker's whole heap (it holds what earlier tests left) runs in whichever rendering triggers it,
    # and is billed to it: 0.6 s in one rendering in a clean-clone CI run. Collected before, and paused during, the loop.
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(CommandBudgetError, match=r"this command's templates took more than 0.05 s of CPU in all \([\d,]+ renderings\)"):
            for index in range(200_000):  # 20-80 us each: a budget grown by 1 ms a rendering would never end
                rendering.render(template, {"q": index})
    finally:
        gc.enable()
    assert command.allowed == 0.05 and command.spent < 0.05 + 0.1


def test_validate_stops_at_the_command_total_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(budget, "COMMAND_SECONDS", 0.3)  # 60 s in the product: the same rule at a test's scale
    write_eval_set(tmp_path, "many", {**TASK_CONFIG, "task": "many", "doc_to_text": SLOWISH, "doc_to_target": "a"},
                   [{"q": f"q{i}", "a": "x"} for i in range(20_000)])
    began = time.process_time()
    code = main(["eval-sets", "validate", "--root", str(tmp_path)])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1, error
    assert "this command's templates took more than 0.3 s of CPU in all" in error and "data.jsonl line" in error
    assert time.process_time() - began < 5  # 20,000 renderings would take 4-10 s; the set's own budget allows 30 s
