"""KV cache maths: bytes per token and per sequence (sliding windows honoured), its dtype, and the token
capacity of a KV space counted the way vLLM logs it."""

from __future__ import annotations

import math
from pathlib import Path

from pipelines.errors import InputError
from pipelines.planner.shape import ModelShape, load_config, model_shape

# Bytes per element of the KV cache for vLLM's --kv-cache-dtype values; "auto" follows the model dtype.
KV_CACHE_DTYPES: dict[str, int | None] = {
    "auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


def _kv_layer_bytes_per_token(shape: ModelShape, element_bytes: int) -> int:
    return 2 * shape.kv_heads * shape.head_dim * element_bytes  # K and V


def kv_cache_bytes_per_token(shape: ModelShape, element_bytes: int) -> int:
    """2 x layers x KV heads x head_dim x bytes: one token's K and V in every layer."""
    return shape.layers * _kv_layer_bytes_per_token(shape, element_bytes)


def kv_cache_bytes_for_context(shape: ModelShape, element_bytes: int, context: int) -> int:
    """KV cache one sequence of `context` tokens holds; a sliding-window layer keeps at most its window."""
    tokens = sum(min(context, window) if window else context for window in shape.windows)
    return tokens * _kv_layer_bytes_per_token(shape, element_bytes)


def kv_element_bytes(shape: ModelShape, kv_cache_dtype: str = "auto") -> tuple[str, int]:
    """The KV cache dtype and its bytes: an explicit --kv-cache-dtype, else the config's kv_cache_scheme,
    else the model dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        known = ", ".join(KV_CACHE_DTYPES)
        raise InputError(f"unknown KV cache dtype {kv_cache_dtype!r} (known: {known})", field="kv_cache_dtype")
    element = KV_CACHE_DTYPES[kv_cache_dtype]
    if element is not None:  # an explicit dtype; only "auto" has none
        return kv_cache_dtype, element
    if shape.kv_cache_dtype and shape.kv_cache_element_bytes:
        return shape.kv_cache_dtype, shape.kv_cache_element_bytes
    return "auto", shape.param_bytes


def kv_capacity_tokens(
    config: dict | Path,
    kv_space_bytes: int,
    *,
    block_size: int = 16,
    max_model_len: int | None = None,
    kv_cache_dtype: str = "auto",
) -> int:
    """Tokens of KV cache `kv_space_bytes` holds, counted the way vLLM logs "KV cache size: N tokens".

    vLLM cuts the space into blocks of `block_size` tokens across all layers; with `max_model_len` it
    reports (blocks / blocks one max-length request needs) x max_model_len. Exact for full-attention
    models; for sliding-window layers the per-request blocks are approximated by the window.
    """
    shape = model_shape(*load_config(config))
    for field, value in (("kv_space_bytes", kv_space_bytes), ("block_size", block_size), ("max_model_len", max_model_len or 1)):
        if value <= 0:
            raise InputError(f"must be positive (got {value})", field=field)
    _, element = kv_element_bytes(shape, kv_cache_dtype)
    page_per_layer = block_size * _kv_layer_bytes_per_token(shape, element)
    blocks = kv_space_bytes // (page_per_layer * shape.layers)
    if max_model_len is None:
        return blocks * block_size
    per_request = sum(math.ceil(min(max_model_len, w or max_model_len) / block_size) for w in shape.windows)
    return int(blocks * shape.layers / per_request * max_model_len)
