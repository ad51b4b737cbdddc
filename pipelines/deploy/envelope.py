"""A version's envelope: the load test's own figures for it at the concurrency it is deployed with, and the policy's SLOs.

The figures are the load test's typed record (pipelines.loadtest.results.ModelFigures: KV capacity, memory watermark and
every swept level), held whole; `Envelope.level` is the one level production is held to. The limits derived from an
envelope live beside it (pipelines/deploy/limits.py).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from pipelines.loadtest.config import ProductionSlo, SloTargets
from pipelines.loadtest.results import LevelFigures, ModelFigures, PerformanceReport
from pipelines.schema import FrozenModel


class Envelope(FrozenModel):
    """What the version showed under the load test at the concurrency it is deployed with, and the policy's SLOs."""

    measured_on: str = Field(description="the serve target the load test ran on")
    measured_max_num_seqs: int | None
    figures: ModelFigures = Field(description="the load test's figures of the version (of its 16-bit model where it has none)")
    concurrency: int = Field(ge=1, description="the swept level of `figures` held: the highest at or below the deployed max_num_seqs")
    slo: SloTargets
    production: ProductionSlo
    gate_path: str | None = Field(default=None, description="the gate.json the figures come from")

    @model_validator(mode="after")
    def _level_swept(self) -> Envelope:
        if self.figures.at(self.concurrency) is None:
            raise ValueError(f"the load test swept no level at concurrency {self.concurrency}")
        return self

    @property
    def level(self) -> LevelFigures:
        """The load test's figures at the held concurrency (TTFT / ITL / TPOT percentiles, throughput, failures)."""
        return next(level for level in self.figures.levels if level.concurrency == self.concurrency)  # one there: _level_swept


def envelope_of(performance: PerformanceReport, concurrency: int, gate_path: str | None) -> Envelope | None:
    """The candidate's figures at `concurrency` (else at the highest swept level below it); None without figures there."""
    figures = performance.figures("candidate") or performance.figures("baseline")
    below = [level.concurrency for level in figures.levels if level.concurrency <= concurrency] if figures is not None else []
    if figures is None or not below:
        return None
    return Envelope(
        measured_on=performance.target, measured_max_num_seqs=performance.tuning.measured_max_num_seqs if performance.tuning else None,
        figures=figures, concurrency=max(below), slo=performance.policy.slo, production=performance.policy.production,
        gate_path=gate_path,
    )
