"""The three pages opened in headless Chromium: each loads with no console message (no error, no blocked script or
fetch), the verdict and every set's or version's row are in the DOM, and a screenshot is kept (the pytest tmp dir and
artifacts/test-screenshots/). A page with one unescaped script is caught: the check can fail."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from browser import keep_screenshot, open_page
from fakes import make_artifact, make_gate, new_version, promote

from pipelines.gate.schema import read_report
from pipelines.registry.store import Registry
from pipelines.repair.page import render_repair_page
from pipelines.repair.result import load_result
from pipelines.reports.model_page import ModelHistory, render_model_page
from pipelines.reports.run_page import render_run_page

pytestmark = pytest.mark.slow  # a browser start per page: seconds each under the suite's load

DATA = Path(__file__).resolve().parents[2] / "data" / "reports"
RUN, REJECTED_RUN = "20261207T121122Z-gptq-gptqmodel-16072-690f15", "20261207T123332Z-gptq-c16-23230-b1e9bc"
REPAIR = "20261207T160407Z-repair-aggressive-18708-55ab84"
PNG = b"\x89PNG\r\n\x1a\n"


def seen_without_complaint(html: str, folder: Path, name: str):
    page = folder / f"{name}.html"
    page.write_text(html)
    seen = open_page(page, folder / f"{name}.png")
    assert seen.console == [], seen.console
    assert seen.screenshot.read_bytes()[:8] == PNG and seen.screenshot.stat().st_size > 10_000
    keep_screenshot(seen.screenshot, f"{name}.png")
    return seen


@pytest.mark.parametrize("run_id", [RUN, REJECTED_RUN])
def test_a_run_page_loads_cleanly_with_its_verdict_and_every_set(tmp_path: Path, run_id: str):
    report = read_report(DATA / run_id / "gate.json")[0]
    seen = seen_without_complaint(render_run_page(report, run_id=run_id), tmp_path, f"run-{report.gate.verdict}")
    assert re.search(rf'id="verdict"><div class="word">{report.gate.verdict.upper()}</div>', seen.dom)
    for index, verdict in enumerate(report.gate.sets):
        assert re.search(rf'<tr class="{"pass" if verdict.passed else "fail"}" id="set-{index}-[^"]*"><td>{verdict.eval_set}</td>', seen.dom)


def test_a_repair_page_loads_cleanly_with_its_outcome_and_frontier(tmp_path: Path):
    seen = seen_without_complaint(render_repair_page(load_result(DATA / REPAIR)), tmp_path, "repair")
    assert 'id="verdict"><div class="word">REPAIRED</div>' in seen.dom and "bytes vs quality bound" in seen.dom


def test_a_model_page_loads_cleanly_with_its_versions(tmp_path: Path):
    registry = Registry(tmp_path / "registry.db")
    for number, verdict in enumerate(["promoted", "rejected"], start=1):
        artifact = make_artifact(tmp_path / f"a{number}", weights=f"w{number}".encode())
        version = registry.register(new_version(artifact, make_gate(tmp_path / f"g{number}.json", verdict, f"2026-12-0{number}T10:00:00+00:00")))
        promote(registry, version) if verdict == "promoted" else registry.reject(version.id, "gate rejected")
    registry.set_alias("demo-llama", "champion", 1, "first")
    seen = seen_without_complaint(render_model_page(ModelHistory.read(registry, "demo-llama")), tmp_path, "model")
    assert 'id="verdict"><div class="word">REJECTED</div>' in seen.dom  # the newest version's verdict
    assert 'id="version-0-1"' in seen.dom and 'id="version-1-2"' in seen.dom


def test_an_unescaped_script_is_caught(tmp_path: Path):
    report = read_report(DATA / RUN / "gate.json")[0]
    broken = render_run_page(report).replace("ticket_routing", "<script>alert(1)</script>", 1)
    (tmp_path / "broken.html").write_text(broken)
    seen = open_page(tmp_path / "broken.html", tmp_path / "broken.png")
    assert any("Content Security Policy" in message for message in seen.console), seen.console
