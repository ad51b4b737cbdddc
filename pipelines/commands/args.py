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
