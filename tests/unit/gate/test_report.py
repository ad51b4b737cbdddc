"""The Markdown and terminal reports carry the verdict, the numbers, the reasons and the timings."""

from __future__ import annotations

from pathlib import Path

from fakes import REPORT_POLICY, make_report, set_comparison
from rich.console import Console

from pipelines.gate.report import plan_tables, render_console, render_markdown
from pipelines.gate.schema import GateReport
from pipelines.gate.verdict import decide
from pipelines.planner import gpu_spec, plan


def test_markdown_has_header_sets_reasons_warnings_and_stage_times():
    text = render_markdown(make_report())
    assert text.startswith("# Quantization gate: REJECTED")
    assert "| Model | models/demo-llama (aaaaaaaaaaaa) |" in text
    assert "| Recipe | recipes/w8a8.yaml (cccccccccccc) |" in text
    # 25 of 200 lost: 100 -> 87.5, delta -12.5; the pipe in the set name is escaped.
    assert "| orders\\|v2 | exact_match (points, higher is better) | 200 | 100.0 | 87.5 | -12.5 [" in text
    assert "tango-score-calibrated" in text and "a critical value calibrated for the set's n" in text
    assert "25 / 0 (12.5%)" in text
    assert "0.002 / 0.002" in text
    assert "- orders|v2: drop 12.50 points > max_abs_drop 2.0" in text
    assert "## Warnings" in text and "[tickets]: 20 items < min_items 100" in text
    assert "| serve | 28.2 |" in text or "| serve | 28.3 |" in text
    assert "| total | 69.8 |" in text
    assert "| eval_sets.orders | eval_sets/orders (dddddddddddd) |" in text
    assert "| L4-24GB | 3.00 | 24.00 | yes |" in text
    assert "## Plan" not in text


def test_markdown_rules_table_shows_turned_off_rules_as_dash():
    text = render_markdown(make_report())
    assert "| orders\\|v2 | 2.0 | - | True | 5.0 | 0.05 | - | 100 |" in text


def test_markdown_promoted_report_says_no_reasons():
    gate = decide([set_comparison("orders", lost=0, kept=300)], REPORT_POLICY, "w8a8")
    text = render_markdown(GateReport(gate=gate))
    assert text.startswith("# Quantization gate: PROMOTED")
    assert "| Recipe | w8a8 |" in text
    assert "None: every rule passed." in text
    assert "## Stage times" not in text


def llama_2_7b_plan() -> dict:
    config = Path(__file__).resolve().parents[2] / "data" / "configs" / "llama-2-7b" / "config.json"
    return plan(config, [None], gpu_spec("L4-24GB"), 2048, 1).model_dump(mode="json")


def test_the_plan_reads_as_quantize_plan_prints_it():
    (title, columns, rows), (args_title, _, args_rows) = plan_tables(llama_2_7b_plan())
    assert title.startswith("Plan: ") and "L4" in title and "2,048 tokens x 1 sequences" in title
    assert columns[:2] == ["scheme", "weights"] and rows[0][0] == "16-bit"
    assert rows[0][1] == "12.55 GiB" and rows[0][7] == "yes"
    assert args_title == "Recommended vLLM arguments" and "--max-model-len 2048" in args_rows[0][1]
    text = render_markdown(make_report(plan=llama_2_7b_plan()))
    assert "## Plan: " in text and "| 16-bit | 12.55 GiB |" in text


def test_console_renders_the_same_numbers_with_markup_escaped():
    console = Console(record=True, width=160, color_system=None)
    render_console(make_report(plan=llama_2_7b_plan()), console=console)
    text = console.export_text()
    assert "REJECTED" in text
    assert "[tickets]" in text  # not swallowed as a rich markup tag
    assert "-12.5 [" in text and "25 / 0 (12.5%)" in text
    assert "orders|v2: drop 12.50 points > max_abs_drop 2.0" in text
    assert "Stage times" in text and "69.8" in text
    assert "Model: models/demo-llama (aaaaaaaaaaaa)" in text


def test_markdown_gives_each_set_s_bound_tolerance_sizing_and_what_the_rules_guarantee():
    text = render_markdown(make_report())
    # 25 of 200 lost: one-sided 95% bound 17.02 points (at the critical value calibrated for 200 items) against ni_margin
    # 5.0; at 12.5% discordance 200 items certify 6.54 points at best and 5.0 needs 331; 20 identical items cannot show
    # 5.0 points (12.91), 59 would.
    assert "| 17.02 / 5.00 | 6.54 / 331 | 0.0% | FAIL |" in text
    assert "| 12.91 / 5.00 | 12.91 / 59 | 100.0% | FAIL |" in text
    assert "## What the rules guarantee" in text
    assert "- `ni_margin` 5.0: a candidate whose true drop is 5.0 points passes at most 5% of the time" in text
    assert "`max_abs_drop` 2.0: reads the observed drop, no error rate of its own" in text
    assert "whole run: an unchanged candidate with these sets' observed discordance is rejected by at least one set 100.0%" in text


def test_a_kl_rule_that_only_warns_says_so():
    from fakes import REPORT_POLICY

    policy = REPORT_POLICY.model_copy(update={"defaults": REPORT_POLICY.defaults.model_copy(update={"max_kl": 0.001})})
    text = render_markdown(GateReport(gate=decide([set_comparison("orders", lost=0, kept=300)], policy, "w8a8")))
    assert text.startswith("# Quantization gate: PROMOTED")
    assert "`max_kl` 0.001 (warns only, max_kl_action: warn): no stated error rate; the KL is a top-k lower bound" in text
    assert "orders: mean KL 0.0020 nats/token > max_kl 0.001: a warning, not a rejection" in text
