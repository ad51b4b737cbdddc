"""What the load test reports: the `performance` section of gate.json (docs/gate-json.md, docs/loadtest.md).

Light on purpose (pydantic only): pipelines.gate.schema imports it for GateReport.performance.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, computed_field, model_validator

from pipelines.hardware.prediction import WorkloadPrediction
from pipelines.hardware.speed import ProbedSpeed
from pipelines.loadtest.config import ComparisonSettings, PerformancePolicy
from pipelines.schema import StrictModel

Role = Literal["baseline", "candidate"]
Outcome = Literal["faster", "slower", "no difference", "inconclusive"]
Stop = Literal["precise", "budget", "max_pairs"]
CheckStatus = Literal["passed", "failed", "inconclusive"]


class Percentiles(StrictModel):
    """Milliseconds at the 50th, 95th and 99th percentile, as vLLM bench serve computes them (numpy, linear)."""

    p50: float = Field(ge=0)
    p95: float = Field(ge=0)
    p99: float = Field(ge=0)


class LevelFigures(StrictModel):
    """One model at one concurrency: the median over its repeated runs of each figure the tool reported."""

    concurrency: int = Field(ge=1)
    runs: int = Field(ge=1)
    requests: int = Field(ge=0, description="requests sent, over all runs")
    completed: int = Field(ge=0)
    failed: int = Field(ge=0)
    request_throughput: float = Field(ge=0, description="requests/s")
    output_throughput: float = Field(ge=0, description="output tokens/s")
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    goodput: float | None = Field(default=None, ge=0, description="requests/s meeting every SLO target; null without targets")
    good_fraction: float | None = Field(default=None, ge=0, le=1, description="good requests / completed requests, all runs pooled")


class ModelFigures(StrictModel):
    role: Role
    model_dir: str
    served_by: Literal["quality gate", "load test"] = Field(description="whose server the load ran against")
    levels: list[LevelFigures]
    kv_capacity_tokens: int | None = Field(default=None, description="vLLM's log: 'KV cache size: N tokens'")
    kv_capacity_tokens_predicted: int | None = Field(default=None, description="pipelines.planner.kv_capacity_tokens for the same KV space")
    kv_max_concurrency: float | None = Field(default=None, description="vLLM's log: maximum concurrency for max_model_len tokens per request")
    peak_memory_bytes: int | None = Field(default=None, description="largest sampled memory of the server's process group")
    memory_method: str | None = None

    def at(self, concurrency: int) -> LevelFigures | None:
        return next((level for level in self.levels if level.concurrency == concurrency), None)


class RatioInterval(StrictModel):
    """candidate / baseline: the geometric mean of the paired runs' ratios and its 95% interval (null with one pair;
    pipelines/loadtest/sequential.py)."""

    estimate: float = Field(gt=0)
    low: float | None = None
    high: float | None = None
    pairs: int = Field(ge=1)


class RunFigures(StrictModel):
    output_throughput: float = Field(description="output tokens/s")
    p95_ttft_ms: float
    p50_tpot_ms: float = Field(default=0.0, description="median time per output token after the first: decode speed")
    duration_s: float


class ComparisonPair(StrictModel):
    index: int
    first: Role
    baseline: RunFigures
    candidate: RunFigures
    throughput_ratio: float
    ttft_p95_ratio: float | None


class SpeedConclusion(StrictModel):
    metric: str
    interval: RatioInterval | None
    outcome: Outcome


class SpeedComparison(StrictModel):
    """gate.json's `performance.comparison`: what the paired comparison measured and concluded."""

    concurrency: int
    requests_per_run: int
    warmup_rates: dict[str, float] = Field(description="requests/s of each model's warm-up run (what sized the runs)")
    pairs: list[ComparisonPair]
    throughput: SpeedConclusion
    ttft_p95: SpeedConclusion
    tpot_p50: SpeedConclusion | None = Field(default=None, description="median time per output token: the decode steps' speed "
                                             "alone, steadier than throughput where the server's scheduling stalls vary")
    stopped: Stop = Field(description="precise: the interval reached the margin; budget: the next pair would overrun budget_s; max_pairs")
    seconds: float = Field(description="the comparison's wall time, warm-ups included")
    settings: ComparisonSettings
    order_seed: int
    method: str


