"""The load test's part of report.md and of the terminal report, from one set of rows."""

from __future__ import annotations

from pipelines.loadtest.results import LevelFigures, Percentiles, PerformanceReport, PerformanceSummary, RatioInterval
from pipelines.planner.gpus import GiB

Rows = list[list[str]]
LEVEL_COLUMNS = [
    "Model", "Concurrency", "Requests (failed)", "Requests/s", "Output tokens/s", "TTFT ms p50 / p95 / p99",
    "TPOT ms p50 / p95 / p99", "ITL ms p50 / p95 / p99", "Good (SLO)",
]
RATIO_COLUMNS = ["Concurrency", "Throughput ratio [95% CI]", "TTFT p95 ratio [95% CI]"]
MEMORY_COLUMNS = ["Model", "Served by", "KV tokens (vLLM)", "KV tokens (planner)", "KV max concurrency", "Peak memory GiB"]
TUNING_COLUMNS = ["Measured max_num_seqs", "Swept up to", "Planner max_num_seqs", "gpu_memory_utilization", "vLLM arguments"]
PLOT_TITLES = {"throughput": "Output throughput against concurrency", "ttft_p95": "TTFT p95 against concurrency"}


def _ms(values: Percentiles) -> str:
    return f"{values.p50:.1f} / {values.p95:.1f} / {values.p99:.1f}"


def _good(level: LevelFigures) -> str:
    return "-" if level.good_fraction is None else f"{level.good_fraction:.0%}"


def ratio_text(ratio: RatioInterval | None) -> str:
    if ratio is None:
        return "-"
    interval = f" [{ratio.low:.3f}, {ratio.high:.3f}]" if ratio.low is not None and ratio.high is not None else " (one pair)"
    return f"{ratio.estimate:.3f}{interval}"


def level_rows(report: PerformanceReport) -> Rows:
    return [
        [model.role, str(level.concurrency), f"{level.requests} ({level.failed})", f"{level.request_throughput:.2f}",
         f"{level.output_throughput:.1f}", _ms(level.ttft_ms), _ms(level.tpot_ms), _ms(level.itl_ms), _good(level)]
        for model in report.models for level in model.levels
    ]


def ratio_rows(report: PerformanceReport) -> Rows:
    return [[str(r.concurrency), ratio_text(r.throughput), ratio_text(r.ttft_p95)] for r in report.ratios]


def memory_rows(report: PerformanceReport) -> Rows:
    def cell(value) -> str:
        return "-" if value is None else f"{value:,}" if isinstance(value, int) else f"{value:.2f}"

    return [
        [m.role, m.served_by, cell(m.kv_capacity_tokens), cell(m.kv_capacity_tokens_predicted), cell(m.kv_max_concurrency),
         "-" if m.peak_memory_bytes is None else f"{m.peak_memory_bytes / GiB:.2f}"]
        for m in report.models
    ]


def tuning_rows(report: PerformanceReport) -> Rows:
    t = report.tuning
    if t is None:
        return []
    swept = f"{t.swept_up_to} ({t.limited_by})" if t.limited_by else str(t.swept_up_to)
    return [[
        "none met the SLOs" if t.measured_max_num_seqs is None else str(t.measured_max_num_seqs), swept,
        "-" if t.planner_max_num_seqs is None else f"{t.planner_max_num_seqs} (utilization {t.planner_gpu_memory_utilization:.2f})",
        "-" if t.gpu_memory_utilization is None else f"{t.gpu_memory_utilization:.2f}", t.vllm_args or "-",
    ]]


def headline(report: PerformanceReport) -> str:
    ratio = next((r for r in report.ratios if r.concurrency == report.deployment_concurrency), None)
    figures = f"at concurrency {report.deployment_concurrency}: throughput ratio {ratio_text(ratio.throughput)}, " \
              f"TTFT p95 ratio {ratio_text(ratio.ttft_p95)}; " if ratio else ""
    state = "passed" if report.passed else ("FAILED" if report.enforced else "failed (not enforced)")
    return f"Performance {state}: {figures}{report.enforcement}"


