"""The job's objective: the winner per model by size (as before: the fewest bytes) or by the measured throughput, the
report with both frontiers, `objective:` in the job file and `--objective` on the command line (bad values: exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import FakeRunner, demo_job, gate_report, install, make_eval_set, make_model

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.evaluation import evalsets
from pipelines.jobs.job import load_job, plan_candidates, run_job
from pipelines.loadtest.results import PerformanceSummary
from pipelines.recipe import LoadedRecipe
from pipelines.runs.runner import RunOutcome

# candidate / 16-bit output tokens/s per recipe, [low, high]: w8a8 the fastest, gptq's interval overlaps it
RATIOS = {"w8a8": (1.30, 1.22, 1.38), "w4a16": (0.80, 0.76, 0.84), "gptq": (1.25, 1.18, 1.33)}


class MeasuringRunner(FakeRunner):
    """FakeRunner whose runs carry their gate report, and a load test's headline when promoted (none for a recipe not in
    `ratios`)."""

    def __init__(self, tmp_path: Path, behaviour: dict[str, object], ratios: dict[str, tuple[float, float, float]]):
        super().__init__(tmp_path, behaviour)
        self.ratios = ratios

    def __call__(self, loaded: LoadedRecipe, model_dir: Path, settings, **kwargs) -> RunOutcome:
        outcome = super().__call__(loaded, model_dir, settings, **kwargs)
        outcome = outcome.model_copy(update={"report": gate_report(outcome.verdict)})
        ratio = self.ratios.get(loaded.name)
        if outcome.verdict != "promoted" or ratio is None:
            return outcome
        estimate, low, high = ratio
        return outcome.model_copy(update={"performance": PerformanceSummary(
            enforced=False, passed=True, target="cpu", deployment_concurrency=8, throughput_ratio=estimate, throughput_interval=[low, high],
            speed="faster" if low > 1.1 else "slower", pairs=5, ttft_p95_ratio=1.0, measured_max_num_seqs=8)})


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    sets = [make_eval_set(tmp_path / "eval_sets", "tickets")]
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: sets)
    make_model(tmp_path / "models" / "demo-llama")
    return tmp_path


def run(workspace: Path, monkeypatch, ratios=RATIOS, objective=None, extra: str = "", jobs: str = "jobs"):
    """The demo job's four recipes on the demo model, aggressive rejected; `jobs`: the ledger's folder (a fresh one runs
    every candidate again)."""
    install(monkeypatch, MeasuringRunner(workspace, {"aggressive": "rejected"}, ratios))
    path = demo_job(workspace, ["w8a8", "w4a16", "gptq", "aggressive"], extra=extra)
    return run_job(path, jobs_dir=workspace / jobs, objective=objective)


def test_size_is_the_default_and_picks_the_fewest_bytes(workspace, monkeypatch):
    summary = run(workspace, monkeypatch)
    (choice,) = summary.choices
    assert summary.objective == "size" and choice.model == "demo-llama" and choice.choice.decided_by == "size"
    sizes = {r.recipe: r.weight_bytes for r in summary.results}
    assert sizes["w4a16"] == sizes["gptq"] < sizes["w8a8"] and all(r.quality is not None for r in summary.results)
    assert choice.choice.winner == "w4a16"  # 4-bit, the smallest that passed; equal bytes: the job file's order


def test_speed_picks_the_fastest_passing_candidate_and_reports_the_tie(workspace, monkeypatch):
    summary = run(workspace, monkeypatch, objective="speed")
    choice = summary.choices[0].choice
    assert (choice.winner, choice.decided_by) == ("w8a8", "speed") and choice.throughput_interval == [1.22, 1.38]
    assert choice.tied == ["w8a8", "gptq"] and choice.size_winner_of_tied == "gptq"
    assert any("Not distinguishable at 95% from gptq" in note and "By size, gptq would win among them." in note for note in choice.notes)


def test_the_job_files_objective_applies_and_the_option_overrides_it(workspace, monkeypatch):
    summary = run(workspace, monkeypatch, extra="objective: speed\n")
    assert summary.objective == "speed" and summary.choices[0].choice.winner == "w8a8"
    summary = run(workspace, monkeypatch, extra="objective: speed\n", objective="size")  # from the ledger: the choice is remade
    assert summary.objective == "size" and summary.choices[0].choice.decided_by == "size"


def test_a_passing_candidate_without_figures_cannot_win_and_none_at_all_falls_back_to_size(workspace, monkeypatch):
    summary = run(workspace, monkeypatch, ratios={"w4a16": (0.8, 0.76, 0.84)}, objective="speed")
    choice = summary.choices[0].choice
    assert choice.winner == "w4a16" and set(choice.without_figures) == {"w8a8", "gptq"}
    assert any("cannot win on speed" in note for note in choice.notes)
    summary = run(workspace, monkeypatch, ratios={}, objective="speed", jobs="jobs-unmeasured")
    choice = summary.choices[0].choice
    assert choice.decided_by == "size" and "No passing candidate has a load-test figure: chosen by size instead." in choice.notes


def test_the_report_shows_both_frontiers_per_model(workspace, monkeypatch):
    summary = run(workspace, monkeypatch, objective="speed")
    report = Path(summary.report_md)
    assert report == workspace / "jobs" / "nightly" / "report.md"
    text = report.read_text()
    rows = [line for line in text.splitlines() if " | passed | " in line or " | rejected | " in line]
    assert sorted(line.split(" | ")[0][2:] for line in rows) == ["aggressive", "gptq", "w4a16", "w8a8"]
    assert "| w8a8 | passed |" in text and "**winner (speed)**" in text and "| aggressive | rejected |" in text
    assert summary.choices[0].frontier_plots == {"bytes vs quality bound": "demo-llama-frontier-bytes.png",
                                                 "throughput vs quality bound": "demo-llama-frontier-speed.png"}
    for name in summary.choices[0].frontier_plots.values():
        assert (report.parent / name).stat().st_size > 1000 and f"]({name})" in text


def test_a_bad_objective_in_the_job_file_is_one_line_naming_the_file_and_field(workspace, capsys):
    path = demo_job(workspace, ["w8a8"], extra="objective: fastest\n")
    with pytest.raises(InputError) as error:
        load_job(path)
    assert "objective" in error.value.one_line() and str(path) in error.value.one_line()
    assert main(["job", str(path), "--json"]) == 2
    document = json.loads(capsys.readouterr().out)
    assert document["field"] == "objective" and document["file"] == str(path)


def test_speed_changes_the_key_of_a_repair_candidate_only(workspace):
    def keys(extra: str, repair: bool) -> str:
        path = demo_job(workspace, ["w8a8"], extra=extra)
        if repair:
            path.write_text(path.read_text() + "    repair: true\n")
        return plan_candidates(load_job(path), path)[0].key

    assert keys("objective: speed\n", repair=False) == keys("", repair=False)  # the choice is made after the verdicts
    assert keys("objective: speed\n", repair=True) != keys("", repair=True)  # a repair by speed may find another attempt
    assert keys("objective: size\n", repair=True) == keys("", repair=True)
