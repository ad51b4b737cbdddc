"""The repair's human report: report.md in the repair folder, with the sensitivity ranking as a plot (PNG).

report.md: what was repaired and the outcome, the objective's choice and the two frontiers (bytes and throughput
against the quality bound, pipelines.repair.frontier), the bytes of the found artifact against the parent, the
shipped recipes and the 16-bit model, the wall times, the path of the search (one row per proposal: moves,
modules moved, weight bytes, simulated KL, verdict, the rules that failed), the modules the found proposal
moves, and the sensitivity ranking (plot + table, with the proxy/KL rank agreement).
"""

from __future__ import annotations

from pathlib import Path

from pipelines.bounds import MiB
from pipelines.files.atomic import write_text_atomic
from pipelines.gate.report import md_list, md_table
from pipelines.repair import frontier
from pipelines.repair.result import RepairResult, SetMove
from pipelines.repair.sensitivity import NEAR_TIE_NATS, Sensitivity

REPORT_MD = "report.md"
PLOT_PNG = "sensitivity.png"
TOP_ROWS = 24
SWING_POINTS = 10  # a set whose scores spread wider than this between proposals is named under the table


def write_report(result: RepairResult, folder: Path) -> tuple[str, str | None]:
    """report.md (and sensitivity.png when there is a sensitivity pass); returns their paths."""
    plot = None
    if result.sensitivity is not None:
        plot = str(folder / PLOT_PNG)
        moved = set(result.attempts[result.found.attempt - 1].modules_moved) if result.found else set()
        plot_sensitivity(result.sensitivity, moved, folder / PLOT_PNG)
    path = folder / REPORT_MD
    write_text_atomic(path, render(result))
    return str(path), plot


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.2f} MiB ({value:,} B)"


def header_rows(result: RepairResult) -> list[list[str]]:
    parent = result.parent
    gates = sum(a.gated for a in result.attempts)
    rows = [
        ["Status", result.status.upper()],
        ["Rejected run", f"{parent['run_id']} (recipe {parent['recipe']}, registry version {parent['registry_version'] or '-'})"],
        ["Model", result.model],
        ["Serve target / ladder", f"{result.target} / {result.ladder['path']}"],
        ["Full gates used", f"{gates} of {result.budget.max_gates}"],
        ["Objective", result.objective + (f" (decided by {result.choice.decided_by})" if result.choice and result.choice.decided_by else "")],
        ["Stopped because", result.search.stop if result.search else "-"],
    ]
    if result.found:
        found = result.found
        rows += [["Repaired recipe", f"{found.recipe_file} (`quantize --recipe {found.recipe_file}`)"],
                 ["Artifact", found.artifact_dir], ["Run", found.run_dir], ["Registry version", str(found.registry_version or "-")]]
    return rows


def bytes_rows(result: RepairResult) -> list[list[str]]:
    rows = [["found artifact (measured)", _mib(result.found.weight_bytes)]] if result.found else []
    return rows + [[name, _mib(value)] for name, value in result.bytes.items()]


def time_rows(result: RepairResult) -> list[list[str]]:
    rows = [[name, f"{seconds:.1f}"] for name, seconds in result.wall_s.items()]
    if result.sensitivity is not None:
        rows += [[f"sensitivity: {stage}", f"{seconds:.1f}"] for stage, seconds in result.sensitivity.wall_s.items() if stage != "total"]
    if result.sensitivity is not None and result.sensitivity.cached:
        rows.append(["sensitivity pass when it was measured (cached since)", f"{result.sensitivity.wall_s.get('total', 0):.1f}"])
    quantize = result.parent.get("quantize_s")
    return rows + ([["one quantize of the rejected recipe", f"{quantize:.1f}"]] if quantize is not None else [])


def path_rows(result: RepairResult) -> list[list[str]]:
    rows = []
    for a in result.attempts:
        verdict = "PASS" if a.verdict == "promoted" else ("fail" if a.verdict else f"not decided: {a.error}" if a.error else "not gated")
        rows.append([
            str(a.number), a.recipe_name, str(a.moves), moved_by_rung(a.modules_moved),
            _mib(a.measured_weight_bytes or a.weight_bytes), _seconds(a.estimated_quantize_s, a.quantize_s), f"{a.predicted_kl:.3g}",
            ", ".join(f"{k}: {v:.3g}" for k, v in a.kl_by_set.items() if v is not None) or "-",
            verdict, "; ".join(a.failed_rules) or "-", a.run_dir or "-",
        ])
    return rows


