"""Round-to-nearest fake quantization of the decoder's Linear weights, to measure how fragile a model is.

Symmetric integer RTN as compressed-tensors computes it: scale = max|w| / ((2^bits - 1) / 2), values
clamped to [-2^(bits-1), 2^(bits-1) - 1]; one scale per output channel, per group of input columns
of one channel, or per whole tensor.
Embeddings and lm_head are left alone, as the shipped recipes leave them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass(frozen=True)
class RtnScheme:
    name: str
    bits: int
    granularity: Literal["channel", "group", "tensor"] = "channel"
    group_size: int | None = None


SCHEMES = (
    RtnScheme("int8 per-channel", 8),
    RtnScheme("int4 group-128", 4, "group", 128),
    RtnScheme("int4 per-channel", 4),
    RtnScheme("int4 per-tensor", 4, "tensor"),
    RtnScheme("int3 per-channel", 3),
    RtnScheme("int2 per-channel", 2),
)


def quantize_dequantize(weight: torch.Tensor, scheme: RtnScheme) -> torch.Tensor:
    out_features, in_features = weight.shape
    if scheme.granularity == "tensor":
        grouped = weight.float().reshape(1, 1, -1)
    else:
        group = scheme.group_size if scheme.granularity == "group" else in_features
        if in_features % group:
            raise ValueError(f"group size {group} does not divide {in_features} input features")
        grouped = weight.float().reshape(out_features, in_features // group, group)
    bits = scheme.bits
    half_range = (2**bits - 1) / 2
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / half_range
    levels = torch.clamp(torch.round(grouped / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (levels * scale).reshape(out_features, in_features).to(weight.dtype)


def fake_quantized(model: nn.Module, scheme: RtnScheme) -> nn.Module:
    """A copy of `model` whose decoder-layer Linear weights went through quantize-dequantize."""
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for module in clone.model.layers.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(quantize_dequantize(module.weight, scheme))
    return clone
