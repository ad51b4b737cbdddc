"""The bake-off's table (the same cells on the terminal and in bakeoff.md) and its two conclusions.

smallest passing: the passing row with the fewest weight bytes. fastest passing: named only when the load test decided
it: its throughput interval lies wholly above the 16-bit model's (outcome `faster`) and above every other passing row's
interval (an inconclusive one's too); otherwise the sentence says that none is proven faster, or which rows it cannot
tell apart.
"""

from __future__ import annotations

from pipelines.bakeoff.records import Bakeoff, BakeoffRow, SetBound, SpeedRecord
from pipelines.bounds import MiB
from pipelines.gate.report import md_table

# `reason` last: the terminal's table leaves it out (vLLM's refusals run to hundreds of characters) and says each under it.
COLUMNS = ["#", "recipe", "backend (version, format)", "verdict", "weight MiB (x 16-bit)", "throughput ratio [95% CI]", "speed",
           "quality bound / tolerance per set", "quantize s", "peak MiB", "reason"]
NOTES = (
    "Quality bound: each set's one-sided 95% upper bound on the worsening against the 16-bit model, in the set's unit "
    "(positive: worse), next to the tolerance it must stay under. Throughput ratio: candidate / 16-bit output tokens/s from "
    "the paired load test at the policy's deployment concurrency (run only after the quality gate passes); `inconclusive`: "
    "the interval cannot decide. Quantize s and peak MiB: as the artifact's manifest records them (`cached`: an artifact "
    "from an earlier run with the same inputs; `<=`: the quantizing process had reached that peak before this row)."
)


def cells(row: BakeoffRow) -> list[str]:
    return [str(row.index), row.recipe, _backend(row), row.status, _bytes(row), ratio_text(row.speed), _speed(row.speed),
            "; ".join(_bound(bound) for bound in row.sets) or "-", _quantize(row), _peak(row), row.reason or ""]


def _backend(row: BakeoffRow) -> str:
    details = ", ".join(part for part in (row.backend.version, row.backend.format) if part)
    return f"{row.backend.name} ({details})" if details else row.backend.name


def _bytes(row: BakeoffRow) -> str:
    if row.weight_bytes is None:
        return "-"
    ratio = f" ({row.bytes_ratio:.2f}x)" if row.bytes_ratio is not None else ""
    return f"{row.weight_bytes / MiB:.2f}{ratio}"


def ratio_text(speed: SpeedRecord) -> str:
    if speed.throughput_ratio is None:
        return "-"
    if speed.interval is None:
        return f"{speed.throughput_ratio:.3f} (one pair: no interval)"
    return f"{speed.throughput_ratio:.3f} [{speed.interval[0]:.3f}, {speed.interval[1]:.3f}]"


def _speed(speed: SpeedRecord) -> str:
    return speed.outcome + (f", {speed.pairs} pair{'' if speed.pairs == 1 else 's'}" if speed.pairs else "")


def _bound(bound: SetBound) -> str:
    tolerance = "no bound rule" if bound.tolerance is None else f"{bound.tolerance:g}"
    return f"{bound.eval_set} {bound.worst_bound:+.2f} / {tolerance} {bound.unit}{'' if bound.passed else ' (failed)'}"


def _quantize(row: BakeoffRow) -> str:
    if row.quantize_s is None:
        return "-"
    return f"{row.quantize_s:.1f}" + (" (cached)" if row.quantize_reused else "")


def _peak(row: BakeoffRow) -> str:
    if row.peak_memory_bytes is None:
        return "-"
    return ("<= " if row.peak_memory_upper_bound else "") + f"{row.peak_memory_bytes / MiB:.0f}"


# --- the conclusions -------------------------------------------------------------------------------------------------


def smallest_passing(rows: list[BakeoffRow]) -> tuple[str | None, str]:
    """The passing row with the fewest weight bytes (the first of equals), and its sentence."""
    passing = [row for row in rows if row.passed]
    if not passing:
        return None, "smallest passing: none (no row passed the quality gate)"
    sized = [row for row in passing if row.weight_bytes is not None]
    if not sized:
        return None, "smallest passing: not known (no passing row's manifest records its weight bytes)"
    smallest = min(sized, key=lambda row: row.weight_bytes or 0)
    assert smallest.weight_bytes is not None
    ratio = f", {smallest.bytes_ratio:.2f}x the 16-bit model's" if smallest.bytes_ratio is not None else ""
    return smallest.label, f"smallest passing: {smallest.label} ({smallest.weight_bytes / MiB:.2f} MiB of weights{ratio})"


def fastest_passing(rows: list[BakeoffRow]) -> tuple[str | None, str]:
    """The passing row proven faster than the 16-bit model whose interval no other passing row's reaches, and its sentence."""
    passing = [row for row in rows if row.passed]
    if not passing:
        return None, "fastest passing: none (no row passed the quality gate)"
    proven = [row for row in passing if row.speed.outcome == "faster" and row.speed.interval is not None]
    if not proven:
        measured = "; ".join(f"{row.label}: {row.speed.outcome} {ratio_text(row.speed)}" for row in passing)
        return None, f"fastest passing: none is proven faster than the 16-bit model ({measured})"
    best = max(proven, key=lambda row: row.speed.throughput_ratio or 0.0)
    # any other passing row whose interval reaches best's may be as fast or faster, an inconclusive one too
    tied = [row for row in passing if row is not best and row.speed.interval is not None and _overlap(row.speed, best.speed)]
    if tied:
        names = ", ".join(row.label for row in [best, *tied])
        faster = ", ".join(row.label for row in [best, *tied] if row in proven)
        return None, (f"fastest passing: not decided between {names}: their 95% throughput intervals overlap (proven faster than "
                      f"the 16-bit model: {faster})")
    return best.label, f"fastest passing: {best.label} (throughput {ratio_text(best.speed)} x the 16-bit model's, faster)"


def _overlap(one: SpeedRecord, other: SpeedRecord) -> bool:
    assert one.interval is not None and other.interval is not None
    return one.interval[0] <= other.interval[1] and other.interval[0] <= one.interval[1]


# --- bakeoff.md --------------------------------------------------------------------------------------------------------


def markdown(bakeoff: Bakeoff, plot_file: str) -> str:
    parts = [
        f"# Bake-off: {bakeoff.model}",
        f"Recipes {', '.join(bakeoff.recipes)} on backends {', '.join(bakeoff.backends)}; eval sets {', '.join(bakeoff.eval_sets)}; "
        f"policy {bakeoff.policy}; load test {'on' if bakeoff.loadtest else 'off'}; the same cached 16-bit baseline for every row; "
        f"nothing registered. {len(bakeoff.rows)} row(s) in {bakeoff.wall_s:.0f} s, {bakeoff.created_at}.",
        md_table(COLUMNS, [cells(row) for row in bakeoff.rows]),
        *bakeoff.conclusions,
        NOTES,
        f"![bytes vs throughput ratio]({plot_file})",
    ]
    recipes = [row for row in bakeoff.rows if row.recipe_file]
    if recipes:
        parts.append("Each row's recipe as it ran is in recipes/ here: `quantize --recipe FILE --model MODEL` gates and registers "
                     "the one you choose.")
    return "\n\n".join(parts) + "\n"