def moved_by_rung(modules_moved: dict[str, str]) -> str:
    """`120: 118 to w4 group64 sym / a16, gptq; 2 to 16-bit` (the rung names the algorithm: `, gptq`, else RTN)."""
    counts: dict[str, int] = {}
    for label in modules_moved.values():
        counts[label] = counts.get(label, 0) + 1
    detail = "; ".join(f"{n} to {label}" for label, n in sorted(counts.items(), key=lambda item: -item[1]))
    return f"{len(modules_moved)}: {detail}" if detail else "0"


def _seconds(estimated: float | None, measured: float | None) -> str:
    return f"{'-' if estimated is None else f'{estimated:.0f}'} / {'-' if measured is None else f'{measured:.0f}'}"


def shipped_rows(result: RepairResult) -> list[list[str]]:
    rows = []
    if result.found:
        rows.append([f"**this repair's** ({result.found.recipe_name})", "-", _mib(result.found.weight_bytes), "promoted"])
    for row in result.shipped:
        if row.cannot_apply:
            rows.append([row.recipe, "does not apply", "-", row.cannot_apply])
            continue
        verdict = f"{row.verdict} (registry version {row.registry_version})" if row.verdict else "not gated on this model with these sets"
        rows.append([row.recipe, _mib(row.predicted_bytes), _mib(row.measured_bytes), verdict])
    return rows


def shipped_verdict(result: RepairResult) -> str:
    """One sentence: did the repair beat simply choosing a shipped recipe that passes?"""
    passed = [row for row in result.shipped if row.verdict == "promoted"]
    smaller = [row for row in passed if result.found and (row.measured_bytes or row.predicted_bytes or 0) <= result.found.weight_bytes]
    untested = [row.recipe for row in result.shipped if row.verdict is None and not row.cannot_apply]
    if not result.found:
        return "No proposal passed." + (f" Shipped recipes that passed here: {', '.join(r.recipe for r in passed)}." if passed else "")
    if smaller:
        return (f"A shipped recipe that passed here is no larger: {', '.join(r.recipe for r in smaller)} — choosing it beats this repair.")
    note = f" Not gated here, so not compared by verdict: {', '.join(untested)}." if untested else ""
    return f"No shipped recipe that passed here is smaller than the repair's artifact.{note}"


def sensitivity_rows(sensitivity: Sensitivity) -> list[list[str]]:
    return [
        [str(rank), e.unit, e.scheme, f"{e.proxy[e.scheme]:.3g}", "-" if e.kl is None else f"{e.kl:.3g}"]
        for rank, e in enumerate(sensitivity.units[:TOP_ROWS], start=1)
    ]


def render(result: RepairResult) -> str:
    parts = [f"# Repair: {result.status.upper()}", md_table(["", ""], header_rows(result))]
    parts += ["## Weight bytes", md_table(["", "weight bytes"], bytes_rows(result)),
              "Predicted by the planner (pipelines.planner.predict_weight_bytes) unless measured."]
    if result.shipped:
        parts += ["## Against every shipped recipe on this model", md_table(
            ["recipe", "weight bytes (predicted)", "weight bytes (measured)", "verdict here"], shipped_rows(result)),
            shipped_verdict(result)]
    if result.choice is not None:
        parts += frontier.section([a.contender() for a in result.gated()], result.choice, result.frontier_plots,
                                  f"## Objective: {result.objective}; the frontiers", md_table)
    parts += ["## Wall time (s)", md_table(["stage", "seconds"], time_rows(result))]
    if result.orders:
        parts += ["## Promotion order", md_table(
            ["order", "moves", "first proposal (moves)", "simulated KL", "weight bytes", "searched"],
            [[c.order, str(c.moves), str(c.first_k), f"{c.simulated_kl:.3g}", _mib(c.weight_bytes), "yes" if c.order == result.order else ""]
             for c in result.orders])]
    parts += ["## Search path", md_table(
        ["#", "proposal", "moves", "modules moved, by rung", "weight bytes", "quantize s (estimated / measured)", "simulated KL",
         "gate KL by set", "verdict", "failed rules", "run"],
        path_rows(result))]
    if any(a.scores for a in result.attempts):
        parts += set_movement_section(result)
    if result.found:
        found = result.attempts[result.found.attempt - 1]
        parts += [f"## Modules moved by {found.recipe_name}", md_list([f"`{u}` -> {s}" for u, s in found.modules_moved.items()])]
    if result.closest:
        parts += ["## Closest attempt", f"Attempt {result.closest['attempt']} ({result.closest['recipe_file']}) failed:",
                  md_list(result.closest["reasons"])]
    if result.sensitivity is not None:
        parts += sensitivity_section(result.sensitivity)
    if result.error:
        parts += ["## Error", result.error]
    return "\n\n".join(parts) + "\n"


