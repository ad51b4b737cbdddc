"""What `quantize report RUN_ID|NAME` names, where its page goes, and the page written there.

    located = locate("20261207T...-w8a8-...", runs_dir)   # a run folder (gate.json), a repair folder (repair.json),
                                                        # or else a registry model's name
    write_page(out or default_out(located, artifacts_dir), html)

A name that is not a folder under runs/ is a model name; the registry says whether it knows it (one line, exit 2, for
neither: `unknown_target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipelines.errors import InputError
from pipelines.files.atomic import write_text_atomic
from pipelines.files.safepath import component_problem, ensure_inside

GATE_JSON, REPAIR_JSON, PAGE = "gate.json", "repair.json", "report.html"
REPORTS_FOLDER = "reports"  # under the artifacts root: model pages


@dataclass(frozen=True)
class Located:
    kind: Literal["run", "repair", "model"]
    name: str
    folder: Path | None = None  # the run's or repair's folder


def locate(target: str, runs_dir: Path) -> Located:
    """A run or repair folder named `target` under `runs_dir`, else the model `target` (checked by the registry)."""
    if component_problem(target) is None:
        folder = ensure_inside(runs_dir, runs_dir / target, "run id")
        if folder.is_dir():
            if (folder / GATE_JSON).is_file():
                return Located("run", target, folder)
            if (folder / REPAIR_JSON).is_file():
                return Located("repair", target, folder)
            raise InputError(f"the run folder has neither {GATE_JSON} nor {REPAIR_JSON} (a run that failed keeps error.txt)",
                             file=folder, field="RUN_ID")
    return Located("model", target)


def unknown_target(target: str, runs_dir: Path, registry_error: InputError) -> InputError:
    """Neither a run folder nor a registered model: one line naming both places looked in."""
    return InputError(f"no run {target!r} under {runs_dir}, and {registry_error.message}", file=registry_error.file, field="RUN_ID|NAME")


def default_out(located: Located, artifacts_dir: Path) -> Path:
    """A run's or repair's page beside its report.md; a model's under <artifacts>/reports/<name>.html."""
    if located.folder is not None:
        return located.folder / PAGE
    problem = component_problem(located.name)
    if problem is not None:
        raise InputError(f"the model's name cannot name a file ({problem}); give --out", field="--out")
    return artifacts_dir / REPORTS_FOLDER / f"{located.name}.html"


def write_page(path: Path, html: str) -> Path:
    """The page written atomically (a reader never sees half of it; its folder made when missing)."""
    if path.is_dir():
        raise InputError("is a folder; --out names the page's file", file=path, field="--out")
    write_text_atomic(path, html)
    return path
