"""Weight bytes: predicted from the shape for a recipe (or 16-bit), or measured from safetensors headers.

Which scheme each Linear gets is the compiler's answer (pipelines.quantize.compiler.scheme_for), so the bytes the
planner predicts and the layers the compiler quantizes never disagree.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from pydantic import Field

from pipelines.artifact import tensor_bytes
from pipelines.errors import InputError
from pipelines.planner.shape import ModelShape
from pipelines.quantize.compiler import scheme_for
from pipelines.quantize.layout import Kind, LinearInfo, ModelLayout
from pipelines.recipe import AutoGroupSize, GroupScheme, KeptGroup, Recipe
from pipelines.schema import StrictModel

_WEIGHT_SHAPE_BYTES = 16  # pack-quantized layers also store their original shape as int64[2]


class Linear(NamedTuple):
    """One Linear the planner counts, named as the family's checkpoint names it (Llama-style; Phi-3's fused
    qkv_proj and gate_up_proj)."""

    name: str
    kind: Kind
    layer: int
    out: int
    inp: int
    bias: bool
    copies: int = 1  # identical copies (MoE experts)
    expert: bool = False


class WeightBreakdown(StrictModel):
    total_bytes: int
    embedding_bytes: int = Field(description="the input embedding table (a lookup reads one row per token)")
    expert_bytes: int = Field(default=0, description="all routed experts (a token reads only its top-k)")

    def read_per_token(self, shape: ModelShape) -> int:
        """Bytes of weights one decode step reads from memory."""
        skipped_experts = self.expert_bytes * (1 - shape.experts_per_token / shape.experts) if shape.experts else 0
        embedding = 0 if shape.tied_embeddings else self.embedding_bytes
        return int(self.total_bytes - embedding - skipped_experts)


def model_linears(shape: ModelShape) -> list[Linear]:
    """Every decoder layer's Linears, layer by layer (what the shape probe sizes and times)."""
    return [linear for layer in range(shape.layers) for linear in decoder_linears(shape, layer)]


def decoder_linears(shape: ModelShape, layer: int) -> list[Linear]:
    """Decoder layer `layer`'s attention and MLP Linears (MoE: the experts once, with their count)."""
    prefix = f"model.layers.{layer}"
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv_bias = shape.attention_bias or shape.qkv_bias
    if shape.fused_qkv:
        linears = [Linear(f"{prefix}.self_attn.qkv_proj", "attention", layer, q_width + 2 * kv_width, shape.hidden, qkv_bias)]
    else:
        linears = [
            Linear(f"{prefix}.self_attn.q_proj", "attention", layer, q_width, shape.hidden, qkv_bias),
            Linear(f"{prefix}.self_attn.k_proj", "attention", layer, kv_width, shape.hidden, qkv_bias),
            Linear(f"{prefix}.self_attn.v_proj", "attention", layer, kv_width, shape.hidden, qkv_bias),
        ]
    linears.append(Linear(f"{prefix}.self_attn.o_proj", "attention", layer, shape.hidden, q_width, shape.attention_bias))
    if shape.fused_gate_up and not shape.experts:
        return [
            *linears,
            Linear(f"{prefix}.mlp.gate_up_proj", "mlp", layer, 2 * shape.intermediate, shape.hidden, shape.mlp_bias),
            Linear(f"{prefix}.mlp.down_proj", "mlp", layer, shape.hidden, shape.intermediate, shape.mlp_bias),
        ]
    if not shape.experts:
        return linears + _mlp(f"{prefix}.mlp", layer, shape.hidden, shape.intermediate, shape.mlp_bias)
    linears += _mlp(f"{prefix}.mlp.experts", layer, shape.hidden, shape.expert_intermediate, False, shape.experts, True)
    if shape.shared_expert_intermediate:
        linears += _mlp(f"{prefix}.mlp.shared_expert", layer, shape.hidden, shape.shared_expert_intermediate, False)
    return linears


def _mlp(prefix: str, layer: int, hidden: int, width: int, bias: bool, count: int = 1, expert: bool = False) -> list[Linear]:
    return [
        Linear(f"{prefix}.gate_proj", "mlp", layer, width, hidden, bias, count, expert),
        Linear(f"{prefix}.up_proj", "mlp", layer, width, hidden, bias, count, expert),
        Linear(f"{prefix}.down_proj", "mlp", layer, hidden, width, bias, count, expert),
    ]


def linear_schemes(shape: ModelShape, recipe: Recipe | None) -> dict[str, GroupScheme | None]:
    """The scheme each decoder Linear gets from `recipe` (None: 16-bit), by name: compiler.scheme_for."""
    return {
        linear.name: scheme_for(recipe, linear, shape.layers) if recipe else None
        for layer in range(shape.layers)
        for linear in decoder_linears(shape, layer)
    }


