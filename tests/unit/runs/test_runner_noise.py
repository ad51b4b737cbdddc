"""The runner's noise floor (policy noise_floor): the baseline scored a second time on a fresh server, cached like the
first, reported per set, and a tolerance under the measured floor refused before the candidate is served."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fakes import gate_settings

from pipelines.errors import InputError
from pipelines.gate.policy import RuleOverrides
from pipelines.runs import runner


def gate(ws: SimpleNamespace, settings: runner.GateSettings | None = None) -> runner.RunOutcome:
    job = runner.GateJob(artifact_dir=ws.artifact, baseline_dir=ws.baseline, recipe_name="w8a8", settings=settings or gate_settings(ws))
    return runner.run_gate(job)


def with_set_rules(ws: SimpleNamespace, **rules: object) -> runner.GateSettings:
    settings = gate_settings(ws)
    policy = settings.policy.model_copy(update={"eval_sets": {ws.eval_set.name: RuleOverrides(**rules)}})
    return settings.model_copy(update={"policy": policy})


def test_a_pass_fail_set_gets_its_baseline_scored_twice_once_and_reported(stack, workspace):
    stack.unstable = {3, 7}
    stack.lost = 4  # the candidate answers items 0-3 wrong
    first = gate(workspace)
    second = gate(workspace)
    assert stack.starts == ["baseline", "baseline_repeat", "candidate"]  # the second run reads both passes from the cache
    floor = json.loads(first.gate_json.read_text())["gate"]["sets"][0]["noise_floor"]
    assert (floor["flips"], floor["right_to_wrong"], floor["wrong_to_right"], floor["n"]) == (2, 2, 0, 120)
    assert [item.split(":")[0] for item in floor["unstable_items"]] == ["3", "7"]
    assert floor["reference"] == "mean of both passes" and floor["floor"] == pytest.approx(100 * 2 / 120, abs=1e-6)
    assert floor["rate_low"] < 2 / 120 < floor["rate_high"]
    assert floor["candidate_flips"] == 4 and floor["candidate_flips_on_unstable"] == 1  # item 3
    # the mean of both passes is the reference (items 3 and 7 at 1/2): item 3 costs half a loss, item 7 gains half
    verdict = first.report.gate.sets[0]
    assert verdict.baseline_score == pytest.approx(100 * 119 / 120, abs=1e-6) and verdict.delta == pytest.approx(-100 * 3 / 120, abs=1e-6)
    assert (verdict.flips_right_to_wrong, verdict.flips_wrong_to_right) == (4, 0)  # against the first pass, as max_flip_rate reads
    markdown = first.report_md.read_text()
    assert "## Runtime noise floor" in markdown and "| tickets | 2 / 120 | 2 / 0 |" in markdown and "| 3, 7 |" in markdown
    assert json.loads(second.gate_json.read_text())["gate"]["sets"][0]["noise_floor"] == floor


def test_noise_floor_false_scores_the_baseline_once(stack, workspace):
    outcome = gate(workspace, with_set_rules(workspace, noise_floor=False))
    assert stack.starts == ["baseline", "candidate"]
    assert outcome.report.gate.sets[0].noise_floor is None


def test_a_tolerance_under_the_measured_floor_is_refused_before_the_candidate_is_served(stack, workspace):
    stack.unstable = set(range(6))  # 6 of 120: a floor of 5 points
    with pytest.raises(InputError) as raised:
        gate(workspace, with_set_rules(workspace, ni_margin=4.0, max_abs_drop=None))
    assert "candidate" not in stack.starts
    line = str(raised.value)
    assert "\n" not in line and raised.value.field == "eval_sets.tickets.ni_margin" and "policies/default.yaml" in line
    assert "tolerance 4 points is smaller than the runtime's own noise floor 5.00 points (6 of 120 items" in line
    assert [p.name.endswith("-error") for p in workspace.runs.iterdir()] == [True]  # the run's evidence kept, never a verdict


def test_score_baseline_scores_the_second_pass_too_and_then_nothing(stack, workspace):
    settings = gate_settings(workspace)
    assert runner.score_baseline(workspace.baseline, settings) == [workspace.eval_set.name]
    assert runner.score_baseline(workspace.baseline, settings) == []
    assert stack.starts == ["baseline", "baseline_repeat"]
