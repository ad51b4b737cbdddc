"""repair.json: the evidence of one repair (RepairResult), its attempts, the orders weighed and what was found.

The session (pipelines.repair.session) writes it after every attempt; the report and the command read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from pipelines.errors import EXIT_ERROR
from pipelines.loadtest.results import PerformanceSummary
from pipelines.repair.compare import ShippedRecipe
from pipelines.repair.objective import Choice, Contender, Objective, QualityBound
from pipelines.repair.pricing import Price
from pipelines.repair.search import Budget, SearchResult
from pipelines.repair.sensitivity import Sensitivity

REPAIR_JSON = "repair.json"
Status = Literal["running", "repaired", "budget exhausted", "ladder exhausted", "does not fit", "error"]


class SetMove(BaseModel):
    """One eval set under one proposal, in the set's unit (points for pass/fail metrics)."""

    baseline: float
    candidate: float
    unit: str
    right_to_wrong: int | None = None
    wrong_to_right: int | None = None


class Attempt(BaseModel):
    number: int
    moves: int = Field(description="k: how many moves of the promotion sequence this proposal makes")
    why: str
    recipe_name: str
    recipe_file: str
    modules_moved: dict[str, str] = Field(description="unit -> the scheme it moved to")
    overrides_added: list[dict[str, Any]]
    predicted_kl: float
    weight_bytes: int = Field(description="the planner's prediction")
    price: Price
    gated: bool = True
    verdict: Literal["promoted", "rejected"] | None = None
    reasons: list[str] = []
    failed_rules: list[str] = Field(default=[], description="`set: rule` for every rule that failed")
    kl_by_set: dict[str, float | None] = {}
    scores: dict[str, SetMove] = Field(default={}, description="per set: the baseline's and this proposal's score, and the answers that changed")
    run_dir: str | None = None
    artifact_dir: str | None = None
    measured_weight_bytes: int | None = None
    registry_version: int | None = None
    estimated_quantize_s: float | None = Field(default=None, description="the quantize wall time this proposal implies (pricing.quantize_cost)")
    quantize_s: float | None = Field(default=None, description="the quantize wall time measured (0 when an artifact was reused)")
    wall_s: float = 0.0
    error: str | None = Field(default=None, description="why the gate could not decide (the search stopped; a pass was already found)")
    quality: QualityBound | None = Field(default=None, description="the worst set's worsening bound (the frontiers' x axis)")
    performance: PerformanceSummary | None = Field(default=None, description="the load test's headline (a passing attempt, load test on)")
    loadtest_s: float | None = Field(default=None, description="seconds the load test added to this attempt's gate (its servers' starts included)")

    @property
    def bytes(self) -> int:
        return self.measured_weight_bytes or self.weight_bytes

    def size_order(self) -> tuple[int, float, int]:
        """Bytes first, then the quantize's wall time (measured, else estimated), then the attempt's number."""
        return self.bytes, self.quantize_s or self.estimated_quantize_s or 0.0, self.number

    def contender(self) -> Contender:
        return Contender(name=f"attempt {self.number}", passed=self.verdict == "promoted", weight_bytes=self.bytes,
                         quality=self.quality, performance=self.performance)


class OrderChoice(BaseModel):
    order: str
    moves: int
    first_k: int = Field(description="the first proposal: the fewest moves simulated under the target")
    simulated_kl: float
    weight_bytes: int
    estimated_quantize_s: float | None = None


class Found(BaseModel):
    attempt: int
    recipe_file: str
    recipe_name: str
    artifact_dir: str
    run_dir: str
    registry_version: int | None
    weight_bytes: int
    modules_moved: int


class RepairResult(BaseModel):
    """repair.json."""

    schema_version: Literal[1] = 1
    repair_id: str
    created_at: str
    status: Status
    exit_code: int = Field(default=EXIT_ERROR, description="0 repaired, 1 no proposal passed, 2 error (or still running)")
    repair_dir: str
    parent: dict[str, Any]
    model: str
    target: str
    ladder: dict[str, str]
    budget: Budget
    objective: Objective = Field(default="size", description="what wins among the passing attempts (pipelines.repair.objective)")
    settings: dict[str, Any]
    units: int
    ladders_skipped: dict[str, list[str]] = Field(default={}, description="per unit, rungs its shapes or the recipe rule out")
    near_ties: dict[str, float] = Field(default={}, description="per set, the share of items whose baseline answer starts on a near-tie "
                                                                "(sensitivity.near_tie_shares)")
    sensitivity: Sensitivity | None = None
    orders: list[OrderChoice] = Field(default=[], description="each promotion order and its first proposal")
    order: str | None = Field(default=None, description="the order searched: level by level with three gates or more, "
                                                        "else the one whose first proposal costs the fewest bytes")
    sequence: list[dict[str, Any]] = Field(default=[], description="the promotion sequence: unit, to, delta bytes, estimated KL removed")
    attempts: list[Attempt] = []
    search: SearchResult | None = None
    found: Found | None = None
    choice: Choice | None = Field(default=None, description="how the found attempt won under the objective, in words")
    frontier_plots: dict[str, str] = Field(default={}, description="bytes and throughput against the quality bound (PNG files)")
    closest: dict[str, Any] | None = Field(default=None, description="when nothing passed: the attempt that came closest, and why it failed")
    bytes: dict[str, int | None] = Field(default={}, description="weight bytes of the 16-bit model, the shipped recipes and the parent "
                                                                 "(predicted by the planner) and of the parent artifact (measured)")
    shipped: list[ShippedRecipe] = Field(default=[], description="every shipped recipe on this model: applies, bytes, verdict here")
    wall_s: dict[str, float] = {}
    report_md: str | None = None
    plot: str | None = None
    error: str | None = None

    def gated(self) -> list[Attempt]:
        """The attempts the gate decided, in size order (what the objective ranks and the frontiers show)."""
        return sorted((a for a in self.attempts if a.verdict is not None), key=Attempt.size_order)


def load_result(folder: Path) -> RepairResult:
    return RepairResult.model_validate_json((folder / REPAIR_JSON).read_text())
