"""The policy's `performance:` block: what the load test measures and how its figures are judged.

    performance:
      enabled: true            # run the load test after a promoted quality gate (--no-loadtest turns it off)
      enforce: auto            # auto: enforced on a GPU target, report-only on a CPU target; always (true); never (false)
      min_throughput_ratio: 0.9
      max_ttft_p95_ratio: 1.25
      slo: {ttft_ms: 2000, tpot_ms: 200, min_good_fraction: 0.9}
      load: {repeats: 1, min_requests: 8, requests_per_slot: 2, max_concurrency: null, output_tokens: baseline}
      comparison: {budget_s: 30, min_run_s: 2, min_run_requests: 32, min_pairs: 4, max_pairs: 30, margin: 0.1}
      production: {max_error_rate: 0.01, max_kv_cache_usage: 0.95, max_preemptions: 0, envelope_tolerance: 1.5}

`production` is what a deployed version is held to afterwards (`quantize watch`, the alert rules of `quantize deploy`):
ttft_p95_ms / itl_p95_ms default to slo.ttft_ms / slo.tpot_ms, max_waiting to the measured max_num_seqs (docs/watch.md).

A recipe override (`recipes: {w4a16: {performance: {...}}}`) names only what it changes, nested blocks
included; setting a threshold to null turns that check off. Values that no measurement can meet by
construction (zero, negative, not finite) are refused when the policy is loaded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PlainValidator, ValidationInfo, field_validator, model_validator

from pipelines.schema import FrozenModel

MAX_RATIO = 1e6
MAX_MS = 1e9
MAX_LEVEL = 4096  # concurrency of a sweep: far above any one server's max_num_seqs
MAX_REQUESTS = 100_000
# Every request of one sweep together (both models, warm-ups included): what its workload files hold at most,
# about 30 MB of JSONL, and hours of serving on a GPU. A plan past it is refused before anything is written.
MAX_PLANNED_REQUESTS = 200_000

Ratio = Annotated[float, Field(gt=0, le=MAX_RATIO, allow_inf_nan=False)]
Milliseconds = Annotated[float, Field(gt=0, le=MAX_MS, allow_inf_nan=False)]
GoodFraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
MAX_OUTPUT_TOKENS = 1_000_000
MAX_BUDGET_S = 86_400.0


def _enforce(value: object) -> str:
    """`auto`, `always`, `never`; YAML's true and false are `always` and `never` (`enforce: true` requires speed)."""
    if value is True or value is False:
        return "always" if value else "never"
    if value in ("auto", "always", "never"):
        return str(value)
    raise ValueError(f"must be auto, always (true) or never (false) (got {value!r})")


Enforce = Annotated[Literal["auto", "always", "never"], PlainValidator(_enforce)]


def _output_tokens(value: object) -> str | int:
    if value == "baseline":
        return "baseline"
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise ValueError(f"must be `baseline` or a whole number of tokens from 1 to {MAX_OUTPUT_TOKENS} (got {value!r})")
    return value


OutputTokens = Annotated[str | int, PlainValidator(_output_tokens)]


class SloTargets(FrozenModel):
    """A request is good when it meets every target set (vLLM's goodput, DistServe's definition)."""

    ttft_ms: Milliseconds | None = Field(default=2000.0, description="time to first token, per request")
    tpot_ms: Milliseconds | None = Field(default=200.0, description="time per output token after the first, per request")
    min_good_fraction: GoodFraction = Field(
        default=0.9, description="share of requests that must meet the targets at the deployment's concurrency",
    )

    @property
    def goodput_arguments(self) -> list[str]:
        """vLLM bench serve's `--goodput KEY:VALUE ...` pairs (empty: no target set)."""
        pairs = [("ttft", self.ttft_ms), ("tpot", self.tpot_ms)]
        return [f"{key}:{value:g}" for key, value in pairs if value is not None]


class LoadSettings(FrozenModel):
    """The sweep: concurrency 1, 2, 4, ... up to the deployment's, each level run `repeats` times per model."""

    repeats: int = Field(default=1, ge=1, le=50, description="runs per model and level below the top (the top level is the "
                                                            "paired comparison's: performance.comparison)")
    min_requests: int = Field(default=8, ge=1, le=MAX_REQUESTS, description="requests per run at the lowest levels")
    requests_per_slot: int = Field(default=2, ge=1, le=1000, description="requests per run = max(min_requests, this x concurrency)")
    max_concurrency: int | None = Field(
        default=None, ge=1, le=MAX_LEVEL,
        description="top of the sweep; default: the policy's fit concurrency, else the server's max_num_seqs",
    )
    output_tokens: OutputTokens = Field(
        default="baseline", description="`baseline`: each prompt's length of the baseline's own greedy answer; or a fixed count",
    )
    timeout_s: float = Field(default=1800.0, gt=0, le=86_400, allow_inf_nan=False, description="the whole sweep's time limit")

    def requests_at(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_slot * concurrency)

    def planned_requests(self, top: int, models: int = 2) -> int:
        """The requests a sweep up to `top` sends: per model a warm-up and every level `repeats` times (bench.plan_runs)."""
        return models * (self.requests_at(1) + self.repeats * sum(self.requests_at(level) for level in sweep_levels(top)))

    def plan_problem(self, top: int, models: int = 2) -> str | None:
        """Why a sweep up to `top` is refused (None: it is not): more than MAX_PLANNED_REQUESTS requests."""
        planned = self.planned_requests(top, models)
        if planned <= MAX_PLANNED_REQUESTS:
            return None
        return (f"a sweep up to concurrency {top} with {self.repeats} repeats, min_requests {self.min_requests} and requests_per_slot "
                f"{self.requests_per_slot} sends {planned} requests over {models} model(s); at most {MAX_PLANNED_REQUESTS}")

    @model_validator(mode="after")
    def _bounded_plan(self) -> LoadSettings:
        problem = self.plan_problem(self.max_concurrency) if self.max_concurrency is not None else None
        if problem:
            raise ValueError(problem)
        return self


