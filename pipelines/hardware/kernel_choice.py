"""Which Linear kernel vLLM 0.32 selects for a scheme on a serve target, by the written rules of
pipelines/hardware/targets.py (whose docstring cites the vLLM sources they are read from), and the dtype its
multiply-accumulates run in: what the planner's roofline (pipelines/planner/roofline.py) divides FLOPs by.

A scheme the written rules refuse on the target has no kernel (None). On CUDA, weight-only int goes to the first
kernel of vLLM's `_POSSIBLE_KERNELS` that can implement it: Machete (compute capability 9.0 only, its group sizes and
shapes), then Marlin (its group sizes), then Triton W4A16 (4-bit group 256); W8A8 int8 to CUTLASS scaled_mm; FP8 with
FP8 activations to CUTLASS (block-wise: CUTLASS block FP8 on 9.0+, DeepGEMM when installed; Triton on 8.9), FP8
weights alone to Marlin FP8. Weight-only kernels dequantize to 16-bit before they multiply: their compute is bf16.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pipelines.hardware.targets import (
    FP8_COMPUTE_CAPABILITY,
    MACHETE_BLOCK,
    MACHETE_CAPABILITY,
    MACHETE_GROUP_SIZES,
    MARLIN_GROUP_SIZES,
    Layer,
    ServeTarget,
    cpu_rules,
    cuda_rules,
)
from pipelines.recipe import GroupScheme, WeightScheme

# The dtype a Linear's multiply-accumulates run in: 16-bit (bf16, or fp16 where the GPU lacks bf16), int8, FP8.
ComputeDtype = Literal["bf16", "int8", "fp8"]


class KernelChoice(NamedTuple):
    name: str
    compute: ComputeDtype


UNQUANTIZED = {
    "cuda": KernelChoice("cuBLAS GEMM (unquantized)", "bf16"),
    "cpu": KernelChoice("oneDNN GEMM (unquantized)", "bf16"),
}


def selected_kernel(scheme: GroupScheme | None, target: ServeTarget, layer: Layer | None = None) -> KernelChoice | None:
    """The kernel vLLM picks for a Linear of `scheme` (None: 16-bit) on `target`, or None where the written rules refuse
    it. A `group_size: auto` must be made concrete first (WeightScheme.for_layer)."""
    if scheme is None:
        return UNQUANTIZED[target.kind]
    if target.kind == "cpu":
        return None if cpu_rules(scheme, target, layer) else _cpu_kernel(scheme)
    return None if cuda_rules(scheme, target, layer) else _cuda_kernel(scheme, target, layer)


def _cuda_kernel(scheme: GroupScheme, target: ServeTarget, layer: Layer | None) -> KernelChoice:
    weights, activations = scheme.weights, scheme.activations
    if weights.type == "float":
        if activations is None or target.sm < FP8_COMPUTE_CAPABILITY:
            return KernelChoice("MarlinFP8 (FP8 weights, 16-bit activations)", "bf16")
        if weights.granularity == "block":
            name = "CUTLASS block FP8 (DeepGEMM where installed)" if target.sm >= MACHETE_CAPABILITY else "Triton block FP8"
            return KernelChoice(name, "fp8")
        return KernelChoice("CutlassFP8ScaledMMLinearKernel", "fp8")
    if activations is not None:
        return KernelChoice("CutlassInt8ScaledMMLinearKernel", "int8")
    if target.sm == MACHETE_CAPABILITY and _machete_fits(weights, layer):
        return KernelChoice("MacheteLinearKernel", "bf16")
    if weights.granularity == "channel" or weights.group_size in MARLIN_GROUP_SIZES:
        return KernelChoice("MarlinLinearKernel", "bf16")
    return KernelChoice("TritonW4A16LinearKernel", "bf16")


def _machete_fits(weights: WeightScheme, layer: Layer | None) -> bool:
    grouped = weights.granularity == "channel" or weights.group_size in MACHETE_GROUP_SIZES
    shaped = layer is None or (layer.in_features % MACHETE_BLOCK[0] == 0 and layer.out_features % MACHETE_BLOCK[1] == 0)
    return grouped and shaped


def _cpu_kernel(scheme: GroupScheme) -> KernelChoice:
    weights, activations = scheme.weights, scheme.activations
    if weights.type == "float":
        return KernelChoice("ChannelWiseTorchFP8ScaledMMLinearKernel (torch._scaled_mm)", "fp8")
    if activations is not None:
        name = "Dynamic4bitLinearKernel" if weights.bits == 4 else "CPUInt8ScaledMMLinearKernel (oneDNN)"
        return KernelChoice(name, "int8")
    return KernelChoice("CPUWNA16LinearKernel", "bf16")
