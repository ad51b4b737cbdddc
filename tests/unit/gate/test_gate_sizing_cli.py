"""Sizing from the command line: `quantize eval-sets power`, and `quantize gate` refusing a policy its sets cannot meet
(exit 2 before any server starts, one line naming the policy file, the field, the set, its n and the n needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import make_eval_set, make_model

from pipelines import cli
from pipelines.commands import gate as gate_command


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def sets_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "eval_sets"
    make_eval_set(root, "tickets", items=120)
    make_eval_set(root, "tiny", items=30)
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(root))
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    return root


def test_power_gives_each_set_s_minimum_certifiable_tolerance_and_items_needed(capsys, sets_root):
    code, out, err = run(capsys, "eval-sets", "power", "--root", str(sets_root), "--discordance", "0,0.04", "--json")
    assert code == 0, err
    document = json.loads(out)
    tickets, tiny = document["sets"]
    assert (tickets["name"], tickets["items"], tickets["tolerance"], tickets["identical_items_needed"]) == ("tickets", 120, 5.5, 47)
    assert tickets["refused"] is None
    zero, four = tickets["by_discordance"]
    assert zero == {"discordance": 0.0, "certifies": pytest.approx(100 * 1.6448536**2 / (120 + 1.6448536**2), abs=1e-3), "items_needed": 47}
    assert four["items_needed"] == 126 and four["certifies"] > 5.5  # 120 items fall just short at 4% discordance
    assert tiny["refused"].startswith("defaults.ni_margin: eval set tiny: 30 items cannot show") and "at least 47 items" in tiny["refused"]
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
                         "8.27 points); it needs at least 47 items")
