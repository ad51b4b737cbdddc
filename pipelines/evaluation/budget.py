"""Rendering time budgets, kept apart from the template sandbox (pipelines.evaluation.templates) so that the CLI can
start one per command without importing Jinja.

A budget's time depends on the machine's speed, so it grows with the work: a fixed part plus SECONDS_PER_RENDER for
every rendering (a template against an item). A trivial template renders in 20-80 us on the 2 loaded cores this was
measured on, so a legitimate million-item set is never refused for its size; a hostile set gets the fixed part and
1 ms a rendering, no more. A set has its own budget (templates.RenderBudget); the command has one over every set it
renders (CommandBudget), so that twelve sets each just inside their own budget do not add up to minutes.

The command's budget is a TOTAL, COMMAND_SECONDS of rendering CPU time whatever the number of items: grown by each
rendering it let a 100,000-item set of a 0.7 ms template run 131 s (and the 2,000,000-line limit about 45 minutes) and
exit 0. 60 s renders about a million items of a trivial template (20-80 us each) and stops anything slower with one line.
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_RENDER = 0.001
COMMAND_SECONDS = 60.0  # every template of every set one command renders, in all: not grown by the item count


@dataclass
class TimeBudget:
    """Rendering time: `seconds` plus `per_render` for every rendering started, against the time spent rendering
    (reading and parsing the data is not rendering)."""

    seconds: float
    per_render: float = SECONDS_PER_RENDER
    spent: float = 0.0
    renders: int = 0

    @property
    def allowed(self) -> float:
        return self.seconds + self.per_render * self.renders

    @property
    def left(self) -> float:
        return self.allowed - self.spent

    def describe(self) -> str:
        if not self.per_render:
            return f"{self.seconds:g} s of CPU in all ({self.renders:,} renderings)"
        return f"{self.seconds:g} s + {self.per_render * 1000:g} ms a rendering ({self.allowed:.1f} s for {self.renders:,})"


@dataclass
class CommandBudget(TimeBudget):
    """One command's rendering over every set it validates or reads (`command_budget`): a total, not grown per rendering."""

    per_render: float = 0.0


_COMMAND: list[CommandBudget] = []


def command_budget() -> CommandBudget:
    """This command's budget: the one `new_command_budget` started (pipelines.cli starts one per command)."""
    if not _COMMAND:
        new_command_budget()
    return _COMMAND[0]


def new_command_budget(seconds: float | None = None) -> CommandBudget:
    _COMMAND[:] = [CommandBudget(COMMAND_SECONDS if seconds is None else seconds)]
    return _COMMAND[0]
