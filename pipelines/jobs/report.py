"""The job's choice per model under its objective, and report.md with both frontiers per model.

    choices = choose_per_model({"demo-llama": [contender, ...]}, "speed")
    write_report("nightly", "speed", choices, folder)      # folder/report.md, folder/<model>-frontier-*.png

The contenders are a model's decided results (promoted: passed; rejected: greyed on the plots) in size order; the
objective's rules are pipelines.repair.objective's, the same a repair uses for its attempts. The job promotes every
candidate that passes and sets no alias: the winner is reported (with its registry version) for `quantize registry
alias` to name.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from pipelines.files.atomic import write_text_atomic
from pipelines.gate.report import md_table
from pipelines.repair import frontier
from pipelines.repair.objective import Choice, Contender, Objective, choose
from pipelines.schema import StrictModel

REPORT_MD = "report.md"


class ModelChoice(StrictModel):
    model: str
    choice: Choice
    contenders: list[Contender] = Field(description="the model's decided candidates in size order")
    registry_version: int | None = Field(default=None, description="the winner's")
    frontier_plots: dict[str, str] = Field(default_factory=dict)


def choose_per_model(by_model: dict[str, list[Contender]], objective: Objective) -> list[ModelChoice]:
    return [ModelChoice(model=model, choice=choose(contenders, objective), contenders=contenders) for model, contenders in by_model.items()]


def write_report(job: str, objective: Objective, choices: list[ModelChoice], folder: Path) -> tuple[Path, list[ModelChoice]]:
    """report.md and each model's frontier plots in `folder`; returns its path and the choices with their plots."""
    folder.mkdir(parents=True, exist_ok=True)
    drawn = [c.model_copy(update={"frontier_plots": frontier.write_plots(c.contenders, c.choice, folder, f"{c.model}-", c.model)})
             for c in choices]
    parts = [f"# Job {job}: the winner per model by {objective}"]
    for entry in drawn:
        parts += frontier.section(entry.contenders, entry.choice, entry.frontier_plots, f"## {entry.model}", md_table)
    path = folder / REPORT_MD
    write_text_atomic(path, "\n\n".join(parts) + "\n")
    return path, drawn
