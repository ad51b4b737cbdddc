"""The plan: for each recipe (and 16-bit, and a measured artifact), weights + KV cache + activations +
overhead against a GPU, the largest concurrency and context that fit, vLLM arguments and the predicted decode
speed (the roofline, pipelines/planner/roofline.py).
The formulas, their assumptions and their knobs are in docs/planner.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import ConfigDict, Field, computed_field

from pipelines.artifact import is_model_dir
from pipelines.bounds import MAX_CONCURRENCY, MAX_CONTEXT
from pipelines.errors import InputError
from pipelines.hardware.host import serve_dtype_for
from pipelines.hardware.speed import ProbedSpeed
from pipelines.hardware.targets import CPU, ServeTarget, installed_target, kv_cache_problem, parse_target
from pipelines.planner.gpus import GiB, GpuSpec
from pipelines.planner.kv import (
    CPU_BATCHES_IN_FLIGHT,
    CPU_BLOCK_SIZE,
    CUDA_BATCHES_IN_FLIGHT,
    CUDA_BLOCK_SIZE,
    VllmKvCache,
    attention_summary,
    kv_cache_bytes_for_context,
    kv_cache_bytes_per_token,
    kv_element_bytes,
    vllm_kv_cache,
)
from pipelines.planner.roofline import Roofline, roofline, step_cost
from pipelines.planner.shape import ModelShape, load_config, model_shape
from pipelines.planner.weights import WeightBreakdown, predict_weight_bytes, safetensors_bytes, shape_layout
from pipelines.quantize.compiler import SIXTEEN_BIT, cannot_apply
from pipelines.recipe import KvCache, Recipe
from pipelines.schema import StrictModel

MAX_BATCHED_TOKENS = 2**24
MAX_OVERHEAD_GIB = 2**20


class PlanSettings(StrictModel):
    """The estimate's knobs; the defaults and their reasons are in docs/planner.md."""

    overhead_fraction: float = Field(
        default=0.05, ge=0, lt=1, allow_inf_nan=False, description="allocator slack, as a fraction of weights + KV + activations",
    )
    fixed_overhead_bytes: int = Field(
        default=1 * GiB, ge=0, le=MAX_OVERHEAD_GIB * GiB, description="CUDA context, cuBLAS/NCCL workspaces, CUDA graphs",
    )
    max_num_batched_tokens: int = Field(default=8192, gt=0, le=MAX_BATCHED_TOKENS, description="tokens in vLLM's profiling forward pass")
    activation_dtype_bytes: int = Field(default=2, gt=0)
    logits_buffers: int = Field(default=2, gt=0, description="float32 [max_num_seqs, vocab] buffers in the sampler")
    min_gpu_memory_utilization: float = Field(default=0.90, gt=0, le=1, allow_inf_nan=False, description="never recommend less than vLLM's default")
    max_gpu_memory_utilization: float = Field(default=0.95, gt=0, le=1, allow_inf_nan=False, description="the share of device memory a plan may use")
    kv_space_bytes: int | None = Field(
        default=None, gt=0, le=MAX_OVERHEAD_GIB * GiB, description="KV space vLLM is given (VLLM_CPU_KVCACHE_SPACE, --kv-cache-memory-bytes) for the "
        "predicted vLLM KV capacity; default: what a row leaves of the device at its recommended utilization",
    )

    def available_bytes(self, gpu: GpuSpec) -> int:
        return int(gpu.memory_bytes * self.max_gpu_memory_utilization)


class RecommendedArgs(StrictModel):
    # Read back from gate.json, its JSON carries the computed vllm_args too: that key is not an input.
    model_config = ConfigDict(extra="ignore")

    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str | None = None

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented pattern
    @property
    def vllm_args(self) -> str:
        args = (
            f"--gpu-memory-utilization {self.gpu_memory_utilization:.2f} --max-model-len {self.max_model_len} "
            f"--max-num-seqs {self.max_num_seqs} --max-num-batched-tokens {self.max_num_batched_tokens}"
        )
        return args + (f" --kv-cache-dtype {self.kv_cache_dtype}" if self.kv_cache_dtype else "")


