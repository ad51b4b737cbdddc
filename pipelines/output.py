"""Printing results: a human table by default, the same data as JSON with --json."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

# Reports are read in CI logs too, where there is no terminal to size them: give tables room there.
_LOG_WIDTH = 160
console = Console(stderr=False, highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else _LOG_WIDTH)
progress_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else _LOG_WIDTH)


def to_jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [to_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {key: to_jsonable(item) for key, item in value.items()}
    return value


def emit(result: Any, *, as_json: bool, render: Callable[[Any], None]) -> None:
    """Print `result` as JSON on stdout (machine use) or through `render` (people)."""
    if as_json:
        sys.stdout.write(json.dumps(to_jsonable(result), indent=2, default=str) + "\n")
    else:
        render(result)


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> Table:
    out = Table(title=title, title_justify="left")
    for column in columns:
        out.add_column(column)
    for row in rows:
        out.add_row(*("" if cell is None else str(cell) for cell in row))
    return out


def progress(message: str) -> None:
    """A progress line on stderr, so that --json output on stdout stays clean."""
    progress_console.print(f"[dim]>[/dim] {message}")
