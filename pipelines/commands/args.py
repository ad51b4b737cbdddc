"""argparse types shared by the commands: bounded, finite, one-line errors (exit 2 through the CLI's parser)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from pipelines.errors import InputError

MAX_LIST_CHARS = 10_000  # a comma-separated option: far more than any list it takes
MAX_EVAL_SET_NAMES = 256


def int_arg(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a decimal integer in [low, high] (no float, no overflow past the bound)."""

    def parse(text: str) -> int:
        digits = text[1:] if text[:1] in ("+", "-") else text
        if not digits.isascii() or not digits.isdigit() or len(digits) > 30:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high} (got {text!r})")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high} (got {value})")
        return value

    parse.__name__ = "integer"
    return parse


def float_arg(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] ((low, high] with low_open); NaN and inf refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number (got {text!r})") from None
        above_low = value > low if low_open else value >= low
        if not math.isfinite(value) or not above_low or value > high:
            bound = f"more than {low:g}" if low_open else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number, {bound} and at most {high:g} (got {text!r})")
        return value

    parse.__name__ = "number"
    return parse


def comma_list(text: str | None, option: str, *, max_items: int) -> list[str] | None:
    """The stripped, non-empty parts of a comma-separated option (None when it is not given): a text past MAX_LIST_CHARS or
    more than `max_items` parts is an InputError naming the option, before any part is looked at."""
    if not text:
        return None
    if len(text) > MAX_LIST_CHARS:
        raise InputError(f"{len(text):,} characters: at most {MAX_LIST_CHARS:,} ({max_items} values at most)", field=option)
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if len(parts) > max_items:
        raise InputError(f"{len(parts):,} values: at most {max_items}", field=option)
    return parts


def eval_set_names(text: str | None) -> list[str] | None:
    """--eval-sets: comma-separated eval set names, bounded (None: every set)."""
    return comma_list(text, "--eval-sets", max_items=MAX_EVAL_SET_NAMES)


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_arg(low_s: float, high_s: float) -> Callable[[str], float]:
    """An argparse type: a duration such as 30s, 5m, 1h, 250ms or plain seconds, in [low_s, high_s] seconds."""

    def parse(text: str) -> float:
        stripped = text.strip().lower()
        unit = next((u for u in ("ms", "s", "m", "h") if stripped.endswith(u)), "")
        number = stripped[: len(stripped) - len(unit)] if unit else stripped
        try:
            value = float(number) * _UNITS[unit or "s"] if len(number) <= 30 else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not low_s <= value <= high_s:
            raise argparse.ArgumentTypeError(f"must be a duration from {low_s:g} s to {high_s:g} s, e.g. 30s, 5m, 1h (got {text!r})")
        return value

    parse.__name__ = "duration"
    return parse