class ComparisonSettings(FrozenModel):
    """The paired, interleaved comparison at the deployment's concurrency (pipelines/loadtest/comparison.py): a warm-up
    per model, then pairs of runs (one per model, the order drawn per pair) until the throughput ratio's 95% interval is
    within `margin` of its estimate, or the budget or max_pairs runs out."""

    min_run_s: float = Field(default=2.0, gt=0, le=3600, allow_inf_nan=False,
                             description="each measured run lasts at least this long on the faster model (steady state, not a burst)")
    min_run_requests: int = Field(default=32, ge=1, le=MAX_REQUESTS, description="and sends at least this many requests (and 8 x concurrency)")
    min_pairs: int = Field(default=4, ge=2, le=1000, description="pairs before the interval may stop the comparison")
    max_pairs: int = Field(default=30, ge=2, le=1000, description="pairs at most")
    margin: float = Field(default=0.10, gt=0, lt=1, allow_inf_nan=False,
                          description="stop when the interval is within this of its estimate; `no difference` inside 1 +- this")
    budget_s: float = Field(default=30.0, gt=0, le=MAX_BUDGET_S, allow_inf_nan=False,
                            description="seconds the comparison may take, warm-ups included; what it has not concluded by then is inconclusive")

    @field_validator("max_pairs")
    @classmethod
    def _at_least_min_pairs(cls, value: int, info: ValidationInfo) -> int:
        floor = info.data.get("min_pairs")
        if floor is not None and value < floor:
            raise ValueError(f"max_pairs {value} is below min_pairs {floor}")
        return value

    @field_validator("budget_s")
    @classmethod
    def _feasible(cls, value: float, info: ValidationInfo) -> float:
        run_s, pairs = info.data.get("min_run_s"), info.data.get("min_pairs")
        if run_s is not None and pairs is not None and value < minimum_budget(run_s, pairs):
            raise ValueError(f"{value:g} s is too small for a warm-up and {pairs} pairs of runs of {run_s:g} s each: at least "
                             f"{minimum_budget(run_s, pairs):g} s")
        return value


def minimum_budget(min_run_s: float, min_pairs: int) -> float:
    """A warm-up run per model and min_pairs pairs of runs, each at least min_run_s: less cannot conclude anything."""
    return 2 * min_run_s * (1 + min_pairs)


def sweep_levels(top: int) -> list[int]:
    """1, 2, 4, ... below `top`, then `top` itself."""
    levels, level = [], 1
    while level < top:
        levels.append(level)
        level *= 2
    return [*levels, top]


class ProductionSlo(FrozenModel):
    """What production is held to (`quantize watch`, the alert rules `quantize deploy` writes), beside the envelope the load
    test measured: a figure breaches when it passes the tighter of its SLO here and the load test's own figure x
    `envelope_tolerance` (docs/watch.md)."""

    ttft_p95_ms: Milliseconds | None = Field(default=None, description="p95 time to first token over a window; default: slo.ttft_ms")
    itl_p95_ms: Milliseconds | None = Field(default=None, description="p95 inter-token latency over a window; default: slo.tpot_ms")
    max_error_rate: float = Field(default=0.01, ge=0, le=1, allow_inf_nan=False,
                                  description="requests that ended in an error or an abort, or answered HTTP 5xx, over those finished")
    max_kv_cache_usage: float = Field(default=0.95, gt=0, le=1, allow_inf_nan=False, description="the KV cache's peak use over a window")
    max_preemptions: int = Field(default=0, ge=0, le=10**9, description="sequences preempted (KV cache full) in a window")
    max_waiting: int | None = Field(default=None, ge=0, le=10**9,
                                    description="requests waiting for a slot, p95 over a window; default: the measured max_num_seqs")
    envelope_tolerance: float = Field(default=1.5, ge=1, le=MAX_RATIO, allow_inf_nan=False,
                                      description="latency and memory may pass the load test's own figure by this factor")
    e2e_p95_ms: Milliseconds | None = Field(default=None, description="p95 end-to-end request latency over a window; default: none "
                                                                      "(the load test measures no end-to-end figure to derive one from)")
    latency_slo_target: float = Field(default=0.95, gt=0, lt=1, allow_inf_nan=False,
                                      description="share of requests (ITL: of token gaps) within each latency limit that the deployed "
                                                  "burn-rate alerts hold; 0.95 is what a p95 limit means")


