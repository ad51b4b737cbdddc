"""What a watch session reports: each window's figures and verdicts, and the session's (watch.json, --json)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipelines.canary.probe import CanaryResult
from pipelines.deploy.envelope import Envelope
from pipelines.deploy.limits import FigureLimit
from pipelines.schema import StrictModel
from pipelines.watch.figures import Figures
from pipelines.watch.recommend import Recommendation
from pipelines.watch.rollback import RollbackResult
from pipelines.watch.verdict import FigureVerdict


class WindowReport(StrictModel):
    index: int
    start: float
    end: float
    figures: Figures
    verdicts: list[FigureVerdict] = Field(default_factory=list)
    breached: list[str] = Field(default_factory=list)
    invalid: list[str] = Field(default_factory=list, description="why no server could have produced this window: it is not judged")
    canary: CanaryResult | None = None  # the golden set's probe after this window (pipelines.canary)


class WatchReport(StrictModel):
    url: str
    source: Literal["metrics", "prometheus"]
    prometheus: str | None = None
    window_s: float
    version: dict[str, Any] | None = None
    envelope: Envelope | None = None
    limits: list[FigureLimit] = Field(default_factory=list)
    windows: list[WindowReport] = Field(default_factory=list)
    overall: WindowReport | None = None
    verdict: Literal["within", "breach", "figures only", "invalid"] = "figures only"  # invalid: no breach, but a window no server
    invalid_windows: list[int] = Field(default_factory=list)  # could have produced (pipelines/watch/plausible.py): exit 2
    breached_windows: list[int] = Field(default_factory=list)
    recommendations: list[Recommendation] = Field(default_factory=list)
    recommendation_notes: list[str] = Field(default_factory=list)
    rollback: RollbackResult | None = None
    shadow: dict[str, Any] | None = None
    canary: dict[str, Any] | None = None  # the version's golden set: its file, size and tolerance (None: no canary)
    folder: str | None = None
    plot: str | None = None

    def document(self) -> dict[str, Any]:
        """The JSON document: the whole session's figures at the top level (keys naming each figure), then the rest."""
        overall = self.overall.figures.model_dump(mode="json") if self.overall else {}
        return {**overall, **self.model_dump(mode="json")}
