"""A repair's page from a real repair.json (written by the repair session in tests/unit/repair's search test): the outcome
first, the frontier drawn (winner on top) and tabled, the search path; names escaped."""

from __future__ import annotations

import re
from pathlib import Path

from pipelines.repair.page import frontier_points, render_repair_page
from pipelines.repair.result import RepairResult, load_result

DATA = Path(__file__).resolve().parents[2] / "data" / "reports"
REPAIR = "20261207T155358Z-repair-aggressive-18708-67310d"  # 8 attempts; attempt 7 wins by size


def repair() -> RepairResult:
    return load_result(DATA / REPAIR)


def test_the_outcome_comes_first_then_the_frontier_and_the_search_path():
    html = render_repair_page(repair())
    body = html.split("<body>", 1)[1]
    assert body.index('<div class="verdict pass" id="verdict"><div class="word">REPAIRED</div>') < body.index("the frontiers") < body.index(
        "Search path")
    assert "repaired by attempt 7 (aggressive-repair-418a53): 2.02 MiB, 3 modules moved" in html
    frontier = html.split('id="frontier"', 1)[1].split("</section>", 1)[0]
    assert frontier.count("<svg") == 1  # bytes only: no attempt was load-tested
    assert frontier.count("<tr class=") == 8 and "winner (size)" in frontier and "**" not in frontier
    assert len(re.findall(r'<tr class="fail">', html.split('id="path"', 1)[1])) == 2  # attempts 1 and 8 failed


def test_the_winner_is_drawn_last_as_a_star_and_rejected_attempts_in_red():
    result = repair()
    contenders = [a.contender() for a in result.gated()]
    points = frontier_points(contenders, "attempt 7", speed=False)
    assert len(points) == 8 and points[-1].label == "attempt 7" and points[-1].marker == "star"
    assert {p.label for p in points if p.colour == "#c0392b"} == {"attempt 1", "attempt 8"}
    assert frontier_points(contenders, "attempt 7", speed=True) == []


def test_names_from_input_are_escaped():
    result = repair()
    hostile = result.model_copy(update={"model": "/m/<script>alert(1)</script>", "error": "<img src=x onerror=alert(2)>"})
    html = render_repair_page(hostile)
    assert "<script" not in html and "<img" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