class PlanRow(StrictModel):
    scheme: str
    does_not_apply: str | None = Field(
        default=None, description="why the recipe cannot quantize this model (the compiler's refusal); then fits is false",
    )
    weights_source: Literal["measured", "predicted"]
    kv_cache_dtype: str
    weights_bytes: int
    kv_cache_bytes_per_token: int
    kv_cache_bytes: int = Field(description="worst case: max_model_len x concurrency, sliding windows honored")
    activation_bytes: int
    overhead_bytes: int
    total_bytes: int
    available_bytes: int
    fits: bool
    max_concurrency: int = Field(description="at max_model_len")
    max_context: int = Field(description="at the given concurrency, capped at the model's max_position_embeddings")
    recommended: RecommendedArgs | None
    decode_tokens_per_s: float | None = Field(
        description="predicted (roofline, an upper bound): one stream at max_model_len; None without a bandwidth",
    )
    roofline: Roofline | None = Field(
        default=None, description="predicted decode speed at 1 and at the plan's concurrency, with the kernel; None without a "
        "bandwidth or where the recipe does not apply",
    )
    vllm_kv_tokens: int | None = Field(
        default=None, description="the 'KV cache size: N tokens' vLLM will log with the recommended arguments "
        "(its hybrid allocator's groups and blocks, docs/planner.md); None when nothing is recommended",
    )
    vllm_kv_layout: str | None = Field(default=None, description="how vLLM cuts that KV space: groups, blocks, blocks per request")


class Plan(StrictModel):
    model: str
    config: str
    gpu: GpuSpec
    max_model_len: int
    concurrency: int
    settings: PlanSettings
    rows: list[PlanRow]
    target: str | None = Field(default=None, description="the serve target whose kernels the recipes were checked against")
    probed: dict[str, ProbedSpeed] = Field(
        default_factory=dict, description="per recipe: the kernel probe's ratios on this host (docs/hardware.md); when the "
                                          "recipes were checked against this host's own class")
    attention: str = Field(default="", description="which layers slide, e.g. '15 sliding (window 512) + 3 full'")

    def fit_row(self) -> PlanRow:
        """The row a fit requirement is judged by: the artifact's measured row when the plan has one, else
        its first."""
        return next((row for row in self.rows if row.weights_source == "measured"), self.rows[0])


class _Scheme(NamedTuple):
    label: str
    weights: WeightBreakdown
    source: Literal["measured", "predicted"]
    kv_dtype: str
    kv_bytes: int
    does_not_apply: str | None = None
    recipe: Recipe | None = None


class _Memory(NamedTuple):
    weights: int
    kv: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.overhead


def activation_bytes(shape: ModelShape, settings: PlanSettings, max_num_seqs: int) -> int:
    """Peak transient memory of vLLM's profiling run: max_num_batched_tokens tokens through one layer
    (residual + hidden + gate/up + activated: 2 x hidden + 3 x intermediate values per token), plus the
    sampler's float32 logits buffers for max_num_seqs sequences."""
    per_token = 2 * shape.hidden + 3 * shape.active_intermediate
    forward = settings.max_num_batched_tokens * per_token * settings.activation_dtype_bytes
    return forward + settings.logits_buffers * max_num_seqs * shape.vocab * 4


def _memory(shape: ModelShape, scheme: _Scheme, settings: PlanSettings, context: int, concurrency: int) -> _Memory:
    kv = concurrency * kv_cache_bytes_for_context(shape, scheme.kv_bytes, context)
    activations = activation_bytes(shape, settings, concurrency)
    planned = scheme.weights.total_bytes + kv + activations
    overhead = settings.fixed_overhead_bytes + math.ceil(settings.overhead_fraction * planned)
    return _Memory(scheme.weights.total_bytes, kv, activations, overhead)


