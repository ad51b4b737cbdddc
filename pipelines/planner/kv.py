"""KV cache maths: bytes per token and per sequence (sliding windows honoured), its dtype, and the KV cache
as vLLM 0.32 allocates it: its KV-cache groups, blocks and the token capacity it logs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from pipelines.errors import InputError
from pipelines.planner.shape import ModelShape, load_config, model_shape
from pipelines.recipe import VLLM_KV_CACHE_DTYPES

# Bytes per element of the KV cache for the vLLM --kv-cache-dtype values the product counts (the recipe's vocabulary,
# pipelines/recipe.py); "auto" follows the dtype the model is served in.
KV_CACHE_DTYPES: dict[str, int | None] = {
    name: (bits // 8 if bits else None) for name, bits in VLLM_KV_CACHE_DTYPES.items() if bits or name == "auto"
}
# vLLM 0.32's defaults for its OpenAI server (vllm/platforms/cpu.py, vllm/engine/arg_utils.py get_batch_defaults).
CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16
CPU_MAX_NUM_BATCHED_TOKENS = 2048
# Batches in flight at once (VllmConfig.max_concurrent_batches): 1 on CPU (no async scheduling), 2 on CUDA.
CPU_BATCHES_IN_FLIGHT = 1
CUDA_BATCHES_IN_FLIGHT = 2


def _kv_layer_bytes_per_token(shape: ModelShape, element_bytes: int) -> int:
    return 2 * shape.kv_heads * shape.head_dim * element_bytes  # K and V


def kv_cache_bytes_per_token(shape: ModelShape, element_bytes: int) -> int:
    """2 x layers x KV heads x head_dim x bytes: one token's K and V in every layer."""
    return shape.layers * _kv_layer_bytes_per_token(shape, element_bytes)


def kv_cache_bytes_for_context(shape: ModelShape, element_bytes: int, context: int) -> int:
    """KV cache one sequence of `context` tokens holds; a sliding-window layer keeps at most its window."""
    tokens = sum(min(context, window) if window else context for window in shape.windows)
    return tokens * _kv_layer_bytes_per_token(shape, element_bytes)


# Bytes per element of vLLM's --dtype values: "auto" KV follows the dtype the model is served in.
SERVED_DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def kv_element_bytes(shape: ModelShape, kv_cache_dtype: str = "auto", served_dtype: str | None = None) -> tuple[str, int]:
    """The KV cache dtype and its bytes: an explicit --kv-cache-dtype, else the config's kv_cache_scheme,
    else the dtype the model is served in (`served_dtype`, vLLM's --dtype; default: the model's own)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        known = ", ".join(KV_CACHE_DTYPES)
        raise InputError(f"unknown KV cache dtype {kv_cache_dtype!r} (known: {known})", field="kv_cache_dtype")
    element = KV_CACHE_DTYPES[kv_cache_dtype]
    if element is not None:  # an explicit dtype; only "auto" has none
        return kv_cache_dtype, element
    if shape.kv_cache_dtype and shape.kv_cache_element_bytes:
        return shape.kv_cache_dtype, shape.kv_cache_element_bytes
    return "auto", SERVED_DTYPE_BYTES.get(served_dtype or "", shape.param_bytes)


def attention_summary(windows: Sequence[int | None]) -> str:
    """Which layers slide, e.g. "15 sliding (window 512) + 3 full", "4 full"."""
    counts: dict[int | None, int] = {}
    for window in windows:
        counts[window] = counts.get(window, 0) + 1
    parts = [f"{counts[w]} sliding (window {w:,})" for w in sorted(w for w in counts if w is not None)]
    if None in counts:
        parts.append(f"{counts[None]} full")
    return " + ".join(parts)


class KvGroup(NamedTuple):
    """One of vLLM's KV-cache groups: layers sharing one block table (one attention type)."""

    window: int | None  # None: full attention
    layers: tuple[int, ...]
    blocks_per_request: int  # blocks a max_model_len request takes from the shared pool for this group


class VllmKvCache(NamedTuple):
    """The KV cache as vLLM sizes it (get_kv_cache_configs) and the capacity it logs."""

    groups: tuple[KvGroup, ...]
    page_bytes: int  # one layer's block: block_size x 2 x KV heads x head_dim x bytes
    block_bytes: int  # one block id: the widest group's pages side by side
    num_blocks: int  # KV space // block_bytes, one pool shared by every group
    blocks_per_request: int  # summed over the groups
    max_model_len: int
    block_size: int

    @property
    def max_concurrency(self) -> float:
        """vLLM's get_max_concurrency_for_kv_cache_config."""
        return self.num_blocks / self.blocks_per_request

    @property
    def tokens(self) -> int:
        """What vLLM logs as "KV cache size: N tokens" (get_kv_cache_capacity): max-length requests that fit,
        times max_model_len; not the token slots of the pool."""
        return int(self.max_concurrency * self.max_model_len)

    def describe(self) -> str:
        widths = sorted({len(group.layers) for group in self.groups})
        width = "/".join(map(str, widths))
        return (
            f"{len(self.groups)} KV cache group{'s' if len(self.groups) > 1 else ''} of {width} "
            f"layer{'s' if widths != [1] else ''}, "
            f"{self.num_blocks:,} blocks of {self.block_size} tokens, "
            f"{self.blocks_per_request:,} blocks per {self.max_model_len:,}-token request"
        )


