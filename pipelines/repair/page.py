"""The repair's HTML page (report.html beside report.md in the repair folder): the outcome first, then the frontier
(every gated attempt's weight bytes, and the load-tested ones' throughput ratio with its interval, against its quality
bound; the winner marked), the search path, the shipped recipes, bytes and wall times.

The rows are report.md's (pipelines.repair.report, pipelines.repair.frontier); the drawings are
pipelines.reports.charts'; the page shell escapes every name (pipelines.reports.markup).
"""

from __future__ import annotations

from pathlib import Path

from pipelines.bounds import MiB
from pipelines.repair import frontier
from pipelines.repair import report as md
from pipelines.repair.objective import Contender
from pipelines.repair.result import RepairResult
from pipelines.reports.charts import FAIL, NEUTRAL, PASS, Point, scatter_svg
from pipelines.reports.markup import Markup, bullets, heading, key_values, note, page, paragraph, section, table, verdict_banner

REPORT_HTML = "report.html"
PATH_COLUMNS = ["#", "proposal", "moves", "modules moved, by rung", "weight bytes", "quantize s (estimated / measured)", "simulated KL",
                "gate KL by set", "verdict", "failed rules", "run"]


def _plain(cells: list[str]) -> list[str]:
    """report.md's cells without Markdown emphasis (the page marks the winner itself)."""
    return [cell.replace("**", "") for cell in cells]


def _colour(contender: Contender, winner: str | None) -> str:
    return PASS if contender.name == winner else NEUTRAL if contender.passed else FAIL


def frontier_points(contenders: list[Contender], winner: str | None, *, speed: bool) -> list[Point]:
    """One point per contender with a bound (and bytes, or a throughput ratio); the winner drawn last, on top."""
    points = []
    for c in sorted(contenders, key=lambda contender: contender.name == winner):
        if c.quality is None:
            continue
        if speed:
            if c.ratio is None:
                continue
            low, high = c.interval or (None, None)
            points.append(Point(x=c.quality.value, y=c.ratio, label=c.name, colour=_colour(c, winner), y_low=low, y_high=high,
                                marker="star" if c.name == winner else "circle"))
        elif c.weight_bytes is not None:
            points.append(Point(x=c.quality.value, y=c.weight_bytes / MiB, label=c.name, colour=_colour(c, winner),
                                marker="star" if c.name == winner else "circle"))
    return points


def frontier_section(result: RepairResult) -> Markup:
    contenders = [a.contender() for a in result.gated()]
    if result.choice is None or not contenders:
        return section("Frontier", paragraph("No attempt was gated."), anchor="frontier")
    winner = result.choice.winner
    drawings = [scatter_svg(frontier_points(contenders, winner, speed=False), frontier.BOUND_LABEL, "weight MiB",
                            title="bytes vs quality bound (green: the winner; blue: passed; red: rejected)")]
    speed = frontier_points(contenders, winner, speed=True)
    if speed:
        drawings.append(scatter_svg(speed, frontier.BOUND_LABEL, "throughput ratio vs 16-bit (95% CI)",
                                    title="throughput vs quality bound (bars: 95% interval)", y_line=1.0))
    rows = [_plain(row) for row in frontier.rows(contenders, result.choice)]
    return section(f"Objective: {result.objective}; the frontiers", bullets(result.choice.notes), *drawings,
                   table(frontier.COLUMNS, rows, row_classes=["pass" if c.passed else "fail" for c in contenders]),
                   note(f"Quality bound: the {frontier.BOUND_LABEL}. A rejected attempt is not load-tested."), anchor="frontier")


def render_repair_page(result: RepairResult) -> str:
    found = result.found
    lines = ([f"repaired by attempt {found.attempt} ({found.recipe_name}): {found.weight_bytes / MiB:.2f} MiB, "
              f"{found.modules_moved} modules moved"] if found else [])
    lines += [md.shipped_verdict(result)] if result.shipped else []
    if result.closest:
        lines += [f"closest: attempt {result.closest['attempt']}", *result.closest.get("reasons", [])[:3]]
    blocks = [verdict_banner(result.status, f"Repair of {result.parent.get('recipe', '?')} on {Path(result.model).name}", lines),
              key_values([_plain(row) for row in md.header_rows(result)]), frontier_section(result),
              section("Search path", table(PATH_COLUMNS, md.path_rows(result),
                                           row_classes=["pass" if a.verdict == "promoted" else "fail" for a in result.attempts]), anchor="path")]
    if result.shipped:
        blocks.append(section("Against every shipped recipe on this model", table(
            ["recipe", "weight bytes (predicted)", "weight bytes (measured)", "verdict here"], [_plain(row) for row in md.shipped_rows(result)])))
    blocks.append(section("Weight bytes", table(["", "weight bytes"], md.bytes_rows(result))))
    blocks.append(section("Wall time (s)", table(["stage", "seconds"], md.time_rows(result))))
    if found is not None:
        moved = result.attempts[found.attempt - 1].modules_moved
        blocks.append(section(f"Modules moved by {found.recipe_name}", heading(f"{len(moved)} modules"),
                              table(["module", "to"], [[unit, scheme] for unit, scheme in moved.items()])))
    if result.error:
        blocks.append(section("Error", paragraph(result.error)))
    return page(f"Repair {result.repair_id}: {result.status}", *blocks)