def _largest(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, limit] with fits(n), for a fits() that turns false and stays false; 0 if none."""
    if limit < 1 or not fits(1):
        return 0
    good, step = 1, 1
    while good + step <= limit and fits(good + step):
        good, step = good + step, step * 2
    bad = min(good + step, limit + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _row(
    shape: ModelShape, scheme: _Scheme, gpu: GpuSpec, settings: PlanSettings, context: int, concurrency: int,
    target: ServeTarget | None,
) -> PlanRow:
    available = settings.available_bytes(gpu)

    def fits(ctx: int, seqs: int) -> bool:
        return _memory(shape, scheme, settings, ctx, seqs).total <= available

    memory = _memory(shape, scheme, settings, context, concurrency)
    context_limit = shape.max_position or 2**31 - 1
    max_concurrency = _largest(lambda seqs: fits(context, seqs), MAX_CONCURRENCY)
    max_context = _largest(lambda ctx: fits(ctx, concurrency), context_limit)
    applies = scheme.does_not_apply is None
    recommended = _recommend(shape, scheme, gpu, settings, context, concurrency, max_concurrency, fits) if applies else None
    vllm_kv = _vllm_kv(shape, scheme, gpu, settings, recommended, target)
    speed = _roofline(shape, scheme, gpu, context, concurrency, target)
    return PlanRow(
        scheme=scheme.label,
        does_not_apply=scheme.does_not_apply,
        weights_source=scheme.source,
        kv_cache_dtype=scheme.kv_dtype,
        weights_bytes=memory.weights,
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(shape, scheme.kv_bytes),
        kv_cache_bytes=memory.kv,
        activation_bytes=memory.activations,
        overhead_bytes=memory.overhead,
        total_bytes=memory.total,
        available_bytes=available,
        fits=applies and memory.total <= available,
        max_concurrency=max_concurrency,
        max_context=max_context,
        recommended=recommended,
        decode_tokens_per_s=speed.points[0].tokens_per_s if speed else None,
        roofline=speed if applies else None,
        vllm_kv_tokens=vllm_kv.tokens if vllm_kv else None,
        vllm_kv_layout=vllm_kv.describe() if vllm_kv else None,
    )


def _vllm_kv(
    shape: ModelShape, scheme: _Scheme, gpu: GpuSpec, settings: PlanSettings, advice: RecommendedArgs | None,
    target: ServeTarget | None,
) -> VllmKvCache | None:
    """The KV cache vLLM will allocate when started with `advice` (None without advice): its KV space (settings.kv_space_bytes, else the
    device memory at the recommended utilization less weights, activations and the non-KV overhead) cut into the
    target's blocks (CPU 128 tokens, CUDA 16) and groups as pipelines.planner.kv.vllm_kv_cache does."""
    if advice is None:
        return None
    space = settings.kv_space_bytes
    if space is None:
        weights = scheme.weights.total_bytes
        activations = activation_bytes(shape, settings, advice.max_num_seqs)
        overhead = settings.fixed_overhead_bytes + math.ceil(settings.overhead_fraction * (weights + activations))
        space = int(gpu.memory_bytes * advice.gpu_memory_utilization) - weights - activations - overhead
    if space <= 0:
        return None
    cpu = target is not None and target.kind == "cpu"
    return vllm_kv_cache(
        shape, scheme.kv_bytes, space, block_size=CPU_BLOCK_SIZE if cpu else CUDA_BLOCK_SIZE,
        max_model_len=advice.max_model_len,
        in_flight_tokens=advice.max_num_batched_tokens * (CPU_BATCHES_IN_FLIGHT if cpu else CUDA_BATCHES_IN_FLIGHT),
    )


