"""Printing results: a human table by default, the same data as JSON with --json.

Everything printed here that comes from data (model names, reasons, file names, eval set names) is shown
literally: rich markup in it (`[/x]`, `[link=...]`) is text, never a style or a link, and cannot break
the rendering. Markup is only interpreted in the fixed strings the product writes itself.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

# Reports are read in CI logs too, where there is no terminal to size them: give tables room there.
_LOG_WIDTH = 160
console = Console(stderr=False, highlight=False, emoji=False, soft_wrap=True, width=None if sys.stdout.isatty() else _LOG_WIDTH)
progress_console = Console(stderr=True, highlight=False, emoji=False, soft_wrap=True, width=None if sys.stderr.isatty() else _LOG_WIDTH)


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


_CONTROL = {code: f"\\x{code:02x}" for code in (*range(0x09), 0x0B, 0x0C, 0x0D, *range(0x0E, 0x20), 0x7F, *range(0x80, 0xA0))}


def printable(text: str) -> str:
    """Control characters (an ESC that would drive the terminal, a carriage return) shown as \\xNN."""
    return text.translate(_CONTROL)


def literal(value: Any) -> Text:
    """A cell or title shown exactly as written: markup is not interpreted (a rich Text passes through)."""
    if isinstance(value, Text):
        return value
    return Text(printable("" if value is None else str(value)))


def table(title: str | Text | None, columns: list[str], rows: list[list[Any]]) -> Table:
    """A table whose title and cells are literal text (see `literal`)."""
    out = Table(title=None if title is None else literal(title), title_justify="left")
    for column in columns:
        out.add_column(literal(column))
    for row in rows:
        out.add_row(*(literal(cell) for cell in row))
    return out


def say(value: Any) -> None:
    """Text on stdout, printed literally (a table or other rich renderable as it is)."""
    console.print(literal(value) if isinstance(value, (str, int, float)) or value is None else value)


# Called before each progress line (pipelines.console.capture: says once where library output went, when it did).
before_progress: Callable[[], None] | None = None


def progress(message: str) -> None:
    """A progress line on stderr, so that --json output on stdout stays clean; the message is literal."""
    hook = before_progress
    if hook is not None:
        hook()
    progress_console.print(f"[dim]>[/dim] {escape(printable(str(message)))}")