def probed_line(report: PerformanceReport) -> str:
    """The kernel probe's ratios beside the measured one (docs/hardware.md): one Linear against the whole server."""
    probed = report.probed
    assert probed is not None
    ratio = next((r for r in report.ratios if r.concurrency == report.deployment_concurrency), None)
    throughput = ratio.throughput if ratio is not None else None
    measured = f"; measured output-throughput ratio at concurrency {report.deployment_concurrency}: {throughput.estimate:.2f}" if throughput else ""
    decode = f"{probed.decode_ratio:.2f}x" if probed.decode_ratio is not None else "?"
    prefill = f"{probed.prefill_ratio:.2f}x" if probed.prefill_ratio is not None else "?"
    return (f"Probed on {probed.host_class}: the candidate's slowest scheme ({probed.slowest}) takes {decode} the time of a 16-bit Linear "
            f"at decode and {prefill} at prefill{measured} (a throughput ratio; 1/time).")


def summary(report: PerformanceReport) -> PerformanceSummary:
    """The few figures a run's outcome and a job's result carry (gate.json has everything)."""
    ratio = next((r for r in report.ratios if r.concurrency == report.deployment_concurrency), None)
    return PerformanceSummary(
        enforced=report.enforced, passed=report.passed, target=report.target, deployment_concurrency=report.deployment_concurrency,
        throughput_ratio=ratio.throughput.estimate if ratio and ratio.throughput else None,
        ttft_p95_ratio=ratio.ttft_p95.estimate if ratio and ratio.ttft_p95 else None,
        measured_max_num_seqs=report.tuning.measured_max_num_seqs if report.tuning else None,
    )


def markdown_sections(report: PerformanceReport, table) -> list[str]:
    """report.md's load-test section; `table(columns, rows)` is report.md's own table renderer."""
    workload = report.workload
    parts = [
        "## Performance (load test)",
        headline(report),
        f"Tool: {report.tool.get('name')} (vLLM {report.tool.get('vllm', '?')}, `{report.tool.get('module')}`), on {report.target}; "
        f"{workload.get('prompts')} prompts from {', '.join(f'{k} ({v})' for k, v in workload.get('eval_sets', {}).items())}, "
        f"output lengths from {workload.get('output_tokens_from')}; concurrency {', '.join(map(str, report.levels))}, "
        f"{report.policy.load.repeats} runs per model and level; {report.wall_s:.1f} s.",
        table(LEVEL_COLUMNS, level_rows(report)),
        "Each figure is the median over the repeated runs of what vLLM bench serve reported for a run; Good (SLO): the share "
        "of requests meeting every SLO target, all runs pooled.",
    ]
    if report.ratios:
        parts += ["### Candidate / baseline", table(RATIO_COLUMNS, ratio_rows(report)), f"Interval: {report.interval_method}."]
        if report.probed is not None and report.probed.slowdown is not None:
            parts.append(probed_line(report))
    parts += ["### KV cache and memory", table(MEMORY_COLUMNS, memory_rows(report))]
    if report.tuning is not None:
        parts += ["### Measured tuning", table(TUNING_COLUMNS, tuning_rows(report)), report.tuning.basis + "."]
    if report.checks:
        parts += ["### Checks", "\n".join(f"- {'pass' if c.passed else 'FAIL'}: {c.text}" for c in report.checks)]
    for key, name in report.plots.items():
        parts.append(f"![{PLOT_TITLES.get(key, key)}]({name})")
    return parts


def console_tables(report: PerformanceReport, table, say) -> None:
    """The terminal's view: the headline, the ratios (or the levels for one model), tuning; `table(title, columns, rows)`."""
    say(headline(report))
    if report.ratios:
        say(table("Load test: candidate / baseline", RATIO_COLUMNS, ratio_rows(report)))
    else:
        say(table("Load test", LEVEL_COLUMNS, level_rows(report)))
    say(table("KV cache and memory", MEMORY_COLUMNS, memory_rows(report)))
    if report.tuning is not None:
        say(table("Measured tuning", TUNING_COLUMNS, tuning_rows(report)))
