"""bakeoff.png: each gated row's weight bytes against its measured throughput ratio (95% interval as an error bar), one
marker per verdict, the 16-bit model at (its bytes, 1). Rows the load test did not measure (a rejection is not
load-tested) lie on the x axis, their verdict's marker hollow; refused and failed rows have nothing to draw and are counted in
the title (with none gated, the axes say so). matplotlib Agg, as the other plots (pipelines/loadtest/plots.py, pipelines/repair/frontier.py)."""

from __future__ import annotations

from pathlib import Path

from pipelines.bakeoff.records import BakeoffRow
from pipelines.bounds import MiB

STYLE = {"passed": ("tab:blue", "o"), "rejected": ("tab:red", "s")}  # marker by verdict
UNMEASURED = ("grey", "x")  # a status the plot has no style for
BASELINE = ("black", "D")


def write_plot(rows: list[BakeoffRow], path: Path, title: str) -> None:
    """The PNG at `path` (with no row to draw, the axes say so: the folder always holds its plot)."""
    import matplotlib  # heavy: imported when used

    matplotlib.use("Agg")
    from matplotlib import pyplot  # heavy: imported when used

    drawn = [row for row in rows if row.weight_bytes is not None]
    figure, axes = pyplot.subplots(figsize=(7, 4.5), dpi=100)
    if not drawn:
        axes.text(0.5, 0.5, "no row was gated: nothing to draw", ha="center", va="center", transform=axes.transAxes, color="grey")
    labelled: set[str] = set()
    for row in drawn:
        _point(axes, row, labelled)
    baseline = next((row.baseline_weight_bytes for row in drawn if row.baseline_weight_bytes), None)
    if baseline is not None:
        axes.plot([baseline / MiB], [1.0], marker=BASELINE[1], color=BASELINE[0], linestyle="none", label="16-bit model")
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xlabel("weight bytes (MiB)")
    axes.set_ylabel("throughput ratio vs 16-bit (95% CI)")
    axes.set_ylim(bottom=0)
    axes.set_xlim(left=0)
    undrawn = len(rows) - len(drawn)
    axes.set_title(f"bake-off: {title}" + (f" ({undrawn} refused or failed row(s) not drawn)" if undrawn else ""), fontsize=9)
    axes.grid(True, alpha=0.3)
    if drawn:
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def _point(axes, row: BakeoffRow, labelled: set[str]) -> None:
    assert row.weight_bytes is not None
    x, ratio, interval = row.weight_bytes / MiB, row.speed.throughput_ratio, row.speed.interval
    colour, marker = STYLE.get(row.status, UNMEASURED)
    if ratio is None:  # hollow, on the x axis: its bytes are known, its speed is not
        legend = f"{row.status}, not load-tested (on the axis)"
        axes.plot([x], [0.0], marker=marker, color=colour, markerfacecolor="none", linestyle="none", clip_on=False,
                  label=_once(legend, labelled))
        axes.annotate(row.label, (x, 0.0), textcoords="offset points", xytext=(5, 6), fontsize=7, color="grey")
        return
    error = [[ratio - interval[0]], [interval[1] - ratio]] if interval else None
    axes.errorbar([x], [ratio], yerr=error, fmt=marker, color=colour, ecolor=colour, capsize=3, label=_once(row.status, labelled))
    axes.annotate(f"{row.label} ({row.speed.outcome})", (x, ratio), textcoords="offset points", xytext=(5, 4), fontsize=7)


def _once(label: str, labelled: set[str]) -> str | None:
    """A legend entry the first time a kind of point is drawn (None after: one entry per kind)."""
    if label in labelled:
        return None
    labelled.add(label)
    return label
