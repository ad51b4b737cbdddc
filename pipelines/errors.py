"""Errors the CLI maps to exit codes. Every user-facing error renders as one line naming file and field."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

# The exit contract (docs/exit-codes.md): 0 promoted / success, 1 rejected by the gate, 2 every error.
EXIT_OK, EXIT_REJECTED, EXIT_ERROR = 0, 1, 2

# An error line is read by a person: a hostile value (a 100 KB URL, file name or JSON field) must not flood the terminal.
MAX_MESSAGE_CHARS = 500
MAX_WHERE_CHARS = 200  # the file (a path, a URL) and the field each
MAX_LINE_CHARS = MAX_MESSAGE_CHARS + 2 * MAX_WHERE_CHARS + 40
_KEPT_TAIL = 160  # what a cut line keeps of its end: "(log: /path/to/the/server.log)"


def bounded(text: str, limit: int) -> str:
    """`text` on one line (whitespace runs folded), cut to `limit` characters when longer: its head and its last
    characters kept around " ... " (a cause comes first, the log an error names comes last)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    tail = min(_KEPT_TAIL, limit // 3)
    return f"{text[: limit - tail - 5]} ... {text[-tail:]}"


class QuantGateError(Exception):
    """An error caused by input or environment; the CLI prints it on one line and exits with code 2."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, file: str | Path | None = None, field: str | None = None):
        self.file = bounded(str(file), MAX_WHERE_CHARS) if file is not None else None
        self.field = bounded(field, MAX_WHERE_CHARS) if field is not None else None
        self.message = bounded(str(message), MAX_MESSAGE_CHARS)
        self.details: dict[str, object] | None = None  # extra fields of the --json error object (cli.main)
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = ": ".join(part for part in (self.file, self.field) if part)
        return f"{where}: {self.message}" if where else self.message


class InputError(QuantGateError):
    """Bad input: a file, a field, a value."""


class ServeError(QuantGateError):
    """The vLLM server could not start, died or hung."""


class EvalError(QuantGateError):
    """Scoring failed."""


class QuantizeError(QuantGateError):
    """A quantize backend's process failed or died (its cause and log named)."""


class LoadTestError(QuantGateError):
    """The load test (vLLM bench serve) failed or returned what cannot be read."""


def from_validation_error(error: ValidationError, file: str | Path) -> InputError:
    """The first pydantic error, as one line naming the file and the dotted field path."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(top level)"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif "input" in first and first["type"] not in ("missing",):
        shown = repr(first["input"])
        message = f"{message} (got {shown if len(shown) <= 120 else shown[:117] + '...'})"
    more = len(error.errors()) - 1
    if more:
        message += f" (+{more} more problem{'s' if more > 1 else ''})"
    return InputError(message, file=file, field=field)
