"""Round-to-nearest fake quantization of the decoder's Linear weights, to measure how fragile a model is.

Symmetric integer RTN as compressed-tensors computes it: scale = max|w| / ((2^bits - 1) / 2), values
clamped to [-2^(bits-1), 2^(bits-1) - 1]; per output channel, or per group of input columns.
Embeddings and lm_head are left alone, as the shipped recipes leave them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class RtnScheme:
    name: str
    bits: int
    group_size: int | None = None  # None: one scale per output channel


SCHEMES = (
    RtnScheme("int8 per-channel", 8),
    RtnScheme("int4 group-128", 4, 128),
    RtnScheme("int4 per-channel", 4),
    RtnScheme("int3 per-channel", 3),
    RtnScheme("int2 per-channel", 2),
)


def quantize_dequantize(weight: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    out_features, in_features = weight.shape
    group = group_size or in_features
    if in_features % group:
        raise ValueError(f"group size {group} does not divide {in_features} input features")
    grouped = weight.float().reshape(out_features, in_features // group, group)
    half_range = (2**bits - 1) / 2
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / half_range
    levels = torch.clamp(torch.round(grouped / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (levels * scale).reshape(out_features, in_features).to(weight.dtype)


def fake_quantized(model: nn.Module, scheme: RtnScheme) -> nn.Module:
    """A copy of `model` whose decoder-layer Linear weights went through quantize-dequantize."""
    clone: Any = copy.deepcopy(model)  # a transformers model: `.model.layers` is found at run time
    with torch.no_grad():
        for module in clone.model.layers.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(quantize_dequantize(module.weight, scheme.bits, scheme.group_size))
    return clone
