"""`--objective size|speed`: which passing candidate wins, how ties and missing load-test figures are said, the two
frontiers (table rows and PNG plots) in a repair's report.md, and the options refused with one line (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import make_eval_set

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.gate.policy import load_policy
from pipelines.loadtest.results import PerformanceSummary
from pipelines.recipe import load_recipe
from pipelines.repair import frontier
from pipelines.repair.objective import Contender, QualityBound, choose, require_load_test
from pipelines.repair.pricing import Price
from pipelines.repair.report import render
from pipelines.repair.result import Attempt, RepairResult
from pipelines.repair.search import Budget
from pipelines.repair.session import check_objective
from pipelines.runs.runner import GateSettings


def figures(ratio: float, low: float, high: float, speed: str = "faster") -> PerformanceSummary:
    return PerformanceSummary(enforced=False, passed=True, target="cpu", deployment_concurrency=16, throughput_ratio=ratio,
                              throughput_interval=[low, high], speed=speed, pairs=6, ttft_p95_ratio=1.0, measured_max_num_seqs=16)


def contender(name: str, size: int, ratio: tuple[float, float, float] | None, *, passed: bool = True, bound: float = 1.0) -> Contender:
    return Contender(name=name, passed=passed, weight_bytes=size, quality=QualityBound(value=bound, eval_set="tickets", unit="points"),
                     performance=figures(*ratio) if ratio else None)


SMALL_SLOW = contender("w4a16", 100, (0.80, 0.76, 0.84), bound=2.0)
MID_FAST = contender("w8a8", 200, (1.30, 1.22, 1.38), bound=1.0)
BIG_FASTISH = contender("w8a8-dynamic", 300, (1.20, 1.10, 1.31), bound=0.5)
REJECTED = contender("aggressive", 50, None, passed=False, bound=9.0)


def test_size_picks_the_smallest_that_passed_as_before():
    choice = choose([REJECTED, SMALL_SLOW, MID_FAST], "size")
    assert (choice.winner, choice.decided_by) == ("w4a16", "size") and choice.tied == []
    assert choice.notes == ["By size: w4a16 (100 weight bytes), the smallest that passed."]


def test_speed_picks_the_fastest_passing_candidate_with_its_interval():
    choice = choose([REJECTED, SMALL_SLOW, MID_FAST], "speed")
    assert (choice.winner, choice.decided_by) == ("w8a8", "speed")
    assert choice.throughput_ratio == 1.30 and choice.throughput_interval == [1.22, 1.38] and choice.tied == []
    assert "By speed: w8a8, throughput 1.300 [95% CI 1.220, 1.380], faster, 6 pairs" in choice.notes[0]
    assert "at concurrency 16" in choice.notes[0]


def test_overlapping_intervals_are_reported_as_a_tie_with_the_size_winner_among_them():
    choice = choose([SMALL_SLOW, MID_FAST, BIG_FASTISH], "speed")
    assert choice.winner == "w8a8" and choice.tied == ["w8a8", "w8a8-dynamic"] and choice.size_winner_of_tied == "w8a8"
    assert "Not distinguishable at 95% from w8a8-dynamic (1.200 [95% CI 1.100, 1.310]" in choice.notes[-1]
    assert choice.notes[-1].endswith("By size, w8a8 would win among them.")
    bigger_first = contender("w8a8", 400, (1.30, 1.22, 1.38))  # now the tied runner-up is the smaller one
    choice = choose([BIG_FASTISH, bigger_first], "speed")
    assert choice.winner == "w8a8" and choice.size_winner_of_tied == "w8a8-dynamic"


def test_a_candidate_without_load_test_figures_cannot_win_on_speed():
    unmeasured = contender("gptq", 150, None)
    choice = choose([SMALL_SLOW, unmeasured], "speed")
    assert choice.winner == "w4a16" and choice.decided_by == "speed" and choice.without_figures == ["gptq"]
    assert "gptq: passed the quality gate without a load-test figure" in choice.notes[0] and "cannot win on speed" in choice.notes[0]


def test_with_no_figures_at_all_speed_falls_back_to_size_with_a_note():
    choice = choose([REJECTED, contender("gptq", 150, None), contender("w8a8", 200, None)], "speed")
    assert (choice.winner, choice.objective, choice.decided_by) == ("gptq", "speed", "size")
    assert "No passing candidate has a load-test figure: chosen by size instead." in choice.notes
    assert choice.without_figures == ["gptq", "w8a8"]


def test_nothing_passed_has_no_winner():
    choice = choose([REJECTED], "speed")
    assert choice.winner is None and choice.decided_by is None and choice.notes == ["Nothing passed the quality gate."]


def test_the_frontier_table_has_one_row_per_candidate_and_marks_the_frontiers_and_the_winner():
    contenders = [REJECTED, SMALL_SLOW, MID_FAST, BIG_FASTISH]
    rows = frontier.rows(contenders, choose(contenders, "speed"))
    assert [row[0] for row in rows] == ["aggressive", "w4a16", "w8a8", "w8a8-dynamic"]
    by_name = {row[0]: dict(zip(frontier.COLUMNS, row, strict=True)) for row in rows}
    assert by_name["aggressive"]["verdict"] == "rejected" and by_name["aggressive"]["bytes frontier"] == ""
    assert by_name["aggressive"]["throughput ratio [95% CI]"] == "-"
    # bytes: every passing one trades bytes for a tighter bound; speed: w4a16 is slower and looser than w8a8
    assert [by_name[n]["bytes frontier"] for n in ("w4a16", "w8a8", "w8a8-dynamic")] == ["yes", "yes", "yes"]
    assert [by_name[n]["speed frontier"] for n in ("w4a16", "w8a8", "w8a8-dynamic")] == ["", "yes", "yes"]
    assert by_name["w8a8"]["chosen"] == "**winner (speed)**" and by_name["w4a16"]["quality bound (worst set)"] == "+2.00 points (tickets)"


def test_the_frontier_plots_are_written(tmp_path):
    contenders = [REJECTED, SMALL_SLOW, MID_FAST]
    plots = frontier.write_plots(contenders, choose(contenders, "speed"), tmp_path, "demo-")
    assert plots == {"bytes vs quality bound": "demo-frontier-bytes.png", "throughput vs quality bound": "demo-frontier-speed.png"}
    assert all((tmp_path / name).stat().st_size > 1000 for name in plots.values())
    unmeasured = [contender("gptq", 150, None)]
    assert list(frontier.write_plots(unmeasured, choose(unmeasured, "speed"), tmp_path)) == ["bytes vs quality bound"]


def attempt(number: int, size: int, verdict: str, ratio: tuple[float, float, float] | None) -> Attempt:
    return Attempt(number=number, moves=number, why="test", recipe_name=f"aggressive-repair-{number}", recipe_file=f"attempt-{number}.yaml",
                   modules_moved={}, overrides_added=[], predicted_kl=0.01, weight_bytes=size, price=Price(weight_bytes=size), verdict=verdict,
                   quality=QualityBound(value=1.0 + number, eval_set="tickets", unit="points"), performance=figures(*ratio) if ratio else None)


def test_a_repairs_report_shows_the_choice_and_both_frontiers(tmp_path):
    attempts = [attempt(1, 300, "promoted", (1.4, 1.3, 1.5)), attempt(2, 100, "rejected", None), attempt(3, 200, "promoted", (0.9, 0.85, 0.95))]
    result = RepairResult(repair_id="r", created_at="now", status="repaired", repair_dir=str(tmp_path), parent={"run_id": "p", "recipe": "aggressive",
                          "registry_version": None}, model="m", target="cpu", ladder={"path": "cpu.yaml"}, budget=Budget(), settings={}, units=0,
                          attempts=attempts, objective="speed")
    assert [a.number for a in result.gated()] == [2, 3, 1]  # size order
    result.choice = choose([a.contender() for a in result.gated()], "speed")
    result.frontier_plots = frontier.write_plots([a.contender() for a in result.gated()], result.choice, tmp_path)
    report = render(result)
    assert result.choice.winner == "attempt 1" and "| Objective | speed (decided by speed) |" in report
    assert "## Objective: speed; the frontiers" in report and "By speed: attempt 1, throughput 1.400" in report
    table = [line for line in report.splitlines() if line.startswith("| attempt ")]
    assert [line.split(" | ")[0] for line in table] == ["| attempt 2", "| attempt 3", "| attempt 1"]
    assert "![bytes vs quality bound](frontier-bytes.png)" in report and (tmp_path / "frontier-speed.png").is_file()


def test_speed_refuses_a_repair_without_the_load_test(tmp_path):
    with pytest.raises(InputError, match="drop --no-loadtest"):
        require_load_test("speed", loadtest=False, enabled=True, policy_path=tmp_path / "p.yaml")
    with pytest.raises(InputError) as error:
        require_load_test("speed", loadtest=True, enabled=False, policy_path=tmp_path / "p.yaml")
    assert error.value.field == "performance.enabled"
    require_load_test("size", loadtest=False, enabled=False, policy_path=tmp_path / "p.yaml")  # size needs no figures


@pytest.mark.parametrize("argv", [
    ["repair", "some-run", "--objective", "fastest"],
    ["job", "jobs/demo.yaml", "--objective", "Speed"],
    ["--recipe", "w8a8", "--repair", "--objective", ""],
])
def test_a_bad_objective_is_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--objective" in lines[0] and "size" in lines[0] and "speed" in lines[0], lines


def test_speed_with_no_loadtest_fails_before_quantizing(tmp_path, monkeypatch, capsys):
    from pipelines.commands import run as run_command
    from pipelines.evaluation import evalsets

    sets = [make_eval_set(tmp_path / "eval_sets", "tickets")]
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: sets)
    monkeypatch.setattr(run_command, "quantize_and_gate", lambda *a, **k: pytest.fail("quantized before refusing"))
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    argv = ["--recipe", "aggressive", "--repair", "--objective", "speed", "--no-loadtest", "--no-registry", "--eval-sets", "tickets"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--no-loadtest" in lines[0] and "--objective speed" in lines[0], lines


def test_the_policy_turning_the_load_test_off_refuses_speed_naming_the_field(tmp_path):
    policy = load_policy()
    policy = policy.model_copy(update={"performance": policy.performance.model_copy(update={"enabled": False})})
    settings = GateSettings(eval_sets=[], policy=policy, policy_path=Path("policies/default.yaml"))
    with pytest.raises(InputError) as error:
        check_objective("speed", settings, load_recipe("aggressive").recipe.identity)
    assert error.value.field == "performance.enabled"
