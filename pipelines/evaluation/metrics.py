"""What an eval set's primary metric is: its direction, how lm-eval aggregates it, and its report unit.

The evaluator builds a MetricSpec from the task YAML's `metric_list` (or lm-eval's default for the
output type) and the gate judges with it; neither guesses from the metric's name alone.

Kinds:
- binary      per-item 0/1 scores averaged (acc, acc_norm, exact_match): a paired-proportions interval;
- continuous  per-item numbers averaged (`aggregation: mean`): a paired bootstrap with a width floor;
- corpus      per-item values lm-eval aggregates over the whole set (f1, mcc, bleu, chrf, ter, the
              perplexities, bits_per_byte): the aggregate of each model on paired bootstrap resamples.

Scale: every score, delta and bound is reported in `unit`s, metric value x `scale`. Metrics that live
in [0, 1] are reported in points (x100); metrics lm-eval already reports on 0-100 (bleu, chrf, ter)
or unbounded (perplexity) keep their own unit (x1).

Tolerances follow the unit: a metric in points is judged in points (the policy's ni_margin, max_abs_drop)
and optionally relative to its baseline (max_rel_drop); a metric in its own unit only relative to its
baseline (rel_margin, max_rel_drop): 3 points mean nothing to a perplexity of 7 or a bits_per_byte of 0.9.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field

from pipelines.schema import FrozenModel

MetricKind = Literal["binary", "continuous", "corpus"]

POINTS = "points"
BINARY_METRICS = frozenset({"acc", "acc_norm", "exact_match"})
# lm-eval aggregations that are not a mean of per-item numbers (lm_eval/api/metrics.py).
CORPUS_AGGREGATIONS = frozenset(
    {"f1", "matthews_corrcoef", "bleu", "chrf", "chrf++", "ter", "perplexity", "weighted_perplexity", "bits_per_byte"}
)
# Metrics whose values are not in [0, 1]: reported in their own unit rather than points.
OWN_UNIT_METRICS = frozenset(
    {"bleu", "chrf", "chrf++", "ter", "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"}
)
# Of those, the ones on a 0-100 scale; the others (perplexities, bits) are unbounded.
PERCENT_SCALE_METRICS = frozenset({"bleu", "chrf", "chrf++", "ter"})
# lm-eval's default metrics per output type (lm_eval/api/task.py), first one primary.
DEFAULT_METRIC = {
    "generate_until": ("exact_match", "mean", True),
    "multiple_choice": ("acc", "mean", True),
    "loglikelihood": ("acc", "mean", True),
    "loglikelihood_rolling": ("word_perplexity", "weighted_perplexity", False),
}


class MetricSpec(FrozenModel):
    name: str
    higher_is_better: bool = True
    aggregation: str = Field(default="mean", description="'mean' or an lm-eval corpus aggregation name")
    kind: MetricKind = "binary"

    @property
    def unit(self) -> str:
        return self.name if self.name in OWN_UNIT_METRICS else POINTS

    @property
    def scale(self) -> float:
        return 1.0 if self.name in OWN_UNIT_METRICS else 100.0

    @property
    def in_points(self) -> bool:
        """Reported in points: absolute tolerances in points apply to it; otherwise only relative ones."""
        return self.unit == POINTS

    @property
    def relative_scale(self) -> bool:
        """In its own unit (perplexities, bits_per_byte, bleu, chrf, ter): one item's reach scales with the score itself,
        so the floor of its bound and its tolerance are fractions of the score, whatever the score."""
        return self.name in OWN_UNIT_METRICS

    @property
    def unbounded_items(self) -> bool:
        """Perplexities and bits_per_byte: one item can move the score without limit (a loglikelihood has no floor), so
        damage confined to a few items is bounded by no tolerance; the policy's damage_share says how few."""
        return self.name in OWN_UNIT_METRICS and self.name not in PERCENT_SCALE_METRICS

    @property
    def bounded_unit_interval(self) -> bool:
        """Per-item values (binary and continuous kinds) are known to lie in [0, 1]."""
        return self.name not in OWN_UNIT_METRICS


def value_range(spec: MetricSpec, scores: tuple[float, ...]) -> float:
    """How far one item can move the set's score, in metric units: 1 for metrics in [0, 1]; for a metric in its own unit
    the largest of `scores` (the two models' corpus scores: one item's reach scales with the score; or the per-item
    values' spread for a metric averaged per item)."""
    if spec.bounded_unit_interval:
        return 1.0
    return max((abs(score) for score in scores), default=1.0) or 1.0


def corpus_aggregation(name: str) -> Callable[[list], float]:
    """lm-eval's own aggregation function (imported lazily: lm-eval is slow to import)."""
    from lm_eval.api.registry import get_aggregation  # heavy: imported when used

    return get_aggregation(name)


def metric_kind(name: str, aggregation: str) -> MetricKind:
    if aggregation != "mean":
        return "corpus"
    return "binary" if name in BINARY_METRICS else "continuous"


def make_spec(name: str, aggregation: str = "mean", higher_is_better: bool = True) -> MetricSpec:
    return MetricSpec(name=name, aggregation=aggregation, higher_is_better=higher_is_better, kind=metric_kind(name, aggregation))
