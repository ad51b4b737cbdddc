"""The two frontiers a choice is read on, as a Markdown table and PNG plots (matplotlib, Agg).

    bytes vs quality bound        every gated candidate: weight bytes against its worst set's worsening bound
    throughput vs quality bound   every load-tested one: the throughput ratio (95% interval as an error bar)

One point per candidate; rejected candidates greyed (the load test does not run after a rejection, so they appear on
the first plot only); the winner marked. A passing candidate is on a frontier when no other passing candidate is at
least as good on both axes and better on one (fewer bytes or a higher ratio, and a bound no worse). A job writes one
pair of plots per model (pipelines/jobs/report.py), a repair one pair (pipelines/repair/report.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipelines.bounds import MiB
from pipelines.repair.objective import Choice, Contender

COLUMNS = ["candidate", "verdict", "weight MiB", "quality bound (worst set)", "throughput ratio [95% CI]",
           "bytes frontier", "speed frontier", "chosen"]
BYTES_PLOT, SPEED_PLOT = "frontier-bytes.png", "frontier-speed.png"
BOUND_LABEL = "worst eval set's worsening bound (one-sided 95%; positive: worse than 16-bit)"


def _mib(contender: Contender) -> float | None:
    return None if contender.weight_bytes is None else contender.weight_bytes / MiB


def _faster(contender: Contender) -> float | None:
    return contender.ratio


PLOTS: dict[str, tuple[str, str, Callable[[Contender], float | None]]] = {
    "bytes vs quality bound": (BYTES_PLOT, "weight bytes (MiB)", _mib),
    "throughput vs quality bound": (SPEED_PLOT, "throughput ratio vs 16-bit (95% CI)", _faster),
}


def _dominated(one: Contender, others: list[Contender], better: Callable[[Contender], float | None]) -> bool:
    """Whether another passing contender is no worse on both axes (`better`: higher is better) and strictly better on one."""
    mine, bound = better(one), one.quality.value if one.quality else None
    if mine is None or bound is None:
        return False
    for other in others:
        theirs, their_bound = better(other), other.quality.value if other.quality else None
        if other is one or theirs is None or their_bound is None:
            continue
        if theirs >= mine and their_bound <= bound and (theirs > mine or their_bound < bound):
            return True
    return False


def _fewer_bytes(contender: Contender) -> float | None:
    return -contender.weight_bytes if contender.weight_bytes is not None else None


def on_frontier(contender: Contender, contenders: list[Contender], better: Callable[[Contender], float | None]) -> bool:
    passing = [c for c in contenders if c.passed]
    return contender.passed and better(contender) is not None and contender.quality is not None and not _dominated(contender, passing, better)


def rows(contenders: list[Contender], choice: Choice) -> list[list[str]]:
    """One row per contender, in the order given (size order)."""
    def mark(contender: Contender, better) -> str:
        return "yes" if on_frontier(contender, contenders, better) else ""

    return [
        [c.name, "passed" if c.passed else "rejected", "-" if c.weight_bytes is None else f"{c.weight_bytes / MiB:.2f}",
         c.quality.text if c.quality else "-", c.ratio_text(), mark(c, _fewer_bytes), mark(c, _faster),
         f"**winner ({choice.decided_by})**" if c.name == choice.winner else ""]
        for c in contenders
    ]


def section(contenders: list[Contender], choice: Choice, plots: dict[str, str], heading: str, md_table) -> list[str]:
    """The Markdown parts: the choice in words, the frontier table, the plots (`md_table(columns, rows)` renders)."""
    parts = [heading, *choice.notes, md_table(COLUMNS, rows(contenders, choice)),
             f"Quality bound: the {BOUND_LABEL}. Throughput ratio: candidate / 16-bit output tokens/s from the paired load test at "
             "the deployment's concurrency (a rejected candidate is not load-tested)."]
    parts += [f"![{name}]({file})" for name, file in plots.items()]
    return parts


def write_plots(contenders: list[Contender], choice: Choice, folder: Path, prefix: str = "", title: str = "") -> dict[str, str]:
    """frontier-bytes.png always (when any contender has bytes and a bound), frontier-speed.png when any has a throughput
    ratio; returns {what: file name} (`prefix` prepended: a job writes one pair per model)."""
    import matplotlib  # heavy: imported when used

    matplotlib.use("Agg")
    from matplotlib import pyplot  # heavy: imported when used

    written = {}
    for what, (name, label, value) in PLOTS.items():
        points = [(c, y) for c in contenders if c.quality is not None and (y := value(c)) is not None]
        if not points:
            continue
        figure, axes = pyplot.subplots(figsize=(6.5, 4.2), dpi=100)
        for contender, y in points:
            interval = contender.interval if name == SPEED_PLOT else None
            _point(axes, contender, y, interval, winner=contender.name == choice.winner)
        if name == SPEED_PLOT:
            axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        axes.set_xlabel(BOUND_LABEL, fontsize=8)
        axes.set_ylabel(label)
        axes.set_title(f"{what}{': ' + title if title else ''} (winner by {choice.decided_by or '-'}: {choice.winner or 'none'})", fontsize=9)
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figure.savefig(folder / f"{prefix}{name}")
        pyplot.close(figure)
        written[what] = f"{prefix}{name}"
    return written


def _point(axes, contender: Contender, y: float, interval: tuple[float, float] | None, *, winner: bool) -> None:
    assert contender.quality is not None
    colour = "tab:red" if winner else ("tab:blue" if contender.passed else "lightgrey")
    error = [[y - interval[0]], [interval[1] - y]] if interval else None
    axes.errorbar([contender.quality.value], [y], yerr=error, fmt="*" if winner else "o", markersize=12 if winner else 6,
                  color=colour, ecolor=colour, capsize=3)
    axes.annotate(contender.name, (contender.quality.value, y), textcoords="offset points", xytext=(5, 4), fontsize=7,
                  color="grey" if not contender.passed else "black")