class PerformancePolicy(FrozenModel):
    enabled: bool = True
    enforce: Enforce = "auto"
    min_throughput_ratio: Ratio | None = Field(
        default=0.9, description="candidate / baseline output tokens per second at the deployment's concurrency, at least",
    )
    max_ttft_p95_ratio: Ratio | None = Field(
        default=1.25, description="candidate / baseline p95 time to first token at the deployment's concurrency, at most",
    )
    slo: SloTargets = SloTargets()
    load: LoadSettings = LoadSettings()
    comparison: ComparisonSettings = ComparisonSettings()
    production: ProductionSlo = ProductionSlo()

    def merged(self, override: PerformanceOverrides | None) -> PerformancePolicy:
        """This block with an override's explicit fields on top (nested blocks merged field by field)."""
        if override is None:
            return self
        values = self.model_dump()
        for key, value in override.explicit().items():
            values[key] = {**values[key], **value} if isinstance(value, dict) else value
        return PerformancePolicy.model_validate(values)


class _Override(FrozenModel):
    """A partial block: fields left out are inherited; only thresholds may be set to null (check off)."""

    _NOT_NULL: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _null_only_for_thresholds(self) -> _Override:
        for name in self._NOT_NULL:
            if name in self.model_fields_set and getattr(self, name) is None:
                raise ValueError(f"{name} cannot be null; leave it out to inherit it (only thresholds can be turned off)")
        return self


class SloOverrides(_Override):
    _NOT_NULL = ("min_good_fraction",)

    ttft_ms: Milliseconds | None = None
    tpot_ms: Milliseconds | None = None
    min_good_fraction: GoodFraction | None = None


class LoadOverrides(_Override):
    _NOT_NULL = ("repeats", "min_requests", "requests_per_slot", "output_tokens", "timeout_s")

    repeats: int | None = Field(default=None, ge=1, le=50)
    min_requests: int | None = Field(default=None, ge=1, le=MAX_REQUESTS)
    requests_per_slot: int | None = Field(default=None, ge=1, le=1000)
    max_concurrency: int | None = Field(default=None, ge=1, le=MAX_LEVEL)
    output_tokens: OutputTokens | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=86_400, allow_inf_nan=False)


class ComparisonOverrides(_Override):
    _NOT_NULL = ("budget_s", "min_run_s", "min_run_requests", "min_pairs", "max_pairs", "margin")

    budget_s: float | None = Field(default=None, gt=0, le=MAX_BUDGET_S, allow_inf_nan=False)
    min_run_s: float | None = Field(default=None, gt=0, le=3600, allow_inf_nan=False)
    min_run_requests: int | None = Field(default=None, ge=1, le=MAX_REQUESTS)
    min_pairs: int | None = Field(default=None, ge=2, le=1000)
    max_pairs: int | None = Field(default=None, ge=2, le=1000)
    margin: float | None = Field(default=None, gt=0, lt=1, allow_inf_nan=False)


class ProductionOverrides(_Override):
    _NOT_NULL = ("max_error_rate", "max_kv_cache_usage", "max_preemptions", "envelope_tolerance", "latency_slo_target")

    ttft_p95_ms: Milliseconds | None = None
    itl_p95_ms: Milliseconds | None = None
    max_error_rate: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    max_kv_cache_usage: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    max_preemptions: int | None = Field(default=None, ge=0, le=10**9)
    max_waiting: int | None = Field(default=None, ge=0, le=10**9)
    envelope_tolerance: float | None = Field(default=None, ge=1, le=MAX_RATIO, allow_inf_nan=False)
    e2e_p95_ms: Milliseconds | None = None
    latency_slo_target: float | None = Field(default=None, gt=0, lt=1, allow_inf_nan=False)


class PerformanceOverrides(_Override):
    """Any subset of the block, for one recipe; fields left out are inherited, a threshold set to null is off."""

    _NOT_NULL = ("enabled", "enforce", "slo", "load", "comparison", "production")

    enabled: bool | None = None
    enforce: Enforce | None = None
    min_throughput_ratio: Ratio | None = None
    max_ttft_p95_ratio: Ratio | None = None
    slo: SloOverrides | None = None
    load: LoadOverrides | None = None
    comparison: ComparisonOverrides | None = None
    production: ProductionOverrides | None = None

    def explicit(self) -> dict[str, Any]:
        """The fields this override names (explicit nulls included), nested blocks as their own explicit fields."""
        named: dict[str, Any] = {}
        for name in self.model_fields_set:
            value = getattr(self, name)
            named[name] = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
        return named
