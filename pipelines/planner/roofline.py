"""The decode roofline: the fastest a scheme can decode on a device, predicted from bytes and FLOPs alone.

One decode step of `batch` sequences reads the weights once (less what a step skips: the input embedding table, MoE
experts not routed to) and every sequence's KV cache at the context, and does 2 x (multiply-accumulates) FLOPs per
sequence: every decoder Linear in the dtype its kernel computes in (pipelines/hardware/kernel_choice.py), the lm_head
and attention (QK^T and PV over the context, sliding windows honoured) in 16-bit.

    step time = max(bytes / bandwidth, sum over compute dtypes of FLOPs / peak)    tokens/s = batch / step time

It ignores kernel efficiency, launch overheads, the sampler and scheduling: an upper bound on speed, labelled
"predicted" wherever it is shown. docs/planner.md has the formulas and their calibration on a CPU host.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, NamedTuple

from pydantic import Field

from pipelines.hardware.kernel_choice import ComputeDtype, KernelChoice, selected_kernel
from pipelines.hardware.targets import Layer, ServeTarget
from pipelines.planner.gpus import GpuSpec
from pipelines.planner.kv import kv_cache_bytes_for_context
from pipelines.planner.shape import ModelShape
from pipelines.planner.weights import WeightBreakdown, decoder_linears
from pipelines.quantize.compiler import scheme_for
from pipelines.recipe import GroupScheme, Recipe
from pipelines.schema import StrictModel

PREDICTED: Literal["predicted"] = "predicted"
BASIS = "roofline: max(bytes read / memory bandwidth, FLOPs / peak) per decode step; an upper bound on speed, not a measurement"
UNKNOWN_KERNEL = "not read from a measured artifact (compute term left out)"


class RooflinePoint(StrictModel):
    batch: int = Field(gt=0, description="sequences decoding together, one token each per step")
    bytes_per_step: int = Field(description="weights read once + every sequence's KV cache at the context")
    flops_per_step: dict[ComputeDtype, int]
    memory_s: float = Field(description="bytes_per_step / bandwidth")
    compute_s: float | None = Field(description="sum of FLOPs / peak per dtype; None where a dtype's peak is unknown")
    step_s: float
    tokens_per_s: float = Field(description="batch / step_s: every sequence together")
    bound: Literal["memory", "compute"]


class Roofline(StrictModel):
    source: Literal["predicted"] = PREDICTED
    basis: str = BASIS
    kernel: str = Field(description="the Linear kernel(s) vLLM's written rules select for the scheme on the target")
    context: int = Field(description="tokens of KV each sequence reads per step")
    points: list[RooflinePoint]

    def at(self, batch: int) -> RooflinePoint:
        return next(point for point in self.points if point.batch == batch)


class StepCost(NamedTuple):
    """What one decode step costs, split into the part paid once per step and the part paid per sequence."""

    weight_bytes: int
    kv_bytes_per_sequence: int
    flops_per_sequence: dict[ComputeDtype, int]
    kernel: str


def _concrete(scheme: GroupScheme | None, in_features: int) -> GroupScheme | None:
    return scheme.model_copy(update={"weights": scheme.weights.for_layer(in_features)}) if scheme else None


def linear_flops(shape: ModelShape, recipe: Recipe | None, target: ServeTarget | None) -> tuple[dict[ComputeDtype, int], list[str]]:
    """FLOPs one token spends in the decoder Linears by compute dtype, and the kernels they run on (in order)."""
    flops: dict[ComputeDtype, int] = {}
    kernels: dict[str, None] = {}
    for layer in range(shape.layers):
        for linear in decoder_linears(shape, layer):
            scheme = _concrete(scheme_for(recipe, linear, shape.layers) if recipe else None, linear.inp)
            choice = selected_kernel(scheme, target, Layer(linear.name, linear.inp, linear.out)) if target else None
            choice = choice or KernelChoice("unquantized GEMM", "bf16")
            copies = shape.experts_per_token if linear.expert else linear.copies
            flops[choice.compute] = flops.get(choice.compute, 0) + 2 * linear.out * linear.inp * copies
            kernels[choice.name] = None
    return flops, list(kernels)


def step_cost(
    shape: ModelShape, recipe: Recipe | None, weights: WeightBreakdown, kv_element_bytes: int, context: int,
    target: ServeTarget | None, *, scheme_known: bool = True,
) -> StepCost:
    """The bytes and FLOPs of one decode step at `context` tokens of KV per sequence."""
    flops, kernels = linear_flops(shape, recipe, target)
    attended = sum(min(context, window) if window else context for window in shape.windows)
    sixteen = 2 * shape.vocab * shape.hidden + 4 * shape.heads * shape.head_dim * attended  # lm_head, QK^T and PV
    flops["bf16"] = flops.get("bf16", 0) + sixteen
    return StepCost(
        weight_bytes=weights.read_per_token(shape),
        kv_bytes_per_sequence=kv_cache_bytes_for_context(shape, kv_element_bytes, context),
        flops_per_sequence=flops,
        kernel=" + ".join(kernels) if scheme_known else UNKNOWN_KERNEL,
    )


def roofline_point(cost: StepCost, device: GpuSpec, batch: int, *, compute_known: bool = True) -> RooflinePoint:
    """The roofline at `batch` sequences; `device` must have a bandwidth."""
    if device.bandwidth_bytes_per_s is None:
        raise ValueError(f"{device.name} has no memory bandwidth: no roofline")
    read = cost.weight_bytes + batch * cost.kv_bytes_per_sequence
    flops = {dtype: batch * count for dtype, count in cost.flops_per_sequence.items()}
    memory_s = read / device.bandwidth_bytes_per_s
    peaks = device.peak_flops_per_s
    known = compute_known and all(dtype in peaks for dtype in flops)
    compute_s = sum(count / peaks[dtype] for dtype, count in flops.items()) if known else None
    step_s = max(memory_s, compute_s or 0.0)
    return RooflinePoint(
        batch=batch, bytes_per_step=read, flops_per_step=flops, memory_s=memory_s, compute_s=compute_s, step_s=step_s,
        tokens_per_s=batch / step_s, bound="compute" if compute_s is not None and compute_s > memory_s else "memory",
    )


def roofline(cost: StepCost, device: GpuSpec, context: int, batches: Iterable[int]) -> Roofline | None:
    """The roofline at each batch size (ascending, once each); None when the device's bandwidth is unknown."""
    if device.bandwidth_bytes_per_s is None:
        return None
    known = cost.kernel != UNKNOWN_KERNEL
    points = [roofline_point(cost, device, batch, compute_known=known) for batch in sorted(set(batches))]
    return Roofline(kernel=cost.kernel, context=context, points=points)
