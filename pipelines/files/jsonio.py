"""JSON read with bounds: the one JSON reader for files a user or another run gives (a manifest, gate.json, evidence,
a job ledger). NaN, Infinity and numbers too large for a float (1e999),
bad UTF-8, bad syntax, absurd nesting and files over a size are an InputError naming
the file (and the line). Its constant guard is the JSON Lines reader's too (pipelines.files.jsonl)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipelines.errors import InputError
from pipelines.files.yamlio import decode_utf8, read_user_bytes


def refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def finite_float(text: str) -> float:
    """A JSON number as a float; one too large for a float (`1e999`, read as infinity) is refused as NaN/Infinity are."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number (too large for a float)")
    return value


def parse_json_strict(raw: bytes, path: Path | str) -> Any:
    """JSON from bytes (a UTF-8 byte-order mark is dropped); NaN/Infinity/1e999, bad UTF-8, bad syntax and
    absurd nesting are an InputError naming `path` (and the line, where there is one)."""
    text = decode_utf8(raw, path)
    try:
        return json.loads(text, parse_constant=refuse_constant, parse_float=finite_float)
    except json.JSONDecodeError as error:
        raise InputError(f"not valid JSON: {error.msg} (column {error.colno})", file=path, field=f"line {error.lineno}") from None
    except ValueError as error:
        raise InputError(f"not valid JSON: {error}", file=path) from None
    except RecursionError:
        raise InputError("not valid JSON: nested too deep", file=path) from None


def read_json_object(path: Path, *, what: str, max_bytes: int, field: str | None = None) -> tuple[dict[str, Any], bytes]:
    """A JSON object from a file of at most `max_bytes`, with the bytes it was parsed from."""
    raw = read_user_bytes(path, what=what, field=field, max_bytes=max_bytes)
    data = parse_json_strict(raw, path)
    if not isinstance(data, dict):
        raise InputError(f"must be a JSON object (got {type(data).__name__})", file=path, field="(top level)")
    return data, raw
