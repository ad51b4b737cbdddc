"""The model's shape, from config.json alone: sizes, attention layout, sliding windows, a quantized KV cache.

load_config reads a config.json (a dict, a file or a model folder); model_shape validates what the planner
needs and derives the shape, each size checked against pipelines.bounds.

The planner counts bytes by family (FAMILIES: what one decoder layer of the family's checkpoint holds beyond a
Llama's); a model_type it does not know is refused, in one line naming it, rather than counted as a Llama.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import Field

from pipelines.artifact import CONFIG_NAME, read_config_json
from pipelines.bounds import bounded_size
from pipelines.errors import InputError
from pipelines.quantize.layout import architecture_name, quantize_refusal
from pipelines.schema import StrictModel


class Family(NamedTuple):
    """What one decoder layer of a family's checkpoint holds beyond a Llama's, and the defaults its config
    class gives fields config.json may leave out (measured against transformers 5.17's classes)."""

    norms: int = 2  # RMS norm weights of hidden size per layer (Gemma 2/3: before and after attention and MLP)
    qk_norm: bool = False  # q_norm and k_norm, head_dim each (Qwen3, Gemma 3)
    qkv_bias: bool = False  # q/k/v biases whatever attention_bias says (Qwen2)
    fused_qkv: bool = False  # one qkv_proj Linear in the checkpoint (Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj Linear in the checkpoint (Phi-3)
    tied: bool = False  # tie_word_embeddings when config.json does not say
    head_dim: int | None = None  # head_dim when config.json does not say (None: hidden / heads)


_GEMMA = Family(tied=True, head_dim=256)
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True, head_dim=128),
    "gemma": _GEMMA,
    "gemma2": _GEMMA._replace(norms=4),
    "gemma3_text": _GEMMA._replace(norms=4, qk_norm=True),
    "gemma3": _GEMMA._replace(norms=4, qk_norm=True),  # a multimodal config's text model (planned at 16 bits only)
    "phi3": Family(fused_qkv=True, fused_gate_up=True),
    # Mixture-of-experts: planned at 16 bits; no recipe applies (pipelines.quantize.layout.quantize_refusal).
    "mixtral": Family(),
    "qwen2_moe": Family(qkv_bias=True),
    "qwen3_moe": Family(qk_norm=True),
}


