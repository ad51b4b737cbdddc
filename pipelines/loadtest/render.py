"""The load test's part of report.md and of the terminal report, from one set of rows."""

from __future__ import annotations

from pipelines.loadtest.results import LevelFigures, MemoryGain, Percentiles, PerformanceReport, PerformanceSummary, SpeedComparison
from pipelines.loadtest.verdict import ratio_text
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


def _state(report: PerformanceReport) -> str:
    if any(check.status == "failed" for check in report.checks):
        return "FAILED" if report.enforced else "failed (not enforced)"
    if any(check.status == "inconclusive" for check in report.checks):
        return "INCONCLUSIVE" if report.enforced else "inconclusive (not enforced)"
    return "passed"


def headline(report: PerformanceReport) -> str:
    speed = report.comparison
    if speed is None:
        return f"Load test: {report.enforcement}"
    figures = (f"at concurrency {speed.concurrency}: throughput ratio {ratio_text(speed.throughput.interval)}, "
               f"TTFT p95 ratio {ratio_text(speed.ttft_p95.interval)} ({len(speed.pairs)} pairs, {speed.seconds:.0f} s); ")
    return f"Performance {_state(report)}: {figures}{report.enforcement}"


def _bytes(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**20:,.1f} MiB"


def memory_words(gain: MemoryGain) -> str:
    ratio = gain.weight_ratio
    weights = f"weights {_bytes(gain.candidate_weight_bytes)} vs {_bytes(gain.baseline_weight_bytes)}" + (f" ({ratio:.2f}x)" if ratio else "")
    kv = ""
    if gain.candidate_kv_tokens and gain.baseline_kv_tokens:
        kv = f", KV cache {gain.candidate_kv_tokens:,} vs {gain.baseline_kv_tokens:,} tokens in the same space"
    return weights + kv


def buys(speed: SpeedComparison | None, gain: MemoryGain | None, target: str) -> str | None:
    """What the candidate buys on the serving host, first in the verdict: memory always, speed only where the paired
    comparison concluded it ("buys memory, not speed, on cpu:avx512bf16: throughput 0.87x [0.83, 0.91]")."""
    if speed is None or gain is None:
        return None
    ratio = gain.weight_ratio
    smaller = ratio is not None and ratio < 1
    interval = speed.throughput.interval
    shown = "-" if interval is None else f"{interval.estimate:.2f}x" + (
        f" [{interval.low:.2f}, {interval.high:.2f}]" if interval.low is not None and interval.high is not None else "")
    margin = f"{speed.settings.margin:.0%}"
    undecided = (f"speed on {target} is inconclusive after {len(speed.pairs)} pairs in {speed.seconds:.0f} s: throughput {shown} "
                 "(raise performance.comparison.budget_s to decide)")
    claims = {
        "faster": (f"buys memory and speed on {target}", f"buys speed, not memory, on {target}"),
        "slower": (f"buys memory, not speed, on {target}", f"buys neither memory nor speed on {target}"),
        "no difference": (f"buys memory, and speed is unchanged within {margin} on {target}",
                          f"buys neither memory nor speed (unchanged within {margin}) on {target}"),
        "inconclusive": (f"buys memory; {undecided}", f"buys no memory; {undecided}"),
    }[speed.throughput.outcome]
    claim = claims[0] if smaller else claims[1]
    if speed.throughput.outcome != "inconclusive":
        claim += f": throughput {shown}"
    return f"{claim} ({memory_words(gain)})"


def probed_line(report: PerformanceReport) -> str:
    """The kernel probe's ratios beside the measured one (docs/hardware.md): one Linear against the whole server."""
    probed = report.probed
    assert probed is not None
    throughput = report.comparison.throughput.interval if report.comparison is not None else None
    measured = f"; measured output-throughput ratio at concurrency {report.deployment_concurrency}: {ratio_text(throughput)}" if throughput else ""
    decode = f"{probed.decode_ratio:.2f}x" if probed.decode_ratio is not None else "?"
    prefill = f"{probed.prefill_ratio:.2f}x" if probed.prefill_ratio is not None else "?"
    return (f"Probed on {probed.host_class}: the candidate's slowest scheme ({probed.slowest}) takes {decode} the time of a 16-bit Linear "
            f"at decode and {prefill} at prefill{measured} (a throughput ratio; 1/time).")


def summary(report: PerformanceReport) -> PerformanceSummary:
    """The few figures a run's outcome and a job's result carry (gate.json has everything)."""
    speed = report.comparison
    throughput = speed.throughput.interval if speed is not None else None
    ttft = speed.ttft_p95.interval if speed is not None else None
    return PerformanceSummary(
        enforced=report.enforced, passed=report.passed, target=report.target, deployment_concurrency=report.deployment_concurrency,
        throughput_ratio=throughput.estimate if throughput else None,
        throughput_interval=[throughput.low, throughput.high] if throughput and throughput.low is not None and throughput.high is not None else None,
        speed=speed.throughput.outcome if speed is not None else None, pairs=len(speed.pairs) if speed is not None else None,
        ttft_p95_ratio=ttft.estimate if ttft else None,
        measured_max_num_seqs=report.tuning.measured_max_num_seqs if report.tuning else None, buys=report.buys,
    )