class MemoryGain(StrictModel):
    """What the candidate saves in memory, always reported: weights on disk and the KV cache vLLM measured."""

    baseline_weight_bytes: int | None
    candidate_weight_bytes: int | None
    baseline_kv_tokens: int | None
    candidate_kv_tokens: int | None

    @property
    def weight_ratio(self) -> float | None:
        if not self.baseline_weight_bytes or self.candidate_weight_bytes is None:
            return None
        return self.candidate_weight_bytes / self.baseline_weight_bytes


class LevelRatio(StrictModel):
    concurrency: int
    throughput: RatioInterval | None = Field(description="output tokens/s, candidate / baseline")
    ttft_p95: RatioInterval | None = Field(description="p95 time to first token, candidate / baseline")


class Tuning(StrictModel):
    """The largest concurrency that met the SLOs in the sweep, next to what the planner recommends."""

    measured_max_num_seqs: int | None = Field(description="largest level whose good fraction met min_good_fraction (null: none did)")
    swept_up_to: int
    limited_by: str | None = Field(default=None, description="why the sweep stopped where it did")
    planner_max_num_seqs: int | None = None
    planner_gpu_memory_utilization: float | None = None
    gpu_memory_utilization: float | None = Field(default=None, description="what to deploy with (see `basis`)")
    basis: str = ""
    vllm_args: str | None = None


class Check(StrictModel):
    """A policy limit read on the measurement: a ratio's on its whole interval (inconclusive when the limit lies inside)."""

    name: Literal["throughput_ratio", "ttft_p95_ratio", "slo_good_fraction", "errors"]
    value: float
    limit: float
    status: CheckStatus
    text: str

    @model_validator(mode="before")
    @classmethod
    def _from_passed(cls, data: Any) -> Any:
        """gate.json written before checks had a status held `passed` alone (read back by the registry, watch, repair)."""
        if isinstance(data, dict) and "passed" in data:
            data = dict(data)
            passed = data.pop("passed")
            data.setdefault("status", "passed" if passed else "failed")
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def passed(self) -> bool:
        return self.status == "passed"


class PerformanceSummary(StrictModel):
    """The headline a run's outcome, a job's result and its ledger carry (gate.json's `performance` has it all)."""

    enforced: bool
    passed: bool = Field(description="every check passed on its interval (never true for an inconclusive ratio)")
    target: str
    deployment_concurrency: int
    throughput_ratio: float | None
    throughput_interval: list[float] | None = Field(default=None, description="[low, high] of the throughput ratio, 95%")
    speed: Outcome | None = Field(default=None, description="the paired comparison's conclusion on throughput (null: no candidate)")
    pairs: int | None = None
    ttft_p95_ratio: float | None
    measured_max_num_seqs: int | None
    buys: str | None = Field(default=None, description="what the candidate buys on the serving host, in words")


class PerformanceReport(StrictModel):
    tool: dict[str, str]
    target: str = Field(description="the serve target the load ran on: cpu, or cuda:MAJOR.MINOR")
    enforced: bool
    enforcement: str = Field(description="which applied and why, in words")
    policy: PerformancePolicy
    workload: dict
    levels: list[int]
    deployment_concurrency: int
    models: list[ModelFigures]
    ratios: list[LevelRatio] = Field(default_factory=list)
    interval_method: str
    tuning: Tuning | None = None
    checks: list[Check] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list, description="failed checks when enforced (they reject the candidate)")
    warnings: list[str] = Field(default_factory=list)
    plots: dict[str, str] = Field(default_factory=dict, description="PNG files in the run folder")
    wall_s: float = 0.0
    probed: ProbedSpeed | None = Field(default=None, description="the kernel probe's ratios for the candidate's slowest scheme on "
                                                                 "this host class (docs/hardware.md), beside the measured ratios")
    comparison: SpeedComparison | None = Field(default=None, description="the paired comparison at the deployment's concurrency")
    memory: MemoryGain | None = None
    predicted: WorkloadPrediction | None = Field(default=None, description="the shape probe's prediction for the comparison's "
                                                 "workload, from its cache (quantize doctor --model fills it; docs/hardware.md)")
    buys: str | None = Field(default=None, description="what the candidate buys on the serving host: memory always, speed where concluded")

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def figures(self, role: Role) -> ModelFigures | None:
        return next((model for model in self.models if model.role == role), None)