def _recommend(
    shape: ModelShape, scheme: _Scheme, gpu: GpuSpec, settings: PlanSettings,
    context: int, concurrency: int, max_concurrency: int, fits: Callable[[int, int], bool],
) -> RecommendedArgs | None:
    """vLLM arguments for the request, or the nearest that fits: fewer sequences first, then a shorter context."""
    if max_concurrency >= 1:
        context, seqs = context, min(concurrency, max_concurrency)
    else:
        longest = _largest(lambda ctx: fits(ctx, 1), context)
        if longest < 1:
            return None
        context, seqs = (longest // 256 * 256 or longest), 1
    needed = math.ceil(_memory(shape, scheme, settings, context, seqs).total / gpu.memory_bytes * 100 - 1e-9) / 100
    utilization = min(settings.max_gpu_memory_utilization, max(settings.min_gpu_memory_utilization, needed))
    return RecommendedArgs(
        gpu_memory_utilization=utilization, max_model_len=context, max_num_seqs=seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_dtype=None if scheme.kv_dtype == "auto" else scheme.kv_dtype,
    )


def _roofline(
    shape: ModelShape, scheme: _Scheme, gpu: GpuSpec, context: int, concurrency: int, target: ServeTarget | None,
) -> Roofline | None:
    """The predicted decode speed at one sequence and at `concurrency`, on the kernels the target's written rules select
    (without a target: the GPU's compute capability, else unnamed 16-bit GEMMs)."""
    device_target = target or (parse_target(f"cuda:{gpu.compute_capability}") if gpu.compute_capability else None)
    known = scheme.source == "predicted" or scheme.label == SIXTEEN_BIT
    cost = step_cost(shape, scheme.recipe, scheme.weights, scheme.kv_bytes, context, device_target, scheme_known=known)
    return roofline(cost, gpu, context, (1, concurrency))


def _schemes(
    shape: ModelShape, recipes: list[Recipe | None], artifact_dir: Path | None, kv_cache_dtypes: list[str], target: ServeTarget,
) -> list[_Scheme]:
    """One scheme per recipe (None: 16-bit) and KV cache precision, predicted: a recipe's own `kv_cache` wins over
    the asked ones (one row); an artifact's measured bytes replace the 16-bit row when the artifact is unquantized,
    otherwise the artifact gets its own row."""
    schemes = [
        _recipe_scheme(shape, recipe, kv_cache_dtype, target)
        for kv_cache_dtype in kv_cache_dtypes
        for recipe in recipes
        if kv_cache_dtype == kv_cache_dtypes[0] or recipe is None or recipe.kv_cache.dtype == "auto"
    ]
    if artifact_dir is None:
        return schemes
    artifact_shape = model_shape(*load_config(artifact_dir)) if is_model_dir(artifact_dir) else shape
    predicted = predict_weight_bytes(shape, None)
    measured = predicted.model_copy(update={"total_bytes": safetensors_bytes(Path(artifact_dir))})
    kv_dtype, kv_bytes = kv_element_bytes(artifact_shape, kv_cache_dtypes[0], serve_dtype_for(str(target))[0])
    label = Path(artifact_dir).name if artifact_shape.quantized else SIXTEEN_BIT
    row = _Scheme(label, measured, "measured", kv_dtype, kv_bytes)
    if label == SIXTEEN_BIT and any(s.label == SIXTEEN_BIT for s in schemes):
        return [row if s.label == SIXTEEN_BIT else s for s in schemes]
    return [*schemes, row]


def _recipe_scheme(shape: ModelShape, recipe: Recipe | None, kv_cache_dtype: str, target: ServeTarget) -> _Scheme:
    """One row's scheme: the recipe's weights (None: 16-bit) with its own KV precision, else `kv_cache_dtype`; labelled
    `w8a8`, or `w8a8 + kv fp8` where the KV precision is asked for, not the recipe's."""
    own = recipe is not None and recipe.kv_cache.dtype != "auto"
    kv = recipe.kv_cache if recipe is not None and own else KvCache(dtype=kv_cache_dtype)
    kv_dtype, kv_bytes = kv_element_bytes(shape, kv.vllm_dtype, serve_dtype_for(str(target))[0])  # auto: what the target serves
    label = recipe.name if recipe else SIXTEEN_BIT
    if not own and kv.dtype != "auto":
        label += f" + kv {kv.dtype}"
    problem = recipe_problem(shape, recipe, target) if recipe else None
    if problem is None and not own and kv.dtype != "auto":
        found = kv_cache_problem(kv, target, shape.head_dim)
        problem = f"kv_cache.{found.field}: {found.why}" if found else None
    return _Scheme(label, predict_weight_bytes(shape, recipe), "predicted", kv_dtype, kv_bytes, problem, recipe)


def recipe_problem(shape: ModelShape, recipe: Recipe, target: ServeTarget | None = None) -> str | None:
    """Why `recipe` cannot quantize this model for `target` (the compiler's own checks: group sizes, vLLM's
    kernels and shapes, fused shards, overrides that select nothing), or None when it applies."""
    return cannot_apply(recipe, shape_layout(shape), f"recipe {recipe.name}", target)


def gpu_target(gpu: GpuSpec) -> ServeTarget:
    """The target whose kernel rules a plan for `gpu` checks recipes against: the GPU's own compute
    capability when the table knows it, else the installed serve environment's."""
    return parse_target(f"cuda:{gpu.compute_capability}") if gpu.compute_capability else installed_target()


def plan(
    config: dict | Path,
    recipes: list[Recipe | None],
    gpu: GpuSpec,
    max_model_len: int,
    concurrency: int,
    artifact_dir: Path | None = None,
    *,
    settings: PlanSettings | None = None,
    kv_cache_dtype: str | list[str] = "auto",
    target: ServeTarget | None = None,
) -> Plan:
    """The memory plan: one row per recipe (None for 16-bit) and KV cache precision (`kv_cache_dtype`, one or more of
    vLLM's --kv-cache-dtype values), plus the artifact's measured row if given. Recipes and KV precisions are checked
    against `target`'s kernels (default: gpu_target)."""
    settings = settings or PlanSettings()
    data, source = load_config(config)
    shape = model_shape(data, source)
    _check_sizes(shape, max_model_len, concurrency, source)
    if not recipes and artifact_dir is None:
        raise InputError("nothing to plan: give a recipe, None for 16-bit, or an artifact", field="recipes")
    kv_cache_dtypes = list(dict.fromkeys([kv_cache_dtype] if isinstance(kv_cache_dtype, str) else kv_cache_dtype)) or ["auto"]
    target = target or (gpu_target(gpu) if any(recipes) or kv_cache_dtypes != ["auto"] else None)
    rows = [
        _row(shape, scheme, gpu, settings, max_model_len, concurrency, target)
        for scheme in _schemes(shape, recipes, artifact_dir, kv_cache_dtypes, target or CPU)
    ]
    return Plan(
        model=shape.name, config=source, gpu=gpu, max_model_len=max_model_len,
        concurrency=concurrency, settings=settings, rows=rows, target=str(target) if target else None,
        attention=attention_summary(shape.windows),
    )


def _check_sizes(shape: ModelShape, max_model_len: int, concurrency: int, source: str) -> None:
    for field, value, most in (("max_model_len", max_model_len, MAX_CONTEXT), ("concurrency", concurrency, MAX_CONCURRENCY)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"must be a positive integer (got {value!r})", field=field)
        if value > most:
            raise InputError(f"must be at most {most} (got {value})", field=field)
    if shape.max_position is not None and max_model_len > shape.max_position:
        raise InputError(
            f"{max_model_len} is longer than the model's max_position_embeddings ({shape.max_position}) in {source}",
            field="max_model_len",
        )
