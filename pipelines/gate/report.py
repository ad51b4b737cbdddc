"""The human report of a gate run: Markdown (report.md) and rich tables for the terminal.

Both renderers draw on the same rows (built once here), so the two views never disagree.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

from pipelines.console import output
from pipelines.gate.policy import SetPolicy
from pipelines.gate.schema import GateReport, GateResult, SetVerdict
from pipelines.loadtest.render import console_tables, markdown_sections
from pipelines.planner import Plan
from pipelines.planner.view import PLAN_COLUMNS, gib, plan_row_cells, plan_title, vllm_arguments

Rows = list[list[str]]

SET_COLUMNS = [
    "Eval set", "Metric", "n", "Baseline", "Candidate", "Delta [95% CI]", "Interval", "McNemar p",
    "Flips R->W / W->R", "KL mean / max", "Min. detectable drop", "Worse by at most / tolerance",
    "Certifiable / items needed", "P(reject unchanged)", "Verdict",
]
# The terminal table leaves out what the warnings already say, to stay readable at ~100 columns.
_CONSOLE_SKIP = ("Metric", "Interval", "Min. detectable drop", "Certifiable / items needed", "P(reject unchanged)")
INTERVAL_NOTES = {
    "tango-score-calibrated": (
        "Tango's score interval for a difference of paired proportions; the bound the tolerance reads is taken at a critical "
        "value calibrated for the set's n, so that a true worsening of exactly the tolerance passes at most 1 - confidence "
        "of the time for every split into losses and gains (multinomial model, exact)"
    ),
    "betting": (
        "the betting confidence bound for a bounded mean (Waudby-Smith and Ramdas), valid at every n for any distribution of "
        "the per-item changes"
    ),
    "percentile-bootstrap-clipped-betting": (
        "paired percentile bootstrap of the difference of corpus-level scores (the rare-damage allowance and zero-count floor "
        "below), and the concentrated-damage rule: the betting bound of the mean worsening with each item's contribution "
        "clipped at tolerance / (2 damage_share) must stay within half the tolerance (pipelines.gate.concentrated)"
    ),
    "percentile-bootstrap-rare-damage": (
        "paired percentile bootstrap of the difference of corpus-level scores, each end moved out by -ln(1 - c) times the "
        "largest pull of one item and kept at least range x (1 - (1 - c)^(1/n)) from the estimate"
    ),
    "tango-score": "Tango's asymptotic score interval for a difference of paired proportions",
    "tango-score-scaled-floored": (
        "Tango's score interval on effective discordant counts (m = sum d^2 / sum |d|; losses, gains = sum of the negative, "
        "positive differences / m), times m, widened to at least range x z^2/(n+z^2) each side"
    ),
    "bca-bootstrap-floored": "paired BCa bootstrap of the mean difference, widened to at least range x z^2/(n+z^2) each side",
    "percentile-bootstrap-floored": "paired percentile bootstrap of the difference of corpus-level scores, widened likewise",
}
# Under which sampling model each kind's bound holds its rate (docs/gate-json.md, "Known error rates").
SAMPLING_MODELS = {
    "binary": "pass/fail: exact under the multinomial model, items drawn independently, for every split into losses and gains",
    "continuous": "averaged per item: for any distribution of the per-item changes, items drawn independently",
    "corpus": "corpus metric: items drawn independently, for any severities of a worsening whose concentration share (the fewest "
              "items carrying more than half of it) is at least damage_share (a clipped betting bound; simulated per shape)",
}
RULE_COLUMNS = ["Eval set", *SetPolicy.model_fields]
NOISE_COLUMNS = [
    "Eval set", "A/A flips / n", "R->W / W->R", "Rate [exact interval]", "Floor", "Candidate flips on unstable", "Reference",
    "Unstable items (doc ids)",
]
NOISE_NOTE = (
    "The 16-bit baseline scored twice on this runtime (policy `noise_floor`): the items whose value changed between the "
    "passes are the runtime's own flips, listed as unstable. The candidate is compared with the mean of both passes (a "
    "loss or gain on an unstable item counts half; docs/guarantees.md, \"The runtime's noise floor\"), and a tolerance "
    "under the floor is refused."
)
_HEADER_INPUTS = ("model", "artifact", "recipe", "policy")


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _p_value(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _flips(verdict: SetVerdict) -> str:
    if verdict.flips_right_to_wrong is None:
        return "-"
    return f"{verdict.flips_right_to_wrong} / {verdict.flips_wrong_to_right} ({verdict.flip_rate:.1%})"


def _kl(verdict: SetVerdict) -> str:
    if verdict.kl_mean is None:
        return "-"
    # Three significant digits: a near-lossless candidate's KL is 1e-6, which .4f would show as 0.0000.
    return f"{verdict.kl_mean:.3g} / {verdict.kl_max:.3g}"


def _metric(verdict: SetVerdict) -> str:
    direction = "higher is better" if verdict.higher_is_better else "lower is better"
    return f"{verdict.metric} ({verdict.unit}, {direction})"


def _unit_suffix(verdict: SetVerdict) -> str:
    return "" if verdict.unit == "points" else f" {verdict.unit}"


def _bound(verdict: SetVerdict) -> str:
    """The one-sided bound of the worsening against the tightest tolerance: what the tolerance rules read."""
    if verdict.worsening_bound is None:
        return "-"
    tolerance = "no tolerance" if verdict.tolerance is None else f"{verdict.tolerance:.2f}"
    return f"{verdict.worsening_bound:.2f} / {tolerance}"


def _sizing(verdict: SetVerdict) -> str:
    if verdict.min_certifiable_tolerance is None:
        return "-"
    needed = "-" if verdict.items_needed is None else f"{verdict.items_needed:,}"
    return f"{verdict.min_certifiable_tolerance:.2f} / {needed}"


def _probability(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def set_rows(gate: GateResult) -> Rows:
    """One row per eval set; scores in the set's unit with one decimal, bounds and tolerances with two."""
    return [
        [
            v.eval_set, _metric(v), str(v.n), _number(v.baseline_score), _number(v.candidate_score),
            f"{v.delta:+.1f} [{v.ci_low:+.1f}, {v.ci_high:+.1f}]{_unit_suffix(v)}", v.interval_method,
            _p_value(v.mcnemar_p), _flips(v), _kl(v), _number(v.min_detectable_drop), _bound(v), _sizing(v),
            _probability(v.unchanged_reject_probability), "pass" if v.passed else "FAIL",
        ]
        for v in gate.sets
    ]