def comparison_lines(speed: SpeedComparison) -> list[str]:
    settings = speed.settings
    return [
        f"Paired comparison at concurrency {speed.concurrency}: {len(speed.pairs)} pairs of runs of {speed.requests_per_run} requests "
        f"(order drawn per pair, seed {speed.order_seed}) after a warm-up run per model, in {speed.seconds:.1f} s of a "
        f"{settings.budget_s:g} s budget; stopped: {speed.stopped}. Throughput: {speed.throughput.outcome} "
        f"({ratio_text(speed.throughput.interval)}); TTFT p95: {speed.ttft_p95.outcome} ({ratio_text(speed.ttft_p95.interval)})"
        + (f"; median TPOT: {speed.tpot_p50.outcome} ({ratio_text(speed.tpot_p50.interval)})." if speed.tpot_p50 else "."),
        f"Method: {speed.method}; `no difference` means within {settings.margin:.0%} either way.",
    ]


def predicted_line(report: PerformanceReport) -> str:
    """The shape probe's prediction beside the measurement (docs/hardware.md), or how to get one."""
    predicted = report.predicted
    if predicted is None:
        return ("Shape probe: no prediction cached for this artifact's shapes on this host (`quantize doctor --model DIR` probes "
                "them; the load test never waits for it).")
    measured = report.comparison.throughput.outcome if report.comparison is not None else "not measured"
    if measured in ("inconclusive", "not measured"):
        agree = "cannot be checked against it"
    else:
        agree = "agrees" if predicted.direction.startswith(measured) else "disagrees"
    return (f"Shape probe predicted {predicted.direction} ({predicted.throughput_ratio:.2f}x: the model's Linears alone, at decode batch "
            f"{predicted.decode_batch}, {predicted.prefill_share:.0%} of their 16-bit time on prompts); measured {measured}: it {agree}.")


def markdown_sections(report: PerformanceReport, table) -> list[str]:
    """report.md's load-test section; `table(columns, rows)` is report.md's own table renderer."""
    workload = report.workload
    parts = [
        "## Performance (load test)",
        *([f"**The candidate {report.buys}.**"] if report.buys else []),
        headline(report),
        f"Tool: {report.tool.get('name')} (vLLM {report.tool.get('vllm', '?')}, `{report.tool.get('module')}`), on {report.target}; "
        f"{workload.get('prompts')} prompts from {', '.join(f'{k} ({v})' for k, v in workload.get('eval_sets', {}).items())}, "
        f"output lengths from {workload.get('output_tokens_from')}; concurrency {', '.join(map(str, report.levels))}, "
        f"{report.policy.load.repeats} run(s) per model and level below the deployment's; {report.wall_s:.1f} s in all.",
        table(LEVEL_COLUMNS, level_rows(report)),
        "Each figure is the median over the repeated runs of what vLLM bench serve reported for a run; Good (SLO): the share "
        "of requests meeting every SLO target, all runs pooled.",
    ]
    if report.comparison is not None:
        parts += ["### Candidate / baseline", *comparison_lines(report.comparison), predicted_line(report), table(RATIO_COLUMNS, ratio_rows(report)),
                  "Levels below the deployment's were run once per model: their ratios have no interval."]
        if report.probed is not None and report.probed.slowdown is not None:
            parts.append(probed_line(report))
    parts += ["### KV cache and memory", table(MEMORY_COLUMNS, memory_rows(report))]
    if report.tuning is not None:
        parts += ["### Measured tuning", table(TUNING_COLUMNS, tuning_rows(report)), report.tuning.basis + "."]
    if report.checks:
        parts += ["### Checks", "\n".join(f"- {c.status}: {c.text}" for c in report.checks)]
    for key, name in report.plots.items():
        parts.append(f"![{PLOT_TITLES.get(key, key)}]({name})")
    return parts


def console_tables(report: PerformanceReport, table, say) -> None:
    """The terminal's view: the headline, the ratios (or the levels for one model), tuning; `table(title, columns, rows)`."""
    say(headline(report))
    if report.comparison is not None:
        for line in (*comparison_lines(report.comparison)[:1], predicted_line(report)):
            say(line)
    if report.ratios:
        say(table("Load test: candidate / baseline", RATIO_COLUMNS, ratio_rows(report)))
    else:
        say(table("Load test", LEVEL_COLUMNS, level_rows(report)))
    say(table("KV cache and memory", MEMORY_COLUMNS, memory_rows(report)))
    if report.tuning is not None:
        say(table("Measured tuning", TUNING_COLUMNS, tuning_rows(report)))
