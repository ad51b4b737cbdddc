"""Give the trained demo model the weight structure that makes per-channel int4 fail, without changing
what it computes.

A model this small, trained on easy synthetic tasks, shrugs off even int3 round-to-nearest (measured:
see TRAINING.md), so it could not show the gate rejecting a servable scheme. Large LLMs are fragile
for a structural reason: some input channels of a Linear layer carry much larger activations than the
rest, the weights reading them are correspondingly small, and one scale per output row then rounds
those small weights away. Group-wise scales (w4a16, group 128) keep them; SmoothQuant moves the
imbalance back before int8.

This reproduces that structure exactly: for input channels [0, 128) of every decoder layer, the RMSNorm
gain is multiplied by `factor` and the matching columns of the Linear layers that read the normed
activations (q/k/v after input_layernorm, gate/up after post_attention_layernorm) are divided by it.
The product is unchanged; with a power of two the rescaling is exact in bf16 and fp16 too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# A transformers module (model, decoder layer, norm): submodules and parameters are found by name at run time.
HFModule = Any

CHANNELS = slice(0, 128)  # one whole group of 128 input columns: group-wise scales are unaffected
FACTOR = 16.0


def _readers(layer: HFModule) -> list[tuple[HFModule, list[nn.Linear]]]:
    attention, mlp = layer.self_attn, layer.mlp
    return [
        (layer.input_layernorm, [attention.q_proj, attention.k_proj, attention.v_proj]),
        (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]),
    ]


@torch.no_grad()
def add_outlier_channels(model: HFModule, factor: float = FACTOR, channels: slice = CHANNELS) -> None:
    """Rescale in place: norm gain x factor, reading weight columns / factor (the function is unchanged)."""
    for layer in model.model.layers:
        for norm, linears in _readers(layer):
            norm.weight[channels] *= factor
            for linear in linears:
                linear.weight[:, channels] /= factor


@torch.no_grad()
def column_scale_ratio(model: HFModule, channels: slice = CHANNELS) -> float:
    """Median, over the reading Linear layers, of max|W| outside `channels` / max|W| inside them."""
    ratios = [
        float(linear.weight[:, channels.stop :].abs().max() / linear.weight[:, channels].abs().max())
        for layer in model.model.layers
        for _, linears in _readers(layer)
        for linear in linears
    ]
    return sorted(ratios)[len(ratios) // 2]
