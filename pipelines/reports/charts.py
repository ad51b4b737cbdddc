"""Inline SVG, drawn here (no plotting library, no script): a page stays one self-contained file.

    interval_svg(Interval(...))    one estimate with its interval on a line, the limit it is read against, and the
                                   one-sided bound the rule reads (a set's worsening against its tolerance; a load-test
                                   ratio against the policy's minimum or maximum)
    scatter_svg(points, ...)       points with optional vertical error bars (a repair's frontier: bytes or throughput
                                   against the quality bound; a model's versions over time)

Every label is escaped (markupsafe); each chart carries a <title> that says in words what it draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup

PASS, FAIL, NEUTRAL, LIMIT = "#2e8b57", "#c0392b", "#3b6fb6", "#c0392b"


@dataclass(frozen=True)
class Interval:
    """An estimate and its interval on one axis; `limit` is the line it is judged against, `bound` the value the rule reads."""

    estimate: float
    low: float | None
    high: float | None
    limit: float | None = None
    limit_label: str = "limit"
    bound: float | None = None
    reference: float | None = None  # no change: 0 for a difference, 1 for a ratio
    passed: bool | None = None
    unit: str = ""
    description: str = ""


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    label: str
    colour: str = NEUTRAL
    y_low: float | None = None
    y_high: float | None = None
    marker: str = "circle"  # or "star": the winner


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _domain(values: list[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    span = high - low or max(abs(high), 1.0)
    return low - 0.08 * span, high + 0.08 * span


def _number(value: float) -> str:
    return f"{value:.3g}"


def _clip_range(mark: Interval) -> tuple[float, float]:
    """How far the interval's ends may reach: three spans of the other marks either side (a two-pair ratio interval of
    [0, 1e17] is drawn to the edge, its number still written)."""
    core = _finite([mark.estimate, mark.limit, mark.bound, mark.reference])
    span = (max(core) - min(core)) or max(abs(mark.estimate), 1.0)
    return min(core) - 3 * span, max(core) + 3 * span


def interval_svg(mark: Interval, width: int = 300, height: int = 46) -> Markup:
    reach_low, reach_high = _clip_range(mark)
    ends = ends_written = None
    if mark.low is not None and mark.high is not None:
        ends_written = (mark.low, mark.high)
        ends = (min(max(mark.low, reach_low), reach_high), min(max(mark.high, reach_low), reach_high))
    lo, hi = _domain(_finite([mark.estimate, *(ends or ()), mark.limit, mark.bound, mark.reference]))
    left, right, axis_y = 8, width - 8, 24

    def x(value: float) -> float:
        return round(left + (value - lo) / (hi - lo) * (right - left), 1)

    colour = NEUTRAL if mark.passed is None else PASS if mark.passed else FAIL
    parts = [Markup('<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#9aa3b2"/>').format(left, axis_y, right, axis_y)]
    if mark.reference is not None:
        parts.append(Markup('<line x1="{0}" y1="8" x2="{0}" y2="36" stroke="#9aa3b2" stroke-dasharray="3,3"/>').format(x(mark.reference)))
    if mark.limit is not None:
        at = x(mark.limit)
        side = Markup('text-anchor="end" dx="-4"') if at > width / 2 else Markup('dx="4"')
        parts.append(Markup('<line x1="{0}" y1="4" x2="{0}" y2="36" stroke="{1}" stroke-width="2"/>'
                            '<text x="{0}" y="11" {2} fill="{1}">{3} {4}</text>').format(at, LIMIT, side, mark.limit_label, _number(mark.limit)))
    if ends is not None and ends_written is not None:
        parts.append(Markup('<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}" stroke-width="6" stroke-linecap="round" opacity="0.55"/>')
                     .format(x(ends[0]), axis_y, x(ends[1]), axis_y, colour))
        parts.append(Markup('<text x="{}" y="45" text-anchor="middle">{}</text><text x="{}" y="45" text-anchor="middle">{}</text>')
                     .format(x(ends[0]), _number(ends_written[0]), x(ends[1]), _number(ends_written[1])))
    if mark.bound is not None:
        parts.append(Markup('<path d="M{0},{1} l-5,-9 h10 z" fill="{2}"><title>bound the rule reads: {3}</title></path>')
                     .format(x(mark.bound), axis_y - 4, colour, _number(mark.bound)))
    parts.append(Markup('<circle cx="{}" cy="{}" r="4.5" fill="{}" stroke="white"/>').format(x(mark.estimate), axis_y, colour))
    return Markup('<svg class="chart" role="img" width="{}" height="{}" viewBox="0 0 {} {}" xmlns="http://www.w3.org/2000/svg">'
                  '<title>{}</title>{}</svg>').format(width, height, width, height, mark.description, Markup("").join(parts))


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    step = (high - low) / (count - 1)
    return [low + i * step for i in range(count)]


def _whole_ticks(low: float, high: float, most: int = 10) -> list[float]:
    """Whole numbers within [low, high] (version numbers), at most `most` of them, evenly stepped."""
    first, last = math.ceil(low), math.floor(high)
    step = max(1, math.ceil((last - first + 1) / most))
    return [float(value) for value in range(first, last + 1, step)]


def scatter_svg(points: Sequence[Point], x_label: str, y_label: str, *, title: str, y_line: float | None = None,
                whole_x: bool = False, width: int = 640, height: int = 340) -> Markup:
    """Points (with vertical error bars where given) on linear axes; `y_line`: a dashed reference (a ratio of 1);
    `whole_x`: the x axis counts (version numbers), so its ticks are whole numbers."""
    if not points:
        return Markup("")
    xs = _finite([p.x for p in points])
    ys = _finite([v for p in points for v in (p.y, p.y_low, p.y_high, y_line)])
    (x_lo, x_hi), (y_lo, y_hi) = _domain(xs), _domain(ys)
    left, right, top, bottom = 64, width - 16, 28, height - 44

    def px(value: float) -> float:
        return round(left + (value - x_lo) / (x_hi - x_lo) * (right - left), 1)

    def py(value: float) -> float:
        return round(bottom - (value - y_lo) / (y_hi - y_lo) * (bottom - top), 1)

    parts = [Markup('<text x="{}" y="16" font-weight="600">{}</text>').format(left, title),
             Markup('<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#9aa3b2"/>').format(left, top, right - left, bottom - top)]
    for value in _whole_ticks(x_lo, x_hi) if whole_x else _ticks(x_lo, x_hi):
        parts.append(Markup('<text x="{}" y="{}" text-anchor="middle">{}</text>').format(px(value), bottom + 14, _number(value)))
    for value in _ticks(y_lo, y_hi):
        parts.append(Markup('<text x="{}" y="{}" text-anchor="end">{}</text>').format(left - 4, py(value) + 4, _number(value)))
    parts.append(Markup('<text x="{}" y="{}" text-anchor="middle">{}</text>').format((left + right) / 2, height - 8, x_label))
    parts.append(Markup('<text x="12" y="{0}" transform="rotate(-90 12 {0})" text-anchor="middle">{1}</text>').format((top + bottom) / 2, y_label))
    if y_line is not None:
        parts.append(Markup('<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#9aa3b2" stroke-dasharray="4,3"/>').format(
            left, py(y_line), right, py(y_line)))
    for point in points:
        parts.append(_point(point, px, py))
    return Markup('<svg class="chart" role="img" width="{}" height="{}" viewBox="0 0 {} {}" xmlns="http://www.w3.org/2000/svg">'
                  '<title>{}</title>{}</svg>').format(width, height, width, height, title, Markup("").join(parts))


def _point(point: Point, px, py) -> Markup:
    x, y = px(point.x), py(point.y)
    bar = Markup("")
    if point.y_low is not None and point.y_high is not None:
        bar = Markup('<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="{3}" stroke-width="2"/>').format(
            x, py(point.y_low), py(point.y_high), point.colour)
    size = 7 if point.marker == "star" else 4.5
    shape = (Markup('<rect x="{}" y="{}" width="{}" height="{}" fill="{}" transform="rotate(45 {} {})"/>').format(
        x - size / 2, y - size / 2, size, size, point.colour, x, y) if point.marker == "star"
        else Markup('<circle cx="{}" cy="{}" r="{}" fill="{}"/>').format(x, y, size, point.colour))
    return Markup('<g>{}{}<text x="{}" y="{}">{}</text></g>').format(bar, shape, x + 7, y - 6, point.label)