def shape_layout(shape: ModelShape) -> ModelLayout:
    """The compiler's view of the model, built from the shape alone (no torch): the Linear layers the
    planner counts, named as the family's checkpoints name them. A model no recipe can quantize (MoE,
    multimodal: pipelines.quantize.layout.quantize_refusal) is an InputError, as the compiler's own layout is."""
    if shape.not_quantizable:
        raise InputError(shape.not_quantizable, field="model_type")
    linears = [
        LinearInfo(name=linear.name, in_features=linear.inp, out_features=linear.out, kind=linear.kind, layer=layer)
        for layer in range(shape.layers)
        for linear in decoder_linears(shape, layer)
    ]
    lm_head = LinearInfo(name="lm_head", in_features=shape.hidden, out_features=shape.vocab)
    return ModelLayout(
        architecture=shape.name, num_layers=shape.layers, linears=linears, embeddings=["model.embed_tokens"],
        lm_head="lm_head", lm_head_linear=lm_head, head_dim=shape.head_dim,
    )


def linear_bytes(out: int, inp: int, scheme: GroupScheme | None, param_bytes: int = 2) -> int:
    """Bytes a Linear's weight takes in a compressed-tensors checkpoint (bias excluded).

    With quantized activations the format is int-quantized (one int8 per weight); weight-only schemes
    are pack-quantized (32 values in `bits` int32 words per row, plus the int64[2] original shape); FP8 weights
    are float-quantized (one float8 per weight, with or without activations; block-wise: one scale per block).
    Scales are in the model dtype; zero points of asymmetric schemes are int8 or, when packed, int32.
    """
    if scheme is None:
        return out * inp * param_bytes
    weights = scheme.weights
    # `group_size: auto` is the layer's own size; where none divides (the recipe does not apply), the cap.
    written = weights.group_size
    group_size = weights.group_size_for(inp) or (written.auto if isinstance(written, AutoGroupSize) else written)
    block = weights.block_shape or (1, 1)
    groups = {"tensor": 0, "channel": 1, "group": math.ceil(inp / (group_size or 1)), "block": math.ceil(inp / block[1])}[weights.granularity]
    scales = (math.ceil(out / block[0]) if weights.block_shape else out) * groups if groups else 1
    if weights.type == "float":  # float-quantized: one float8_e4m3fn per weight, symmetric (no zero points)
        stored, zero_points = out * inp, 0
    elif scheme.activations is None:  # pack-quantized; zero points packed into int32 along the output dim
        stored = out * math.ceil(inp / 32) * weights.bits * 4 + _WEIGHT_SHAPE_BYTES
        zero_points = math.ceil(out / 32) * weights.bits * 4 * groups if groups else 1
    else:  # int-quantized; int8 zero points beside the scales
        stored, zero_points = out * inp, scales
    activations = scheme.activations
    static_input = 0 if activations is None or activations.dynamic else param_bytes + (0 if activations.symmetric else 1)
    return stored + scales * param_bytes + (0 if weights.symmetric else zero_points) + static_input


def _kept_bytes(group: KeptGroup, out: int, inp: int, param_bytes: int) -> int:
    scheme = GroupScheme(weights=group.weights) if group.quantize and group.weights else None
    return linear_bytes(out, inp, scheme, param_bytes)


def predict_weight_bytes(shape: ModelShape, recipe: Recipe | None) -> WeightBreakdown:
    """Weight bytes of the checkpoint `recipe` would produce (None: the 16-bit model), from the shape alone."""
    pb = shape.param_bytes
    embeddings = recipe.groups.embeddings if recipe else KeptGroup()
    lm_head = recipe.groups.lm_head if recipe else KeptGroup()
    embedding = _kept_bytes(embeddings, shape.vocab, shape.hidden, pb)
    total = embedding + (0 if shape.tied_embeddings else _kept_bytes(lm_head, shape.vocab, shape.hidden, pb))
    total += (shape.norms_per_layer * shape.layers + 1) * shape.hidden * pb  # RMS norms: per layer (2; Gemma 2/3: 4), a final one
    total += (2 * shape.layers * shape.head_dim * pb) if shape.qk_norm else 0  # q_norm and k_norm (Qwen3, Gemma 3)
    total += shape.layers * shape.experts * shape.hidden * pb  # MoE routers stay 16-bit
    if recipe is not None and recipe.kv_cache.scales == "calibrated":
        total += 2 * shape.layers * pb  # each attention layer's k_scale and v_scale (llm-compressor's kv_cache_scheme)
    experts = 0
    for layer in range(shape.layers):
        for linear in decoder_linears(shape, layer):
            scheme = scheme_for(recipe, linear, shape.layers) if recipe else None
            size = linear.copies * (linear_bytes(linear.out, linear.inp, scheme, pb) + (linear.out * pb if linear.bias else 0))
            total += size
            experts += size if linear.expert else 0
    return WeightBreakdown(total_bytes=total, embedding_bytes=embedding, expert_bytes=experts)


def safetensors_bytes(model_dir: Path) -> int:
    """Exact tensor bytes of a checkpoint: the sum of nbytes over every safetensors header, weights unread."""
    return tensor_bytes(Path(model_dir))
