"""Every planned row through a row runner, one after another; a refusal or a failure is a row, never the end.

    bakeoff = run_bakeoff(plan)                      # quantize_and_gate per row; the folder written at the end
    rows = run_rows(plan, runner=fake)               # unit tests hand in a fake runner

The runner's InputError (the backend cannot express the recipe, or vLLM cannot serve its format here: said before any
heavy work) makes a `refused` row; its other errors (pipelines.errors: a server, a scoring, the load test, a backend's
subprocess that died, a full disk) a `failed` row, each with its one line. An interruption ends the bake-off (exit 2,
nothing written); anything else is a bug and ends it too, as an internal error with its traceback in a log.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from pipelines.bakeoff.output import write_bakeoff
from pipelines.bakeoff.plan import BakeoffPlan, PlannedRow
from pipelines.bakeoff.records import Bakeoff, BakeoffRow
from pipelines.bakeoff.rows import row_from_outcome, unrun_row
from pipelines.console.output import progress
from pipelines.errors import InputError, QuantGateError
from pipelines.recipe import LoadedRecipe
from pipelines.runs.runner import GateSettings, RunOutcome, quantize_and_gate

RowRunner = Callable[[LoadedRecipe, Path, GateSettings], RunOutcome]


def process_peak_bytes() -> int:
    """This process's peak RSS so far (what an in-process quantization's manifest records; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_bakeoff(plan: BakeoffPlan, runner: RowRunner | None = None, *, bakeoffs_dir: Path | None = None) -> Bakeoff:
    """Every row (through `runner`, quantize_and_gate unless given), then artifacts/bakeoffs/<model>-<UTC stamp>/
    (bakeoff.json, bakeoff.md, bakeoff.png, recipes/)."""
    started = time.monotonic()
    created = datetime.now(timezone.utc)
    rows = run_rows(plan, runner or quantize_and_gate)
    return write_bakeoff(plan, rows, created=created, wall_s=round(time.monotonic() - started, 1), bakeoffs_dir=bakeoffs_dir)


def run_rows(plan: BakeoffPlan, runner: RowRunner, *, process_peak: Callable[[], int] = process_peak_bytes) -> list[BakeoffRow]:
    rows: list[BakeoffRow] = []
    total = len(plan.rows)
    for index, planned in enumerate(plan.rows, start=1):
        label = f"bake-off: row {index}/{total}: {planned.label}"
        progress(f"{label} ...")
        row = _run_row(index, planned, plan, runner, process_peak)
        rows.append(row)
        progress(f"{label}: {_said(row)} in {row.wall_s:.0f} s ({_counts(rows)}; {total - index} row(s) left)")
    return rows


def _run_row(index: int, planned: PlannedRow, plan: BakeoffPlan, runner: RowRunner, process_peak: Callable[[], int]) -> BakeoffRow:
    started = time.monotonic()
    if planned.loaded is None:
        return unrun_row(index, planned, "refused", planned.refusal or "refused while planning", 0.0)
    peak_before = process_peak()
    try:
        outcome = runner(planned.loaded, plan.model_dir, plan.settings)
    except InputError as error:
        return unrun_row(index, planned, "refused", error.one_line(), time.monotonic() - started)
    except QuantGateError as error:
        return unrun_row(index, planned, "failed", f"{type(error).__name__}: {error.one_line()}", time.monotonic() - started)
    try:
        return row_from_outcome(index, planned, outcome, wall_s=time.monotonic() - started, peak_before=peak_before)
    except QuantGateError as error:  # the run's own evidence (gate.json) cannot be read back: no verdict to show
        return unrun_row(index, planned, "failed", f"its run's evidence cannot be read: {error.one_line()}", time.monotonic() - started)


def _said(row: BakeoffRow) -> str:
    return row.status + (f" ({row.reason})" if row.reason else "")


def _counts(rows: list[BakeoffRow]) -> str:
    statuses = [row.status for row in rows]
    return ", ".join(f"{statuses.count(status)} {status}" for status in ("passed", "rejected", "refused", "failed"))
