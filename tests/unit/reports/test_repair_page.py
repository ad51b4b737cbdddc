"""A repair's page from a real repair.json (written by the repair session in tests/unit/repair's search test): the outcome
first, the frontier drawn (winner on top) and tabled, the search path; names escaped."""

from __future__ import annotations

import re
from pathlib import Path

from pipelines.repair.page import frontier_points, render_repair_page
from pipelines.repair.result import RepairResult, load_result

DATA = Path(__file__).resolve().parents[2] / "data" / "reports"
REPAIR = "20261207T160407Z-repair-aggressive-18708-55ab84"  # 8 attempts by speed, 6 load-tested; attempt 6 wins


def repair() -> RepairResult:
    return load_result(DATA / REPAIR)


def test_the_outcome_comes_first_then_the_frontier_and_the_search_path():
    html = render_repair_page(repair())
    body = html.split("<body>", 1)[1]
    assert body.index('<div class="verdict pass" id="verdict"><div class="word">REPAIRED</div>') < body.index("the frontiers") < body.index(
        "Search path")
    assert "repaired by attempt 6 (aggressive-repair-833f70): 2.02 MiB, 6 modules moved" in html
    frontier = html.split('id="frontier"', 1)[1].split("</section>", 1)[0]
    assert frontier.count("<svg") == 2  # bytes, and throughput with its intervals
    assert frontier.count("<tr class=") == 8 and "winner (speed)" in frontier and "**" not in frontier
    assert "1.428 [95% CI 1.428, 1.428], slower, 6 pairs" in frontier
    assert len(re.findall(r'<tr class="fail">', html.split('id="path"', 1)[1])) == 2  # attempts 1 and 8 failed


def test_the_winner_is_drawn_last_as_a_star_and_rejected_attempts_in_red():
    result = repair()
    contenders = [a.contender() for a in result.gated()]
    points = frontier_points(contenders, "attempt 6", speed=False)
    assert len(points) == 8 and points[-1].label == "attempt 6" and points[-1].marker == "star"
    assert {p.label for p in points if p.colour == "#c0392b"} == {"attempt 1", "attempt 8"}
    speed = frontier_points(contenders, "attempt 6", speed=True)  # the rejected attempts were not load-tested
    assert [p.label for p in speed][-1] == "attempt 6" and len(speed) == 6
    assert all(p.y_low is not None and p.y_low <= p.y <= p.y_high for p in speed)


def test_names_from_input_are_escaped():
    result = repair()
    hostile = result.model_copy(update={"model": "/m/<script>alert(1)</script>", "error": "<img src=x onerror=alert(2)>"})
    html = render_repair_page(hostile)
    assert "<script" not in html and "<img" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
