"""What a candidate identical to its baseline gets from each kind of bound, and the fewest items with which it passes a
tolerance: the size below which a set is refused at load (it could not pass even against an identical model).

Fractions of one item's reach (the value range: 1 for metrics in [0, 1], the score itself for metrics in their own
unit). Per kind (docs/gate-json.md, "Intervals"):
- binary: Tango's bound at the calibrated critical value (pipelines.gate.exact), z^2 / (n + z^2); passes a tolerance T
  from about ln(1 - c) / ln(1 - T) items (53 for 5.5 points at 95%);
- continuous: the betting bound of n zero differences (pipelines.gate.betting; 62 items for 5.5 points);
- corpus: the zero-count floor 1 - (1 - c)^(1/n) (stats.zero_count_bound; 53 items for 5.5 points, 59 for 5%).
"""

from __future__ import annotations

from pipelines.evaluation.metrics import MetricKind
from pipelines.gate import betting, exact, stats


def identical_bound(kind: MetricKind, n: int, tolerance: float | None, confidence: float) -> float:
    """The one-sided bound of an identical candidate's worsening, a fraction of the reach. `tolerance` (a fraction):
    the pass/fail test is calibrated at it (None: Tango's asymptotic z)."""
    if kind == "binary":
        z = exact.critical_value(n, tolerance, confidence) if tolerance is not None and 0.0 < tolerance < 1.0 else None
        return stats.identical_floor(n, confidence=confidence, z=z)
    if kind == "continuous":
        return betting.identical_bound(n, confidence)
    return stats.zero_count_bound(n, confidence=confidence)


def identical_items_needed(kind: MetricKind, tolerance: float, confidence: float) -> int | None:
    """The fewest items with which an identical candidate passes `tolerance` (a fraction of the reach); None: no number."""
    if tolerance >= 1.0:
        return 1
    if kind == "binary":
        return exact.identical_items_needed(tolerance, confidence)
    if kind == "continuous":
        return betting.identical_items_needed(tolerance, confidence)
    return stats.zero_count_items_needed(tolerance, confidence=confidence)
