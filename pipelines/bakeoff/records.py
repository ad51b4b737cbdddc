"""What a bake-off records (bakeoff.json): one row per recipe x backend, and the bake-off around them.

A row's `status` is the gate's verdict (`passed`: the gate would promote it; a bake-off never registers), or why there
is none: `refused` (the backend cannot express the recipe, or vLLM cannot serve its format here: an InputError before
any heavy work) or `failed` (a server, a scoring, a load test or a backend's subprocess failed). Both carry their one
line in `reason`. A speed `outcome` is the paired load test's conclusion on throughput (pipelines/loadtest/sequential.py);
an interval that cannot decide is `inconclusive`, never `faster`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipelines.errors import EXIT_ERROR, EXIT_OK, EXIT_REJECTED
from pipelines.schema import StrictModel

SCHEMA_VERSION: Literal[1] = 1
RowStatus = Literal["passed", "rejected", "refused", "failed"]
SpeedOutcome = Literal["faster", "slower", "no difference", "inconclusive", "not measured"]


class BackendRecord(StrictModel):
    name: str
    version: str | None = Field(default=None, description="the backend library's version, as the artifact's manifest records it")
    format: str | None = Field(default=None, description="the checkpoint format vLLM loads (config.json quant_method, or the manifest's)")


class SetBound(StrictModel):
    """One eval set's quality bound against its tolerance, in the set's unit (positive: worse than 16-bit)."""

    eval_set: str
    unit: str
    worst_bound: float = Field(description="one-sided upper confidence bound of the worsening (else the 95% interval's bad end)")
    tolerance: float | None = Field(description="the tightest tolerance in force (null: the set has no bound rule)")
    passed: bool


class SpeedRecord(StrictModel):
    throughput_ratio: float | None = Field(default=None, description="candidate / 16-bit output tokens/s at the deployment concurrency")
    interval: list[float] | None = Field(default=None, description="[low, high] of the ratio, 95% (null with one pair)")
    outcome: SpeedOutcome = "not measured"
    pairs: int | None = None
    concurrency: int | None = None


class BakeoffRow(StrictModel):
    index: int = Field(ge=1)
    recipe: str = Field(description="the recipe as --recipes names it")
    recipe_name: str = Field(description="the name it ran under: NAME on its own backend, NAME-BACKEND on another")
    backend: BackendRecord
    status: RowStatus
    reason: str | None = Field(default=None, description="refused / failed: the one-line cause; rejected: the first reason")
    reasons: list[str] = Field(default_factory=list, description="every reason the gate gave (rejected rows)")
    weight_bytes: int | None = None
    baseline_weight_bytes: int | None = Field(default=None, description="the 16-bit source model's weight bytes")
    bytes_ratio: float | None = Field(default=None, description="weight_bytes / baseline_weight_bytes")
    artifact_bytes: int | None = Field(default=None, description="every file of the artifact folder, on disk")
    speed: SpeedRecord = SpeedRecord()
    sets: list[SetBound] = Field(default_factory=list)
    quantize_s: float | None = Field(default=None, description="the quantization's wall time, as its manifest records it")
    quantize_reused: bool | None = Field(default=None, description="the artifact existed already (same inputs): quantize_s is that run's")
    peak_memory_bytes: int | None = None
    peak_memory_upper_bound: bool = Field(
        default=False, description="the quantizing process's peak RSS had been reached before this row (an in-process backend after "
                                   "an earlier row): the row's own peak is at most this",
    )
    wall_s: float = Field(ge=0)
    run_dir: str | None = None
    artifact_dir: str | None = None
    recipe_file: str | None = Field(default=None, description="the row's recipe as it ran (in the bake-off folder): `quantize --recipe` it")

    @property
    def label(self) -> str:
        return f"{self.recipe} on {self.backend.name}"

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class Bakeoff(StrictModel):
    schema_version: Literal[1] = SCHEMA_VERSION
    created_at: str
    model: str
    recipes: list[str]
    backends: list[str]
    eval_sets: list[str]
    policy: str
    loadtest: bool
    rows: list[BakeoffRow]
    smallest_passing: str | None = Field(description="the passing row with the fewest weight bytes")
    fastest_passing: str | None = Field(description="the passing row proven faster than 16-bit and than every other such row; null otherwise")
    conclusions: list[str] = Field(description="the two sentences bakeoff.md ends its table with")
    folder: str
    wall_s: float
    exit_code: int = Field(description="0: a row passed; 1: none passed and the gate rejected one; 2: no row was gated (all refused or failed)")

    @model_validator(mode="after")
    def _exit_code_of_the_rows(self) -> Bakeoff:
        if self.exit_code != bakeoff_exit_code(self.rows):
            raise ValueError(f"exit_code {self.exit_code} is not what the rows say ({bakeoff_exit_code(self.rows)})")
        return self


def bakeoff_exit_code(rows: list[BakeoffRow]) -> int:
    """0: a row passed; 1: none passed and the gate rejected at least one; 2: no row was gated (all refused or failed)."""
    if any(row.passed for row in rows):
        return EXIT_OK
    # 1 is the gate's word alone (docs/exit-codes.md): rows that were only refused or failed are errors.
    return EXIT_REJECTED if any(row.status == "rejected" for row in rows) else EXIT_ERROR
