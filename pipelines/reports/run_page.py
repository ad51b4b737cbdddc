"""A gate run's page (report.html beside report.md): the verdict first, then every set's interval drawn against its
tolerance, flips and divergence, the runtime's noise floor, the load test with its intervals, the host class, the
rules, the plan, stage times and inputs.

    html = render_run_page(report, run_id="20261207T...-w8a8-...")

The rows are report.md's own (pipelines.gate.report, pipelines.loadtest.render): the page and the Markdown never
disagree on a number; the page adds the drawings.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.gate import report as md
from pipelines.gate.schema import GateReport, SetVerdict
from pipelines.hardware.runtime import Runtime, recorded_runtime
from pipelines.loadtest import render as loadtest_rows
from pipelines.loadtest.results import PerformanceReport, RatioInterval
from pipelines.reports.charts import Interval, interval_svg
from pipelines.reports.markup import (
    Markup,
    anchor_id,
    bullets,
    code,
    heading,
    key_values,
    note,
    page,
    paragraph,
    section,
    table,
    verdict_banner,
)

# The first table: what decides, beside the drawing; every column follows under it.
SUMMARY_COLUMNS = ["Eval set", "n", "Baseline", "Candidate", "Delta [95% CI]", "Worse by at most / tolerance", "Flips R->W / W->R", "Verdict"]
FLIP_COLUMNS = ["Eval set", "Right -> wrong", "Wrong -> right", "Flip rate (lower bound)", "max_flip_rate", "KL mean", "KL max",
                "max_kl (action)", "KL method"]


def render_run_page(report: GateReport, *, run_id: str | None = None, file: Path = Path("gate.json")) -> str:
    gate = report.gate
    model = _model_name(report)
    title = f"Quantization gate: {gate.recipe} on {model}" + (f" (run {run_id})" if run_id else "")
    blocks = [verdict_banner(gate.verdict, title, _headline(report)), key_values(md.header_rows(report))]
    if _unverified(report):
        blocks.append(paragraph(md.UNVERIFIED_NOTE.lstrip("> ").replace("**", ""), "verdict other"))
    blocks += [sets_section(report), flips_section(report)]
    noise = md.noise_rows(gate)
    if noise:
        blocks.append(section("Runtime noise floor", table(md.NOISE_COLUMNS, noise), note(md.NOISE_NOTE)))
    blocks.append(section("Reasons", bullets(gate.reasons) if gate.reasons else paragraph("None: every rule passed.")))
    if gate.warnings:
        blocks.append(section("Warnings", bullets(gate.warnings)))
    if report.performance is not None:
        blocks.append(loadtest_section(report.performance))
    blocks.append(host_section(recorded_runtime({"inputs": report.inputs}, None, file=file)))
    blocks.append(section("Rules applied", table(md.RULE_COLUMNS, md.rule_rows(gate)),
                          *([heading("What the rules guarantee"), bullets(md.guarantee_notes(gate))] if gate.sets else [])))
    blocks += _fit_and_plan(report)
    if report.stages:
        blocks.append(section("Stage times", table(["Stage", "Seconds"], md.stage_rows(report.stages))))
    if report.inputs:
        blocks.append(section("Inputs", table(["Input", "Value"], md.input_rows(report))))
    return page(title, *blocks)


def _model_name(report: GateReport) -> str:
    """The 16-bit model's folder name (the registry's model name), else what the inputs say."""
    source = report.inputs.get("baseline") or report.inputs.get("model")
    if isinstance(source, dict) and isinstance(source.get("path"), str):
        return Path(source["path"]).name
    return md.describe(source) if source else "-"


def _headline(report: GateReport) -> list[str]:
    gate = report.gate
    lines = [f"the candidate {report.performance.buys}"] if report.performance is not None and report.performance.buys else []
    failed = [s.eval_set for s in gate.sets if not s.passed]
    lines.append(f"{len(gate.sets) - len(failed)} of {len(gate.sets)} eval sets passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return lines + gate.reasons[:5]


def _unverified(report: GateReport) -> bool:
    artifact = report.inputs.get("artifact")
    return isinstance(artifact, dict) and artifact.get("verified") is False


def worsening_interval(verdict: SetVerdict) -> Interval:
    """The set's change as a worsening (positive: worse than 16-bit) with its interval, the one-sided bound the tolerance
    rules read, and the tightest tolerance in force."""
    if verdict.higher_is_better:
        low, high = -verdict.ci_high, -verdict.ci_low
    else:
        low, high = verdict.ci_low, verdict.ci_high
    tolerance = "no tolerance" if verdict.tolerance is None else f"tolerance {verdict.tolerance:.2f}"
    bound = "-" if verdict.worsening_bound is None else f"{verdict.worsening_bound:.2f}"
    return Interval(
        estimate=verdict.worsening, low=low, high=high, limit=verdict.tolerance, limit_label="tolerance", bound=verdict.worsening_bound,
        reference=0.0, passed=verdict.passed, unit=verdict.unit,
        description=(f"{verdict.eval_set}: worsening {verdict.worsening:+.2f} {verdict.unit} [{low:+.2f}, {high:+.2f}], "
                     f"one-sided bound {bound}, {tolerance}"),
    )


def sets_section(report: GateReport) -> Markup:
    gate = report.gate
    full = md.set_rows(gate)
    keep = [md.SET_COLUMNS.index(column) for column in SUMMARY_COLUMNS]
    rows = [[*(row[i] for i in keep), interval_svg(worsening_interval(v))] for row, v in zip(full, gate.sets, strict=True)]
    return section(
        "Eval sets", table([*SUMMARY_COLUMNS, "Worsening vs tolerance"], rows, row_classes=["pass" if v.passed else "fail" for v in gate.sets],
                           row_ids=[anchor_id("set", v.eval_set, i) for i, v in enumerate(gate.sets)], css="sets"),
        note(f"Drawing: the worsening (positive: worse than 16-bit) in the set's unit, its {gate.settings.confidence:.0%} interval as "
             "a bar, the estimate as a dot, the one-sided bound the tolerance rules read as a triangle, the tightest tolerance as a "
             "red line, no change as a dashed line. Scores in points (metric x 100) for metrics in [0, 1]."),
        heading("Every figure"), table(md.SET_COLUMNS, full), heading("Intervals"), bullets(md.interval_notes(gate)), anchor="sets",
    )


def flip_rows(report: GateReport) -> list[list[str]]:
    def value(number: float | None, digits: str = ".3g") -> str:
        return "-" if number is None else format(number, digits)

    rows = []
    for v in report.gate.sets:
        rate = "-" if v.flip_rate is None else f"{v.flip_rate:.1%} ({value(v.flip_rate_lower_bound, '.1%')})"
        action = "-" if v.rules.max_kl is None else f"{v.rules.max_kl:g} ({v.rules.max_kl_action})"
        rows.append([v.eval_set, value(v.flips_right_to_wrong, "d"), value(v.flips_wrong_to_right, "d"), rate,
                     value(v.rules.max_flip_rate, "g"), value(v.kl_mean), value(v.kl_max), action, v.kl_method or "-"])
    return rows


def flips_section(report: GateReport) -> Markup:
    return section("Flips and divergence", table(FLIP_COLUMNS, flip_rows(report)),
                   note("Flips: items answered right by the 16-bit model and wrong by the candidate, and the reverse; the flip rule "
                        "reads the one-sided lower bound of the right -> wrong rate. KL: the candidate's output distribution against "
                        "the 16-bit one, nats per token (a top-k lower bound of the full KL)."), anchor="flips")


def ratio_interval(name: str, ratio: RatioInterval | None, limit: float | None, label: str, *, higher_is_better: bool) -> Markup:
    if ratio is None:
        return Markup("-")
    passed = None
    if limit is not None and ratio.low is not None and ratio.high is not None:
        worst = ratio.low if higher_is_better else ratio.high
        best = ratio.high if higher_is_better else ratio.low
        passed = True if (worst >= limit if higher_is_better else worst <= limit) else False if (
            best < limit if higher_is_better else best > limit) else None
    return interval_svg(Interval(estimate=ratio.estimate, low=ratio.low, high=ratio.high, limit=limit, limit_label=label, reference=1.0,
                                 passed=passed, description=f"{name}: {loadtest_rows.ratio_text(ratio)}, limit {label} {limit}"))


def loadtest_section(performance: PerformanceReport) -> Markup:
    policy = performance.policy
    ratios = [
        [str(r.concurrency), loadtest_rows.ratio_text(r.throughput),
         ratio_interval(f"throughput ratio at {r.concurrency}", r.throughput, policy.min_throughput_ratio, "min", higher_is_better=True),
         loadtest_rows.ratio_text(r.ttft_p95),
         ratio_interval(f"TTFT p95 ratio at {r.concurrency}", r.ttft_p95, policy.max_ttft_p95_ratio, "max", higher_is_better=False)]
        for r in performance.ratios
    ]
    blocks = [paragraph(Markup("<strong>The candidate {}.</strong>").format(performance.buys))] if performance.buys else []
    blocks.append(paragraph(loadtest_rows.headline(performance)))
    if performance.comparison is not None:
        blocks += [paragraph(line) for line in loadtest_rows.comparison_lines(performance.comparison)]
        blocks.append(note(loadtest_rows.predicted_line(performance)))
    if ratios:
        blocks += [heading("Candidate / baseline (ratios with their 95% intervals)"),
                   table(["Concurrency", "Throughput ratio [95% CI]", "against min_throughput_ratio", "TTFT p95 ratio [95% CI]",
                          "against max_ttft_p95_ratio"], ratios, css="ratios"),
                   note("Levels below the deployment's were run once per model: their ratios have no interval.")]
    blocks += [heading("Levels"), table(loadtest_rows.LEVEL_COLUMNS, loadtest_rows.level_rows(performance)),
               heading("KV cache and memory"), table(loadtest_rows.MEMORY_COLUMNS, loadtest_rows.memory_rows(performance))]
    if performance.tuning is not None:
        blocks += [heading("Measured tuning"), table(loadtest_rows.TUNING_COLUMNS, loadtest_rows.tuning_rows(performance))]
    if performance.checks:
        blocks += [heading("Checks"), bullets(f"{check.status}: {check.text}" for check in performance.checks)]
    return section("Performance (load test)", *blocks, anchor="loadtest")


def host_section(runtime: Runtime) -> Markup:
    rows = [["Host class", runtime.host_class], ["vLLM library", runtime.library or "-"], ["Serve dtype", runtime.serve_dtype or "-"]]
    rows += [[f"package {name}", version] for name, version in runtime.packages.items()]
    rows += [[f"kernel: {group}", kernel] for group, kernel in runtime.kernels.items()]
    return section("Host class and runtime", key_values(rows),
                   note(Markup("The verdict holds for this runtime; {} checks another.").format(code("quantize regate"))), anchor="host")


def _fit_and_plan(report: GateReport) -> list[Markup]:
    blocks = []
    if report.gate.fit is not None:
        blocks.append(section("Fit", table(["GPU", "Required GiB", "Available GiB", "Fits"], md.fit_rows(report.gate))))
    for title, columns, rows in md.plan_tables(report.plan):
        blocks.append(section(title, table(columns, rows)))
    return blocks
