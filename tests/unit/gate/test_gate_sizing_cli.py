"""Sizing from the command line: `quantize eval-sets power`, and `quantize gate` refusing a policy its sets cannot meet
(exit 2 before any server starts, one line naming the policy file, the field, the set, its n and the n needed)."""

from __future__ import annotations

import json

import pytest
from fakes import make_model

from pipelines import cli
from pipelines.commands import gate as gate_command
from pipelines.gate import exact


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_power_gives_each_set_s_minimum_certifiable_tolerance_and_items_needed(capsys, sets_root):
    code, out, err = run(capsys, "eval-sets", "power", "--root", str(sets_root), "--discordance", "0,0.04", "--json")
    assert code == 0, err
    document = json.loads(out)
    tickets, tiny = document["sets"]
    # An identical candidate passes 5.5 points from 53 items (0.945^53 <= 5%: the calibrated test's exact minimum).
    assert (tickets["name"], tickets["items"], tickets["tolerance"], tickets["identical_items_needed"]) == ("tickets", 120, 5.5, 53)
    assert tickets["refused"] is None and tickets["guarantee"].startswith("P(promote | true worsening = tolerance) <= 1 - confidence, exact")
    zero, four = tickets["by_discordance"]
    # at psi 0 an identical candidate's bound, z^2 / (120 + z^2) at the critical value calibrated for 120 items
    z = exact.critical_value(120, 0.055, 0.95)
    assert zero["certifies"] == pytest.approx(100 * z**2 / (120 + z**2), abs=1e-3) and zero["items_needed"] == 53
    assert four["items_needed"] == 126 and four["certifies"] > 5.5  # 120 items fall just short at 4% discordance
    # promote_at_tolerance: a true drop of 5.5 points, worst split of a discordance up to max(psi, 5.5%), exact over the
    # multinomial tables through the gate's own decision: never above 5%. At psi 0 only losses (p_lose 0.055, p_gain 0).
    assert zero["worst_split"] == {"p_lose": 0.055, "p_gain": 0.0}
    assert 0.03 < zero["promote_at_tolerance"] <= 0.05 and zero["promote_at_tolerance"] <= four["promote_at_tolerance"] <= 0.05
    assert tiny["refused"].startswith("defaults.ni_margin: eval set tiny: 30 items cannot show") and "at least 53 items" in tiny["refused"]
    assert [row["discordance"] for row in document["whole_run"]] == [0.0, 0.04]
    assert document["whole_run"][0]["reject_probability"] == 1.0  # tiny rejects even an identical candidate


def test_power_renders_a_table(capsys, sets_root):
    code, out, _ = run(capsys, "eval-sets", "power", "--root", str(sets_root), "--eval-sets", "tickets")
    assert code == 0 and "psi 0.04: certifies / needs" in out and "tickets" in out and "tiny" not in out


def test_gate_refuses_a_policy_its_sets_cannot_meet_before_serving(capsys, sets_root, tmp_path, monkeypatch):
    monkeypatch.setattr(gate_command, "run_gate", lambda job: pytest.fail("no gate may start"))
    model = make_model(tmp_path / "model")
    code, out, err = run(capsys, "gate", "--artifact", str(model), "--baseline", str(model), "--recipe-name", "w8a8",
                         "--allow-unverified", "--no-registry", "--eval-sets", "tickets,tiny")
    (line,) = [line for line in err.splitlines() if line.startswith("quantize: error:")]
    assert code == 2 and out == ""
    assert line.endswith("policies/default.yaml: defaults.ni_margin: eval set tiny: 30 items cannot show a worsening under "
                         "ni_margin 5.5 points at 95% confidence even against an identical model (its bound is at least "
                         "9.55 points); it needs at least 53 items")
