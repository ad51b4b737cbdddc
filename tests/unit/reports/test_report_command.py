"""`quantize report RUN_ID|NAME [--out FILE]`: a gate run leaves report.html beside report.md; the command writes the
page of a run, a repair or a registry model; an unknown name is one line, exit 2, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

from pipelines.cli import main

DATA = Path(__file__).resolve().parents[2] / "data" / "reports"
REPAIR = "20261207T160407Z-repair-aggressive-18708-55ab84"


def only_run(workspace: SimpleNamespace) -> Path:
    (run,) = [p for p in (workspace.root / "artifacts" / "runs").iterdir() if (p / "gate.json").is_file()]
    return run


def test_a_run_writes_its_page_and_the_command_writes_the_run_and_the_model_page(cli, workspace, capsys):
    assert cli() == 0
    run = only_run(workspace)
    written = (run / "report.html").read_text()
    assert '<div class="word">PROMOTED</div>' in written and 'id="set-0-tickets"' in written
    out = workspace.root / "pages" / "run.html"
    assert main(["report", run.name, "--out", str(out), "--registry", str(workspace.registry)]) == 0
    page = out.read_text()
    assert f"(run {run.name})" in page and 'id="set-0-tickets"' in page
    assert f"run page of {run.name}: {out}" in capsys.readouterr().out
    assert main(["report", "demo-llama", "--registry", str(workspace.registry)]) == 0
    model_page = (workspace.root / "artifacts" / "reports" / "demo-llama.html").read_text()
    assert "Model demo-llama" in model_page and 'id="version-0-1"' in model_page


def test_a_repair_folder_gets_the_repair_page(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    shutil.copytree(DATA / REPAIR, tmp_path / "artifacts" / "runs" / REPAIR)
    assert main(["report", REPAIR, "--json"]) == 0
    assert '"kind": "repair"' in capsys.readouterr().out
    assert '<div class="word">REPAIRED</div>' in (tmp_path / "artifacts" / "runs" / REPAIR / "report.html").read_text()


def test_an_unknown_run_or_model_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    for target in ("nosuch", "<script>alert(1)</script>", "../etc"):
        assert main(["report", target]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no run" in err and "unknown model" in err, err
    assert not (tmp_path / "artifacts" / "reports").exists()


def test_a_run_folder_without_evidence_and_a_folder_as_out_are_refused(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    (tmp_path / "artifacts" / "runs" / "20261207T000000Z-w8a8-1-abcdef-error").mkdir(parents=True)
    assert main(["report", "20261207T000000Z-w8a8-1-abcdef-error"]) == 2
    assert "neither gate.json nor repair.json" in capsys.readouterr().err
    shutil.copytree(DATA / REPAIR, tmp_path / "artifacts" / "runs" / REPAIR)
    assert main(["report", REPAIR, "--out", str(tmp_path)]) == 2
    assert "--out names the page's file" in capsys.readouterr().err