def noise_rows(gate: GateResult) -> Rows:
    """One row per set scored twice (the noise floor); none when no set was."""
    rows = []
    for v in gate.sets:
        f = v.noise_floor
        if f is None:
            continue
        directions = "-" if f.right_to_wrong is None else f"{f.right_to_wrong} / {f.wrong_to_right}"
        share = "-" if f.candidate_flips is None else f"{f.candidate_flips_on_unstable} of {f.candidate_flips}"
        docs = ", ".join(item.split(":", 1)[0] for item in f.unstable_items) or "none"
        rows.append([
            v.eval_set, f"{f.flips} / {f.n}", directions,
            f"{f.rate:.2%} [{f.rate_low:.2%}, {f.rate_high:.2%}] ({f.interval_confidence:.0%})",
            "-" if f.floor is None else f"{f.floor:.2f} {v.unit}", share, f.reference, docs,
        ])
    return rows


def guarantee_notes(gate: GateResult) -> list[str]:
    """What each rule in force guarantees, in words (docs/gate-json.md, "Known error rates")."""
    notes: dict[str, None] = {}
    for v in gate.sets:
        r, sure = v.rules, f"{v.rules.confidence:.0%}"
        miss = f"{1 - r.confidence:.0%}"
        if r.non_inferiority and v.unit == "points":
            notes[f"`ni_margin` {r.ni_margin}: a candidate whose true {_word(v)} is {r.ni_margin} points passes at most {miss} "
                  f"of the time (the {sure} one-sided bound of the {_word(v)} must stay within it; {SAMPLING_MODELS[v.kind]})"] = None
        if r.non_inferiority and v.unit != "points" and r.rel_margin is not None:
            notes[f"`rel_margin` {r.rel_margin}: a metric in its own unit whose true worsening is {r.rel_margin:.0%} of its "
                  f"baseline passes at most {miss} of the time ({SAMPLING_MODELS[v.kind]})"] = None
        if r.max_rel_drop is not None:
            notes[f"`max_rel_drop` {r.max_rel_drop}: read on the {sure} bound; a true worsening of {r.max_rel_drop:.0%} of the "
                  f"baseline passes at most {miss} of the time"] = None
        if r.max_abs_drop is not None and v.unit == "points":
            notes[f"`max_abs_drop` {r.max_abs_drop}: reads the observed {_word(v)}, no error rate of its own (a true "
                  f"{_word(v)} of {r.max_abs_drop} points passes it about half the time); the tolerance is the guarantee"] = None
        if r.max_flip_rate is not None and v.binary:
            notes[f"`max_flip_rate` {r.max_flip_rate}: read on the {sure} lower bound of the right->wrong rate; a candidate "
                  f"that breaks exactly this share of items is rejected by it at most {miss} of the time"] = None
        if r.max_kl is not None:
            effect = "rejects" if r.max_kl_action == "reject" else "warns only"
            notes[f"`max_kl` {r.max_kl} ({effect}, max_kl_action: {r.max_kl_action}): no stated error rate; the KL is a "
                  f"top-k lower bound of the full KL"] = None
        if v.noise_floor is not None and v.noise_floor.reference == "mean of both passes":
            notes["`noise_floor`: the candidate is compared with the mean of two baseline scorings (a flip on an item the runtime "
                  "flipped against itself counts half); the tolerance's rate holds against it (simulated, docs/guarantees.md)"] = None
    whole = gate.unchanged_reject_probability
    if whole is not None:
        notes[f"whole run: an unchanged candidate with these sets' observed discordance is rejected by at least one set "
              f"{whole:.1%} of the time (sets taken as independent; warned above 10%)"] = None
    return list(notes)


