"""The model's shape, from config.json alone: sizes, attention layout, sliding windows, a quantized KV cache.

load_config reads a config.json (a dict, a file or a model folder); model_shape validates what the planner
needs and derives the shape, each size checked against pipelines.bounds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import Field

from pipelines.artifact import CONFIG_NAME, read_config_json
from pipelines.bounds import bounded_size
from pipelines.errors import InputError
from pipelines.schema import StrictModel


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
    if "head_dim" not in cfg and hidden % heads:
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
        head_dim=need("head_dim", hidden // heads),
        intermediate=need("intermediate_size"),
        vocab=need("vocab_size"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position=max_position,
        windows=_layer_windows(cfg, layers, source),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=cfg.get("model_type") in ("qwen2", "qwen2_moe"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        experts=need("num_local_experts" if "num_local_experts" in cfg else "num_experts") if experts else 0,
        experts_per_token=need("num_experts_per_tok") if experts else 0,
        expert_intermediate=need("moe_intermediate_size", cfg.get("intermediate_size")) if experts else 0,
        shared_expert_intermediate=shared if experts else 0,
        **_config_kv_cache(quantization, source),
        quantized=quantization is not None,
    )


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