def set_movement_section(result: RepairResult) -> list[str]:
    """Each set's score under each gated proposal beside its share of near-tied baseline answers: a set whose
    scores swing between proposals of close simulated KL is measuring ties, not the quantization."""
    gated = [a for a in result.attempts if a.scores]
    names = list(dict.fromkeys(name for a in gated for name in a.scores))
    rows = []
    for name in names:
        first = next(a.scores[name] for a in gated if name in a.scores)
        tie = result.near_ties.get(name)
        rows.append([name, f"{first.baseline:.1f}", "-" if tie is None else f"{tie:.0%}",
                     *(_moved(a.scores.get(name)) for a in gated)])
    points = {name: [a.scores[name].candidate for a in gated if name in a.scores and a.scores[name].unit == "points"] for name in names}
    swing = [name for name in names if _spread(points[name]) > SWING_POINTS]
    notes = [f"Near-ties: items whose 16-bit answer starts with its top two tokens within {NEAR_TIE_NATS} nats (baseline cache). "
             "Cells: the proposal's score (answers right -> wrong / wrong -> right)."]
    if swing:
        notes.append(f"{', '.join(swing)}: scores spread over more than {SWING_POINTS} points between proposals; with many near-tied answers a "
                     "set flips together under small perturbations, and the simulated KL (an average over positions) does not "
                     "predict which way.")
    return ["## How each eval set moved", md_table(["set", "baseline", "near-ties", *(f"attempt {a.number}" for a in gated)], rows), *notes]


def _moved(move: SetMove | None) -> str:
    if move is None:
        return "-"
    flips = f" ({move.right_to_wrong} / {move.wrong_to_right})" if move.right_to_wrong is not None else ""
    return f"{move.candidate:.1f}{flips}"


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if values else 0.0


def sensitivity_section(sensitivity: Sensitivity) -> list[str]:
    notes = [
        f"KL: {sensitivity.prompts} reference paths ({sensitivity.positions} positions) from the {sensitivity.reference_source}; "
        f"proxy: relative output error on {sensitivity.proxy_texts} texts ({sensitivity.proxy_source}).",
        f"Spearman rank correlation proxy vs KL over the units whose KL was measured: {sensitivity.spearman} "
        f"(p {sensitivity.spearman_p}); KL split-half (even vs odd prompts): {sensitivity.split_half}. "
        "The search ranks by KL where measured, then by the proxy.",
        f"Simulated KL of the rejected recipe as a whole: {sensitivity.kl_parent:.3g} nats/token. "
        f"Sensitivity wall time: {sensitivity.wall_s.get('total', 0):.1f} s{' (cached)' if sensitivity.cached else ''}.",
    ]
    return ["## Sensitivity", f"![sensitivity ranking]({PLOT_PNG})", md_list(notes),
            md_table(["rank", "module", "scheme", "proxy error", "KL (nats/token)"], sensitivity_rows(sensitivity))]


def plot_sensitivity(sensitivity: Sensitivity, moved: set[str], path: Path) -> None:
    """KL per unit (measured, else estimated from the proxy) in the search's order; moved units highlighted."""
    import matplotlib  # heavy: imported when used

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: imported when used

    entries = sensitivity.units[:48]
    ratio = sensitivity.kl_per_proxy()
    values = [e.kl if e.kl is not None else e.proxy[e.scheme] * ratio for e in entries]
    colours = ["tab:red" if e.unit in moved else "tab:blue" for e in entries]
    figure, axis = plt.subplots(figsize=(10, max(3.0, 0.22 * len(entries) + 1.2)))
    bars = axis.barh(range(len(entries)), [max(v, 1e-12) for v in values], color=colours)
    for bar, entry in zip(bars, entries, strict=True):
        if entry.kl is None:
            bar.set_hatch("//")
            bar.set_alpha(0.6)
    axis.set_yticks(range(len(entries)), [e.unit for e in entries], fontsize=7)
    axis.invert_yaxis()
    axis.set_xscale("log")
    axis.set_xlabel("KL(16-bit || this module fake-quantized), nats/token (hatched: estimated from the proxy)")
    axis.set_title(f"Sensitivity ranking ({len(sensitivity.units)} modules; red: moved by the repair; "
                   f"Spearman proxy/KL {sensitivity.spearman})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