def _group_layers(windows: Sequence[int | None]) -> list[tuple[int | None, tuple[int, ...]]]:
    """vLLM's grouping of layers into KV-cache groups (kv_cache_utils.get_kv_cache_groups; the layers here share
    one page size). One attention type (all full, or all sliding with one window): one group of every layer.
    Otherwise _get_kv_cache_groups_uniform_page_size: a bucket per type (full; sliding per window), the group size
    is the smallest bucket (the largest if it is under 1.5 x the smallest), and each bucket is cut into
    ceil(len / group size) groups taking layers[i::n]."""
    buckets: dict[int | None, list[int]] = {}
    for index, window in enumerate(windows):
        buckets.setdefault(window, []).append(index)
    smallest = min(len(layers) for layers in buckets.values())
    largest = max(len(layers) for layers in buckets.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[tuple[int | None, tuple[int, ...]]] = []
    for window, layers in buckets.items():
        count = math.ceil(len(layers) / group_size)
        groups.extend((window, tuple(layers[i::count])) for i in range(count))
    return groups


def vllm_kv_cache(
    shape: ModelShape,
    element_bytes: int,
    kv_space_bytes: int,
    *,
    block_size: int,
    max_model_len: int,
    in_flight_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS * CPU_BATCHES_IN_FLIGHT,
    hybrid: bool = True,
) -> VllmKvCache:
    """The KV cache vLLM 0.32 allocates in `kv_space_bytes` for a model of this shape (per-layer windows, KV heads,
    head_dim) at `element_bytes` per value, and what it logs (see docs/planner.md, "Checked against vLLM").

    The space: VLLM_CPU_KVCACHE_SPACE GiB exactly on CPU (vllm/platforms/cpu.py, cpu_worker.py
    determine_available_memory); on a GPU what its memory profile leaves. Groups: _group_layers. Every group
    draws block ids from one pool; one block id holds a page (block_size tokens of one layer) for each layer of
    the widest group (_get_kv_cache_bytes_per_block), so num_blocks = space // (widest group x page). A request
    of max_model_len tokens takes ceil(max_model_len / block_size) blocks in a full-attention group
    (FullAttentionSpec.max_memory_usage_bytes) and ceil(min(window - 1 + in_flight_tokens, max_model_len) /
    block_size) + 1 in a sliding one (SlidingWindowSpec.max_admission_blocks_per_request: the window rarely
    starts on a block boundary), in_flight_tokens being max_num_batched_tokens x batches in flight. The logged
    capacity is int(num_blocks / blocks per request x max_model_len). `hybrid=False`
    (--disable-hybrid-kv-cache-manager) allocates sliding layers as full ones.
    """
    for field, value in (("kv_space_bytes", kv_space_bytes), ("block_size", block_size),
                         ("max_model_len", max_model_len), ("in_flight_tokens", in_flight_tokens),
                         ("element_bytes", element_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"must be a positive integer (got {value!r})", field=field)
    windows = shape.windows if hybrid else [None] * shape.layers
    page = block_size * _kv_layer_bytes_per_token(shape, element_bytes)

    def blocks(window: int | None) -> int:
        if window is None:
            return math.ceil(max_model_len / block_size)
        return math.ceil(min(window - 1 + in_flight_tokens, max_model_len) / block_size) + 1

    groups = tuple(KvGroup(window, layers, blocks(window)) for window, layers in _group_layers(windows))
    block_bytes = max(len(group.layers) for group in groups) * page
    return VllmKvCache(
        groups=groups, page_bytes=page, block_bytes=block_bytes, num_blocks=kv_space_bytes // block_bytes,
        blocks_per_request=sum(group.blocks_per_request for group in groups),
        max_model_len=max_model_len, block_size=block_size,
    )


def kv_capacity_tokens(
    config: dict | Path,
    kv_space_bytes: int,
    *,
    block_size: int = CUDA_BLOCK_SIZE,
    max_model_len: int | None = None,
    kv_cache_dtype: str = "auto",
    served_dtype: str | None = None,
    in_flight_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS * CPU_BATCHES_IN_FLIGHT,
    hybrid: bool = True,
) -> int:
    """Tokens vLLM logs as "KV cache size: N tokens" for `kv_space_bytes` of KV space (vllm_kv_cache).
    `max_model_len` defaults to the model's max_position_embeddings, as vLLM's does."""
    shape = model_shape(*load_config(config))
    if max_model_len is None:
        if shape.max_position is None:
            raise InputError("config.json has no max_position_embeddings: give max_model_len", field="max_model_len")
        max_model_len = shape.max_position
    _, element = kv_element_bytes(shape, kv_cache_dtype, served_dtype)
    cache = vllm_kv_cache(
        shape, element, kv_space_bytes, block_size=block_size, max_model_len=max_model_len,
        in_flight_tokens=in_flight_tokens, hybrid=hybrid,
    )
    return cache.tokens
