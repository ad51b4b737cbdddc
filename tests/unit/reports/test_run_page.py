"""A run's page from real gate.json files (the demo's runs): verdict first, a row and an interval drawing per set, flips,
divergence, the load test's ratios with their intervals, the host class; every name from input escaped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fakes import REPORT_POLICY, make_report, set_comparison

from pipelines.gate.schema import GateReport, read_report
from pipelines.gate.verdict import decide
from pipelines.reports.charts import Interval, interval_svg
from pipelines.reports.run_page import render_run_page, worsening_interval

DATA = Path(__file__).resolve().parents[2] / "data" / "reports"
PROMOTED_RUN = "20261207T121122Z-gptq-gptqmodel-16072-690f15"  # demo-llama, gptq via GPTQModel, load-tested, noise floor on
REJECTED_RUN = "20261207T123332Z-gptq-c16-23230-b1e9bc"  # SmolLM2 on the retail sets, every set failed
HOSTILE = "<script>alert(1)</script>"


def run_page(run_id: str) -> tuple[GateReport, str]:
    path = DATA / run_id / "gate.json"
    report = read_report(path)[0]
    return report, render_run_page(report, run_id=run_id, file=path)


def test_the_verdict_comes_first_then_a_row_per_set_with_its_drawing():
    html = run_page(PROMOTED_RUN)[1]
    body = html.split("<body>", 1)[1]
    assert body.index('id="verdict"') < body.index("PROMOTED") < body.index("Eval sets")
    assert '<div class="verdict pass" id="verdict"><div class="word">PROMOTED</div>' in html
    for index, name in enumerate(["ticket_routing", "payment_reference", "date_normalisation"]):
        row = re.search(rf'<tr class="pass" id="set-{index}-{name.replace("_", "-")}">(.*?)</tr>', html, re.S)
        assert row is not None, name
        assert "<svg" in row.group(1) and "tolerance 5.5" in row.group(1) and "1.09 / 5.50" in row.group(1)
    assert html.count('class="chart"') >= 3
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_flips_divergence_noise_floor_load_test_and_host_class_are_on_the_page():
    report, html = run_page(PROMOTED_RUN)
    assert "Flips and divergence" in html and "0.1 (warn)" in html and "1.13e-05" in html  # ticket_routing's KL mean
    assert "Runtime noise floor" in html and "mean of both passes" in html
    assert "Performance (load test)" in html and "against min_throughput_ratio" in html
    ratios = html.split('class="ratios"', 1)[1].split("</table>", 1)[0]
    assert ratios.count("<svg") == 2 * len(report.performance.ratios) - sum(r.throughput is None for r in report.performance.ratios) - sum(
        r.ttft_p95 is None for r in report.performance.ratios)
    assert "min 0.9" in ratios and "max 1.25" in ratios
    assert "Host class and runtime" in html and "cpu:avx512bf16" in html and "AutoGPTQLinearMethod / CPUWNA16LinearKernel" in html


def test_a_rejected_run_shows_its_reasons_and_failed_rows():
    _, html = run_page(REJECTED_RUN)
    assert '<div class="verdict fail" id="verdict"><div class="word">REJECTED</div>' in html
    assert html.count('<tr class="fail" id="set-') == 3
    assert "retail_faulty_item: the drop may be as large as 9.07 points" in html
    assert "0 of 3 eval sets passed" in html


def test_the_worsening_is_drawn_against_the_tightest_tolerance():
    report = make_report()  # orders|v2: 25 of 200 lost (-12.5 points); the bound's tolerance is ni_margin 5.0
    orders = report.gate.sets[0]
    mark = worsening_interval(orders)
    assert (mark.low, mark.high) == (-orders.ci_high, -orders.ci_low) and mark.estimate == pytest.approx(12.5)
    assert mark.limit == orders.tolerance == 5.0 and mark.bound == orders.worsening_bound and mark.passed is False
    svg = str(interval_svg(mark))
    assert "tolerance 5" in svg and "#c0392b" in svg and "12.5" in svg


def test_an_interval_far_past_the_other_marks_is_drawn_to_the_edge_with_its_number():
    svg = str(interval_svg(Interval(estimate=0.95, low=0.0, high=1.1e17, limit=0.9, reference=1.0)))
    assert "1.1e+17" in svg
    xs = [float(x) for x in re.findall(r'x[12]?="([-\d.]+)"', svg)]
    assert max(xs) <= 300 and min(xs) >= 0


def test_every_name_from_input_is_escaped():
    gate = decide([set_comparison(HOSTILE, lost=30, kept=170), set_comparison("a&b \"quoted\" 'x'", lost=0, kept=200)], REPORT_POLICY,
                  "<img src=x onerror=alert(2)>")
    report = GateReport(created_at="2026-12-07T10:00:00Z", gate=gate, inputs={"model": {"path": "/m/<b>bold</b>", "hash": "f" * 64}})
    html = render_run_page(report, run_id="run-<i>")
    assert HOSTILE not in html and "<img" not in html and "<b>bold" not in html and "<i>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&lt;img src=x onerror=alert(2)&gt;" in html
    assert "a&amp;b &#34;quoted&#34; &#39;x&#39;" in html
    assert re.search(r'id="set-0-[-a-z0-9]*"', html)  # an id made from a hostile name keeps only letters and digits
    assert html.isascii()