def _word(verdict: SetVerdict) -> str:
    return "drop" if verdict.higher_is_better else "rise"


def interval_notes(gate: GateResult) -> list[str]:
    methods = dict.fromkeys(v.interval_method for v in gate.sets)
    return [f"`{method}`: {INTERVAL_NOTES[method]}" for method in methods]


def rule_rows(gate: GateResult) -> Rows:
    """The thresholds each set was judged by, after overrides; '-' for a rule turned off."""
    return [
        [v.eval_set, *("-" if value is None else str(value) for value in v.rules.model_dump().values())]
        for v in gate.sets
    ]


def describe(value: Any) -> str:
    """An input as one cell: `path (hash prefix)` for {path, hash} records, else the value itself."""
    if isinstance(value, dict) and "path" in value:
        digest = value.get("hash")
        return f"{value['path']} ({str(digest)[:12]})" if digest else str(value["path"])
    return str(value)


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts as dotted keys; {path, hash} records and other leaves as one cell each."""
    if not isinstance(value, dict) or ("path" in value and prefix):
        return {prefix: describe(value)}
    flat: dict[str, str] = {}
    for key, item in value.items():
        flat |= flatten(item, f"{prefix}.{key}" if prefix else str(key))
    return flat


def header_rows(report: GateReport) -> Rows:
    rows = [[key.capitalize(), describe(report.inputs[key])] for key in _HEADER_INPUTS if key in report.inputs]
    if "recipe" not in report.inputs:
        rows.append(["Recipe", report.gate.recipe])
    rows.append(["Verdict", report.gate.verdict.upper()])
    if report.performance is not None and report.performance.buys:
        rows.append(["What it buys", report.performance.buys])
    if report.created_at:
        rows.append(["Created", report.created_at])
    return rows


def input_rows(report: GateReport) -> Rows:
    return [[key, text] for key, text in flatten(report.inputs).items()]


def stage_rows(stages: dict[str, float]) -> Rows:
    rows = [[name, f"{seconds:.1f}"] for name, seconds in stages.items()]
    return [*rows, ["total", f"{sum(stages.values()):.1f}"]] if rows else []


def fit_rows(gate: GateResult) -> Rows:
    fit = gate.fit
    if fit is None:
        return []
    return [[fit.gpu, gib(fit.required_bytes), gib(fit.available_bytes), "yes" if fit.fits else "NO"]]


def plan_tables(plan: dict[str, Any] | None) -> list[tuple[str, list[str], Rows]]:
    """The plan for the artifact, as `quantize plan` prints it: a row per scheme, then the vLLM arguments."""
    if not plan:
        return []
    result = Plan.model_validate(plan)
    return [
        (f"Plan: {plan_title(result)}", PLAN_COLUMNS, [plan_row_cells(row) for row in result.rows]),
        ("Recommended vLLM arguments", ["scheme", "arguments"], [[row.scheme, vllm_arguments(row)] for row in result.rows]),
    ]


# --- Markdown -------------------------------------------------------------------------------------

def _md_table(columns: list[str], rows: Rows) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"

    return "\n".join([line(columns), line(["---"] * len(columns)), *(line(row) for row in rows)])


def _md_list(items: list[str]) -> str:
    return "\n".join(f"- {item}" for item in items)


md_table, md_list = _md_table, _md_list  # public: other reports (pipelines.repair.report) render with them


def performance_markdown(performance) -> str:
    """The load test's sections alone (`quantize loadtest`'s loadtest.md), as report.md renders them."""
    return "\n\n".join(["# Load test", *markdown_sections(performance, _md_table)]) + "\n"


def render_markdown(report: GateReport) -> str:
    """A self-contained Markdown report of one gate run."""
    gate = report.gate
    parts = [f"# Quantization gate: {gate.verdict.upper()}", _md_table(["", ""], header_rows(report))]
    parts += ["## Eval sets", _md_table(SET_COLUMNS, set_rows(gate)),
              f"Scores in points (metric x 100) for metrics in [0, 1], in their own unit otherwise. Delta = candidate - "
              f"baseline with its {gate.settings.confidence:.0%} confidence interval; min. detectable drop: the smallest "
              f"worsening the set detects at alpha {gate.settings.alpha}, power {gate.settings.power}. Intervals:",
              _md_list(interval_notes(gate))]
    parts += ["Worse by at most: the one-sided bound of the worsening (the tolerance rules read it) against the tightest "
              "tolerance in force. Certifiable: the smallest tolerance an unchanged candidate with this set's observed "
              "discordance passes 80% of the time, and the items the tolerance needs at that discordance. P(reject unchanged): "
              "how often this set rejects an unchanged candidate with that discordance (KL not counted)."]
    noise = noise_rows(gate)
    if noise:
        parts += ["## Runtime noise floor", _md_table(NOISE_COLUMNS, noise), NOISE_NOTE]
    parts += ["## Reasons", _md_list(gate.reasons) if gate.reasons else "None: every rule passed."]
    if gate.warnings:
        parts += ["## Warnings", _md_list(gate.warnings)]
    parts += ["## Rules applied", _md_table(RULE_COLUMNS, rule_rows(gate))]
    if gate.sets:
        parts += ["## What the rules guarantee", _md_list(guarantee_notes(gate))]
    if gate.fit is not None:
        parts += ["## Fit", _md_table(["GPU", "Required GiB", "Available GiB", "Fits"], fit_rows(gate))]
    for title, columns, rows in plan_tables(report.plan):
        parts += [f"## {title}", _md_table(columns, rows)]
    if report.performance is not None:
        parts += markdown_sections(report.performance, _md_table)
    if report.stages:
        parts += ["## Stage times", _md_table(["Stage", "Seconds"], stage_rows(report.stages))]
    if report.inputs:
        parts += ["## Inputs", _md_table(["Input", "Value"], input_rows(report))]
    return "\n\n".join(parts) + "\n"


# --- Terminal -------------------------------------------------------------------------------------

def _table(title: str | None, columns: list[str], rows: Rows):
    """output.table renders cells as plain text: set names and CI brackets are never rich tags."""
    return output.table(title, columns, rows)


def render_console(report: GateReport, console: Console | None = None) -> None:
    """The same report as rich tables, for the terminal."""
    out = console or output.console
    gate = report.gate
    colour = "green" if gate.verdict == "promoted" else "red"
    buys = report.performance.buys if report.performance is not None else None
    out.print(f"[bold {colour}]{gate.verdict.upper()}[/bold {colour}]" + (f": the candidate {escape(buys)}" if buys else ""))
    for key, value in header_rows(report):
        if key not in ("Verdict", "What it buys"):
            out.print(f"{key}: {escape(value)}")
    keep = [i for i, column in enumerate(SET_COLUMNS) if column not in _CONSOLE_SKIP]
    rows = [[row[i] for i in keep] for row in set_rows(gate)]
    out.print(_table("Eval sets (points)", [SET_COLUMNS[i] for i in keep], rows))
    noise = noise_rows(gate)
    if noise:
        out.print(_table("Runtime noise floor (the baseline scored twice)", NOISE_COLUMNS, noise))
    if gate.unchanged_reject_probability is not None and gate.sets:
        out.print(f"Whole run: an unchanged candidate with these discordances is rejected {gate.unchanged_reject_probability:.1%} of the time")
    for title, items, style in (("Reasons", gate.reasons, "red"), ("Warnings", gate.warnings, "yellow")):
        if items:
            out.print(f"[bold]{title}[/bold]")
            for item in items:
                out.print(f"  [{style}]-[/{style}] {escape(item)}")
    if gate.fit is not None:
        out.print(_table("Fit", ["GPU", "Required GiB", "Available GiB", "Fits"], fit_rows(gate)))
    for title, columns, rows in plan_tables(report.plan):
        out.print(_table(title, columns, rows))
    if report.performance is not None:
        console_tables(report.performance, _table, lambda value: out.print(escape(value) if isinstance(value, str) else value))
    if report.stages:
        out.print(_table("Stage times", ["Stage", "Seconds"], stage_rows(report.stages)))


UNVERIFIED_NOTE = (
    "> **UNVERIFIED artifact**: it has no manifest.json, so its files could not be checked against recorded"
    " hashes. It was gated with `--allow-unverified` and was not written to the registry."
)


def with_unverified_note(markdown: str, unverified: bool) -> str:
    """report.md of an artifact gated without a manifest: the warning right under its title."""
    if not unverified:
        return markdown
    first, _, rest = markdown.partition("\n")
    if first.startswith("#"):
        return f"{first}\n\n{UNVERIFIED_NOTE}\n{rest}"
    return f"{UNVERIFIED_NOTE}\n\n{markdown}"
