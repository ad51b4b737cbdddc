"""Fake quantization of one module as llm-compressor quantizes it, with compressed-tensors' own functions.

Weights: the observer llm-compressor attaches to weights (memoryless min-max), compressed-tensors'
calculate_qparams and fake_quantize: round-to-nearest, the scales in the weight's own dtype, as the
checkpoint stores them. GPTQ: llm-compressor's own `quantize_weight` (the solver GPTQModifier runs) on the
module's weight with the Hessian of its inputs on the calibration texts, from the same observer's scales. The
one difference from a quantize run: the inputs are the 16-bit model's, where llm-compressor's sequential pipeline
feeds each layer the outputs of the layers it already quantized. Activations: dynamic per-token scales as vLLM computes
them at run time (compute_dynamic_scales_and_zp), static per-tensor scales from llm-compressor's default
activation observer (min-max, moving average) over the calibration samples fed one at a time.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

from pipelines.recipe import ActivationScheme, Algorithm, WeightScheme

WEIGHT_OBSERVER = "memoryless_minmax"  # llmcompressor.modifiers.quantization.calibration.initialize_observer
INPUT_OBSERVER = "minmax"


def weight_args(weights: WeightScheme, actorder: str | None = None) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=weights.bits, type=weights.type, symmetric=weights.symmetric, strategy=weights.granularity,
        group_size=weights.group_size if weights.granularity == "group" else None, actorder=actorder,
    )


def activation_args(activations: ActivationScheme) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=activations.bits, type=activations.type, symmetric=activations.symmetric,
        strategy=activations.granularity, dynamic=activations.dynamic,
    )


def _observer(name: str, base_name: str, args: QuantizationArgs):
    from llmcompressor.observers import Observer  # heavy: only when measuring

    return Observer.load_from_registry(name, base_name=base_name, args=args)


@torch.no_grad()
def fake_quantize_weight(weight: torch.Tensor, weights: WeightScheme) -> torch.Tensor:
    """The weight as the checkpoint will hold it, dequantized (same dtype and shape as `weight`)."""
    args = weight_args(weights)
    observer = _observer(WEIGHT_OBSERVER, "weight", args)
    observer(weight)
    qparams = observer.get_qparams()
    return fake_quantize(weight, qparams["scale"], qparams["zero_point"], args)


@torch.no_grad()
def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, weights: WeightScheme, algorithm: Algorithm) -> torch.Tensor:
    """The weight as GPTQ leaves it, dequantized (same dtype and shape as `weight`). `hessian`: the normalized
    Hessian of the module's inputs (2 X^T X / n, llm-compressor's accumulate_hessian)."""
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight  # heavy: imported when used

    args = weight_args(weights, "weight" if algorithm.actorder else None)
    observer = _observer(WEIGHT_OBSERVER, "weight", args)
    observer(weight)
    qparams = observer.get_qparams()
    threads = torch.get_num_threads()
    # The solver steps column by column on vectors too small to share between threads: on a busy CPU the extra
    # threads only spin (a 576 x 576 solve took 6 s with 2 threads and 1.2 s with 1 while other jobs ran; 0.2 s idle).
    torch.set_num_threads(1)
    try:
        # quantize_weight works in place on the stacked weight it is given: a copy, never the module's own tensor.
        solved = quantize_weight(weight[None].to(torch.float32, copy=True), hessian[None].clone(), qparams["scale"][None],
                                 qparams["zero_point"][None], None, args, blocksize=algorithm.block_size, percdamp=algorithm.dampening_frac)
    finally:
        torch.set_num_threads(threads)
    return solved[0][0].to(weight.dtype)  # (weights, losses, RTN-fallback flags), each stacked over a batch of one


class StaticInputScale:
    """Accumulates a Linear's input range as llm-compressor's static activation observer does."""

    def __init__(self, activations: ActivationScheme):
        self.args = activation_args(activations)
        self.observer = _observer(INPUT_OBSERVER, "input", self.args)
        self.qparams: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        self.observer(x)

    def freeze(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.qparams is None:
            found = self.observer.get_qparams()
            self.qparams = (found["scale"], found["zero_point"])
        return self.qparams


@torch.no_grad()
def fake_quantize_input(x: torch.Tensor, activations: ActivationScheme, static: StaticInputScale | None = None) -> torch.Tensor:
    """A Linear's input as the int8 kernel sees it: dynamic scales per token, or the frozen static scale."""
    args = activation_args(activations)
    if activations.dynamic:
        scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=None)
    else:
        assert static is not None, "a static activation scheme needs its calibrated scale"
        scale, zero_point = static.freeze()
    return fake_quantize(x, scale, zero_point, args)