class ModelShape(StrictModel):
    """What the planner needs from config.json."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    param_bytes: int = 2
    max_position: int | None
    windows: list[int | None] = Field(description="per layer: the sliding window in tokens, or None for full attention")
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    kv_cache_dtype: str | None = Field(default=None, description="from quantization_config.kv_cache_scheme")
    kv_cache_element_bytes: int | None = None
    quantized: bool = False
    family: str = Field(default="llama", description="the model_type whose checkpoint layout is counted (FAMILIES)")
    norms_per_layer: int = 2
    qk_norm: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    not_quantizable: str | None = Field(default=None, description="why no recipe applies (MoE, multimodal): planned at 16 bits only")

    @property
    def active_intermediate(self) -> int:
        """Intermediate width one token goes through (MoE: its routed experts plus any shared expert)."""
        if self.experts:
            return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate
        return self.intermediate


def load_config(config: dict | Path) -> tuple[dict, str]:
    """config.json as a dict, and where it came from (for error messages). A folder means its config.json."""
    if isinstance(config, dict):
        return config, CONFIG_NAME
    path = Path(config)
    try:
        if path.is_dir():
            path = path / CONFIG_NAME
    except (OSError, ValueError):
        pass  # read_config_json names the problem
    return read_config_json(path), str(path)


def model_shape(config: dict, source: str = "config.json") -> ModelShape:
    """Validate config.json's fields and derive the shape. Multimodal configs plan their text model."""
    cfg = {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config
    if "kv_lora_rank" in cfg:
        raise InputError("multi-head latent attention (DeepSeek-style) is not supported", file=source, field="kv_lora_rank")
    family_name, family = _family(config, cfg, source)

    def need(key: str, default: Any = None) -> int:
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            got = "missing" if key not in cfg else f"got {value!r}"
            raise InputError(f"needs a positive integer ({got})", file=source, field=key)
        return bounded_size(key, value, source)

    hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
    kv_heads = need("num_key_value_heads", heads)
    if heads % kv_heads:
        message = f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        raise InputError(message, file=source, field="num_key_value_heads")
    if cfg.get("head_dim") is None:  # absent or null: the family's config class default
        cfg = {**cfg, "head_dim": family.head_dim or (hidden // heads if hidden % heads == 0 else None)}
    if cfg["head_dim"] is None:
        message = f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); give head_dim"
        raise InputError(message, file=source, field="head_dim")
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    quantization = cfg.get("quantization_config") if isinstance(cfg.get("quantization_config"), dict) else None
    max_position = cfg.get("max_position_embeddings")
    if isinstance(max_position, int) and not isinstance(max_position, bool):
        bounded_size("max_position_embeddings", max_position, source)
    else:
        max_position = None
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if experts and shared:
        bounded_size("shared_expert_intermediate_size", shared, source)
    return ModelShape(
        name=str(cfg.get("_name_or_path") or Path(source).parent.name or "model"),
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=need("head_dim"),
        intermediate=need("intermediate_size"),
        vocab=need("vocab_size"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", family.tied)),
        max_position=max_position,
        windows=_layer_windows(cfg, layers, source),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=family.qkv_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        experts=need("num_local_experts" if "num_local_experts" in cfg else "num_experts") if experts else 0,
        experts_per_token=need("num_experts_per_tok") if experts else 0,
        expert_intermediate=need("moe_intermediate_size", cfg.get("intermediate_size")) if experts else 0,
        shared_expert_intermediate=shared if experts else 0,
        **_config_kv_cache(quantization, source),
        quantized=quantization is not None,
        family=family_name, norms_per_layer=family.norms, qk_norm=family.qk_norm,
        fused_qkv=family.fused_qkv, fused_gate_up=family.fused_gate_up,
        not_quantizable=_not_quantizable(config),
    )


def _family(config: dict, cfg: dict, source: str) -> tuple[str, Family]:
    """The family whose checkpoint layout the planner counts (a multimodal config's text model's), or an
    InputError naming the architecture: one it cannot plan is refused, not counted as a Llama."""
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in FAMILIES:
        return model_type, FAMILIES[model_type]
    refusal = quantize_refusal(config)
    if refusal is not None and refusal[0] == "is_encoder_decoder":
        raise InputError(f"{architecture_name(config)} is {refusal[1]}", file=source, field="is_encoder_decoder")
    if not isinstance(model_type, str) or not model_type:
        raise InputError(f"missing: the planner counts bytes by family ({', '.join(FAMILIES)})", file=source, field="model_type")
    raise InputError(
        f"{architecture_name(config)} is not a decoder family the planner can count; it counts {', '.join(FAMILIES)}",
        file=source, field="model_type",
    )


def _not_quantizable(config: dict) -> str | None:
    refusal = quantize_refusal(config)
    return f"{architecture_name(config)} is {refusal[1]}" if refusal else None


def _layer_windows(cfg: dict, layers: int, source: str) -> list[int | None]:
    """Which layers attend through a sliding window (they keep at most `window` tokens of KV cache)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise InputError(f"needs one entry per layer ({layers})", file=source, field="layer_types")
        sliding = [kind == "sliding_attention" for kind in types]
    elif not window or ("use_sliding_window" in cfg and not cfg["use_sliding_window"]):
        return [None] * layers
    elif "use_sliding_window" in cfg:  # Qwen2 family: the layers from max_window_layers on slide
        start = bounded_size("max_window_layers", cfg.get("max_window_layers") or 0, source, low=0)
        sliding = [index >= start for index in range(layers)]
    elif cfg.get("sliding_window_pattern"):  # Gemma 3: every pattern-th layer is global
        pattern = bounded_size("sliding_window_pattern", cfg["sliding_window_pattern"], source)
        sliding = [(index + 1) % pattern != 0 for index in range(layers)]
    elif cfg.get("model_type") == "gemma2":  # alternating, sliding first
        sliding = [index % 2 == 0 for index in range(layers)]
    else:  # Mistral: every layer
        sliding = [True] * layers
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise InputError(f"sliding layers need a positive integer window (got {window!r})", file=source, field="sliding_window")
    if any(sliding):
        bounded_size("sliding_window", window, source)
    return [window if slides else None for slides in sliding]


def _config_kv_cache(quantization: dict | None, source: str = "config.json") -> dict[str, Any]:
    """A quantized KV cache from compressed-tensors' kv_cache_scheme (e.g. {num_bits: 8, type: float})."""
    scheme = (quantization or {}).get("kv_cache_scheme")
    if not isinstance(scheme, dict):
        return {}
    bits = scheme.get("num_bits", 8)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 64:
        raise InputError(f"needs an integer from 1 to 64 (got {bits!r})", file=source, field="quantization_config.kv_cache_scheme.num_bits")
    kind = "fp" if scheme.get("type", "float") == "float" else "int"
    return {"kv_cache_dtype": f"{kind}{bits}", "kv_cache_element_bytes": max(1, math.ceil(bits / 8))}
