"""The bake-off's folder: artifacts/bakeoffs/<model>-<UTC stamp>/, assembled in a hidden sibling and renamed into place
(pipelines.files.atomic.atomic_dir), so a reader sees all of it or none of it.

    bakeoff.json   every row (pipelines.bakeoff.records.Bakeoff)
    bakeoff.md     the table, then "smallest passing: ..." and "fastest passing: ..."
    bakeoff.png    weight bytes against the measured throughput ratio
    recipes/       each gated row's recipe as it ran (NAME-BACKEND.yaml on another backend): `quantize --recipe` the winner
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from pipelines.bakeoff.plan import BakeoffPlan
from pipelines.bakeoff.plot import write_plot
from pipelines.bakeoff.records import Bakeoff, BakeoffRow, bakeoff_exit_code
from pipelines.bakeoff.table import fastest_passing, markdown, smallest_passing
from pipelines.files.atomic import atomic_dir, write_text_atomic
from pipelines.settings import current as current_settings

JSON_FILE, MARKDOWN_FILE, PLOT_FILE, RECIPES_DIR = "bakeoff.json", "bakeoff.md", "bakeoff.png", "recipes"


def default_bakeoffs_dir() -> Path:
    """`$QUANTGATE_ARTIFACTS/bakeoffs` as the environment says now."""
    return current_settings().artifacts_dir / "bakeoffs"


def new_folder(root: Path, model: str, created: datetime) -> Path:
    """<root>/<model>-<UTC stamp>, numbered when a bake-off of the same model started in the same second."""
    base = f"{model}-{created.strftime('%Y%m%dT%H%M%SZ')}"
    folder, number = root / base, 1
    while folder.exists():
        number += 1
        folder = root / f"{base}-{number}"
    return folder


def write_bakeoff(plan: BakeoffPlan, rows: list[BakeoffRow], *, created: datetime, wall_s: float,
                  bakeoffs_dir: Path | None = None) -> Bakeoff:
    """The folder, written atomically; returns the Bakeoff it holds (its rows naming their recipe files there)."""
    final = new_folder(bakeoffs_dir or default_bakeoffs_dir(), plan.model_dir.name, created)
    gated = {row.recipe_name for row in rows if row.status in ("passed", "rejected")}
    texts = {planned.loaded.name: planned.loaded.text for planned in plan.rows if planned.loaded is not None and planned.loaded.name in gated}
    rows = [row.model_copy(update={"recipe_file": str(final / RECIPES_DIR / f"{row.recipe_name}.yaml")}) if row.recipe_name in texts
            else row for row in rows]
    smallest, smallest_line = smallest_passing(rows)
    fastest, fastest_line = fastest_passing(rows)
    bakeoff = Bakeoff(
        created_at=created.isoformat(timespec="seconds"), model=str(plan.model_dir), recipes=plan.recipes, backends=plan.backends,
        eval_sets=[s.name for s in plan.settings.eval_sets], policy=str(plan.settings.policy_path), loadtest=plan.settings.loadtest,
        rows=rows, smallest_passing=smallest, fastest_passing=fastest, conclusions=[smallest_line, fastest_line], folder=str(final),
        wall_s=wall_s, exit_code=bakeoff_exit_code(rows),
    )
    with atomic_dir(final) as staging:
        for name, text in texts.items():
            write_text_atomic(staging / RECIPES_DIR / f"{name}.yaml", text)
        write_plot(rows, staging / PLOT_FILE, plan.model_dir.name)
        write_text_atomic(staging / JSON_FILE, bakeoff.model_dump_json(indent=2) + "\n")
        write_text_atomic(staging / MARKDOWN_FILE, markdown(bakeoff, PLOT_FILE))
    return bakeoff
