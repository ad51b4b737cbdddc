"""argparse types shared by the commands: bounded, finite, one-line errors (exit 2 through the CLI's parser)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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
