"""The memory planner: known public figures, checkpoint layouts, sliding windows, search, bad input, CLI."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from pipelines import cli
from pipelines.errors import InputError
from pipelines.hardware.targets import parse_target
from pipelines.planner import (
    GiB,
    PlanSettings,
    gpu_spec,
    known_gpus,
    kv_cache_bytes_for_context,
    kv_cache_bytes_per_token,
    kv_capacity_tokens,
    linear_bytes,
    load_config,
    model_shape,
    plan,
    predict_weight_bytes,
    safetensors_bytes,
)
from pipelines.planner.kv import attention_summary, vllm_kv_cache
from pipelines.planner.view import plan_title
from pipelines.recipe import GroupScheme, Recipe

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"
LLAMA2_7B = CONFIGS / "llama-2-7b" / "config.json"
LLAMA3_8B = CONFIGS / "llama-3-8b" / "config.json"
LLAMA3_70B = CONFIGS / "llama-3-70b" / "config.json"
MISTRAL_7B = CONFIGS / "mistral-7b-v0.1" / "config.json"

TINY = {  # the demo model's shape
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000, "max_position_embeddings": 2048,
    "model_type": "llama", "dtype": "bfloat16",
}


def shape_of(config: Path | dict):
    return model_shape(*load_config(config))


def recipe(attention: dict | None, mlp: dict | None = None, **extra) -> Recipe:
    groups = {"attention": attention, "mlp": mlp if mlp is not None else attention}
    return Recipe.model_validate({"name": "test", "groups": groups, **extra})


W8A8 = {"weights": {"bits": 8, "granularity": "channel"}, "activations": {"granularity": "token", "dynamic": True}}
W4A16 = {"weights": {"bits": 4, "granularity": "group", "group_size": 128}}


# --- known public figures ---------------------------------------------------------------------------


@pytest.mark.parametrize("config, published_parameters", [
    (LLAMA2_7B, 6_738_415_616),
    (LLAMA3_8B, 8_030_261_248),
    (LLAMA3_70B, 70_553_706_496),
    (MISTRAL_7B, 7_241_732_096),
])
def test_16_bit_weights_are_two_bytes_per_published_parameter(config: Path, published_parameters: int) -> None:
    assert predict_weight_bytes(shape_of(config), None).total_bytes == 2 * published_parameters


def test_llama_2_7b_known_memory_figures() -> None:
    shape = shape_of(LLAMA2_7B)
    assert predict_weight_bytes(shape, None).total_bytes == pytest.approx(13.5e9, rel=0.01)
    assert kv_cache_bytes_for_context(shape, 2, 2048) == pytest.approx(1.07e9, rel=0.01)
    assert 8 * kv_cache_bytes_for_context(shape, 2, 8192) == pytest.approx(34e9, rel=0.02)


def test_grouped_query_attention_shrinks_the_kv_cache_by_the_group_size() -> None:
    llama2, llama3 = shape_of(LLAMA2_7B), shape_of(LLAMA3_8B)
    assert kv_cache_bytes_per_token(llama2, 2) == 4 * kv_cache_bytes_per_token(llama3, 2)
    assert kv_cache_bytes_per_token(llama3, 2) == 128 * 1024  # 2 x 32 layers x 8 heads x 128 x 2 bytes


def test_quantized_llama_2_7b_is_near_public_checkpoint_sizes() -> None:
    shape = shape_of(LLAMA2_7B)
    # Public INT8 W8A8 and 4-bit group-128 checkpoints of Llama-2-7B weigh about 7.0 GB and 3.9 GB.
    assert predict_weight_bytes(shape, recipe(W8A8)).total_bytes == pytest.approx(7.0e9, rel=0.02)
    assert predict_weight_bytes(shape, recipe(W4A16)).total_bytes == pytest.approx(3.9e9, rel=0.03)


# --- checkpoint layouts (observed in compressed-tensors 0.19 checkpoints written by llm-compressor) ----


def scheme(weights: dict, activations: dict | None = None) -> GroupScheme:
    return GroupScheme.model_validate({"weights": weights, "activations": activations})


@pytest.mark.parametrize("group, expected", [
    # int-quantized: int8 weight [out, in] + bf16 scale [out, 1]
    (scheme({"bits": 8}, {"granularity": "token"}), 256 * 512 + 256 * 2),
    # + a bf16 input_scale [1] when activations are static
    (scheme({"bits": 8}, {"granularity": "tensor", "dynamic": False}), 256 * 512 + 256 * 2 + 2),
    # pack-quantized: int32 [out, in/32 x bits] + int64 shape [2] + bf16 scale [out, in/group]
    (scheme({"bits": 4, "granularity": "group", "group_size": 64}), 256 * 64 * 4 + 16 + 256 * 8 * 2),
    # asymmetric: + zero points packed along out: int32 [out/32 x bits, in/group]
    (scheme({"bits": 4, "granularity": "group", "group_size": 64, "symmetric": False}),
     256 * 64 * 4 + 16 + 256 * 8 * 2 + 32 * 8 * 4),
    (scheme({"bits": 8, "symmetric": False}), 256 * 128 * 4 + 16 + 256 * 2 + 64 * 4),
    (scheme({"bits": 3, "granularity": "group", "group_size": 64}), 256 * 48 * 4 + 16 + 256 * 8 * 2),
    (scheme({"bits": 4, "granularity": "tensor"}), 256 * 64 * 4 + 16 + 2),
])
def test_linear_bytes_follow_the_compressed_tensors_layout(group: GroupScheme, expected: int) -> None:
    assert linear_bytes(256, 512, group) == expected


def test_16_bit_linear_is_two_bytes_per_weight() -> None:
    assert linear_bytes(256, 512, None) == 256 * 512 * 2


def test_embeddings_lm_head_and_norms_stay_16_bit() -> None:
    shape = shape_of(TINY)
    everything_4bit = predict_weight_bytes(shape, recipe(W4A16)).total_bytes
    kept = 2 * 1000 * 256 * 2 + (2 * 4 + 1) * 256 * 2
    assert everything_4bit > kept
    lm_head_4bit = {"quantize": True, "weights": W4A16["weights"]}
    quantized_head = Recipe.model_validate({"name": "t", "groups": {"attention": W4A16, "mlp": W4A16, "lm_head": lm_head_4bit}})
    saving = linear_bytes(1000, 256, None) - linear_bytes(1000, 256, GroupScheme.model_validate(W4A16))
    assert predict_weight_bytes(shape, quantized_head).total_bytes == everything_4bit - saving


def test_overrides_keep_layers_in_16_bit() -> None:
    shape = shape_of(TINY)
    plain = predict_weight_bytes(shape, recipe(W4A16)).total_bytes
    keep_ends = recipe(W4A16, overrides=[{"layers": [0, -1], "keep": True}])
    keep_down = recipe(W4A16, overrides=[{"match": r"mlp\.down_proj$", "keep": True}])
    one_layer_16 = predict_weight_bytes(shape, None).total_bytes - plain  # all four layers' saving
    assert predict_weight_bytes(shape, keep_ends).total_bytes == plain + one_layer_16 // 2
    down_saving = 4 * (linear_bytes(256, 512, None) - linear_bytes(256, 512, GroupScheme.model_validate(W4A16)))
    assert predict_weight_bytes(shape, keep_down).total_bytes == plain + down_saving


def test_override_scheme_replaces_only_its_group() -> None:
    shape = shape_of(TINY)
    w8_attention_last = recipe(W4A16, overrides=[{"layers": [-1], "attention": W8A8}])
    base = predict_weight_bytes(shape, recipe(W4A16)).total_bytes
    w8, w4 = GroupScheme.model_validate(W8A8), GroupScheme.model_validate(W4A16)
    q_o = 2 * (linear_bytes(256, 256, w8) - linear_bytes(256, 256, w4))
    k_v = 2 * (linear_bytes(128, 256, w8) - linear_bytes(128, 256, w4))
    assert predict_weight_bytes(shape, w8_attention_last).total_bytes == base + q_o + k_v


# --- exact bytes from safetensors headers ---------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> int:
    """A valid safetensors file with the given (dtype, shape, nbytes); returns the data size."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * offset)
    return offset


def test_safetensors_bytes_sums_every_shard_without_reading_tensors(tmp_path: Path) -> None:
    first = write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", [4, 8], 64), "b": ("I8", [3], 3)})
    second = write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": ("I32", [2, 2], 16)})
    assert safetensors_bytes(tmp_path) == first + second == 83


def test_broken_safetensors_header_is_an_input_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(InputError, match="safetensors header"):
        safetensors_bytes(tmp_path)
    with pytest.raises(InputError, match=r"no \*\.safetensors"):
        safetensors_bytes(tmp_path / "missing")


# --- KV cache: sliding windows, quantized KV, vLLM's capacity ------------------------------------------


def test_sliding_window_layers_hold_at_most_the_window() -> None:
    mistral = shape_of(MISTRAL_7B)
    per_token = kv_cache_bytes_per_token(mistral, 2)
    assert kv_cache_bytes_for_context(mistral, 2, 2048) == 2048 * per_token
    assert kv_cache_bytes_for_context(mistral, 2, 32768) == 4096 * per_token


def test_layer_types_mix_sliding_and_full_layers() -> None:
    config = {**TINY, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2}
    shape = shape_of(config)
    per_layer = kv_cache_bytes_per_token(shape, 2) // 4
    assert kv_cache_bytes_for_context(shape, 2, 1000) == per_layer * (2 * 128 + 2 * 1000)


@pytest.mark.parametrize("extra, sliding_layers", [
    ({"sliding_window": 64, "use_sliding_window": False}, 0),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3}, 1),
    ({"sliding_window": 64, "sliding_window_pattern": 2}, 2),
    ({"sliding_window": None}, 0),
])
def test_sliding_window_config_variants(extra: dict, sliding_layers: int) -> None:
    shape = shape_of({**TINY, **extra})
    assert sum(window is not None for window in shape.windows) == sliding_layers


def test_quantized_kv_cache_from_config_or_flag_halves_the_cache() -> None:
    fp8 = {**TINY, "quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}}
    gpu = gpu_spec(memory_gib=8)
    sixteen = plan(TINY, [None], gpu, 1024, 1).rows[0]
    from_config = plan(fp8, [None], gpu, 1024, 1).rows[0]
    from_flag = plan(TINY, [None], gpu, 1024, 1, kv_cache_dtype="fp8").rows[0]
    for row in (from_config, from_flag):
        assert row.kv_cache_bytes_per_token * 2 == sixteen.kv_cache_bytes_per_token
        assert row.recommended.kv_cache_dtype == "fp8"


def test_kv_capacity_counts_blocks_like_vllm() -> None:
    # 2 KiB per token for the demo shape; 1 GiB holds 4096 blocks of 128 tokens.
    assert kv_capacity_tokens(TINY, GiB, block_size=128) == 524_288
    assert kv_capacity_tokens(TINY, GiB, block_size=128, max_model_len=512) == 524_288
    # A request of 500 tokens still takes 4 whole blocks: vLLM reports 1024 x 500.
    assert kv_capacity_tokens(TINY, GiB, block_size=128, max_model_len=500) == 512_000
    assert kv_capacity_tokens(TINY, GiB - 1, block_size=128) == 524_288 - 128


GEMMA3_270M = {  # the real Gemma 3 270M's text config (DESIGN.md): 15 sliding layers of 512 + 3 full, 1 KV head of 256
    "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262_144,
    "max_position_embeddings": 32_768, "sliding_window": 512, "sliding_window_pattern": 6, "dtype": "bfloat16",
}


def test_gemma3_270m_kv_capacity_is_what_vllm_logged() -> None:
    """Measured: vLLM CPU, 1 GiB, max_model_len 512 logged 48,198 tokens in six KV-cache groups, not the 58,254 that
    18 KiB per token gives. Six groups of 3 layers (5 sliding + 1 full) share one pool of 3 x 128 KiB blocks (2,730);
    a 512-token request takes 4 blocks per full group and 5 per sliding group (+1: a window rarely starts on a block)."""
    shape = shape_of(GEMMA3_270M)
    assert attention_summary(shape.windows) == "15 sliding (window 512) + 3 full"
    cache = vllm_kv_cache(shape, 2, GiB, block_size=128, max_model_len=512)
    assert [len(group.layers) for group in cache.groups] == [3] * 6
    assert [group.window for group in cache.groups] == [512] * 5 + [None]
    assert (cache.page_bytes, cache.block_bytes, cache.num_blocks) == (128 * 1024, 3 * 128 * 1024, 2730)
    assert cache.blocks_per_request == 5 * 5 + 4 and cache.tokens == 48_198
    assert GiB // kv_cache_bytes_per_token(shape, 2) == 58_254  # the naive figure
    assert kv_capacity_tokens(GEMMA3_270M, GiB, block_size=128, max_model_len=512) == 48_198


# What vLLM 0.32 CPU logged for each tiny family of tests/families.py (1 GiB, 128-token blocks, max_model_len 512):
# tests/integration/test_planner_vllm.py checks these against a live server.
FAMILY_KV_TOKENS = {
    "llama": (524_288, 1), "mistral": (419_430, 1), "qwen2": (524_288, 1), "qwen3": (349_440, 1),
    "gemma2": (310_670, 2), "gemma3": (294_319, 4), "phi3": (524_288, 1),
}


@pytest.mark.parametrize("family", FAMILY_KV_TOKENS)
def test_kv_capacity_of_every_family_is_what_vllm_logged(family: str) -> None:
    from families import family_config

    tokens, groups = FAMILY_KV_TOKENS[family]
    cache = vllm_kv_cache(shape_of(family_config(family)), 2, GiB, block_size=128, max_model_len=512)
    assert (cache.tokens, len(cache.groups)) == (tokens, groups)


@pytest.mark.parametrize("windows, group_layers", [
    ([None] * 4, [4]),                                   # one type: one group of every layer
    ([256] * 4, [4]),                                    # all sliding with one window: one group too
    ([128, None] * 2, [2, 2]),                           # Gemma 2: 2 + 2
    ([128] * 3 + [None], [1, 1, 1, 1]),                  # smallest bucket (1) sets the group size
    ([64] * 12 + [None] * 13, [12, 13]),                 # 13 < 1.5 x 12: the largest sets it (blocks of 13 pages)
    ([64] * 2 + [128] * 2 + [None] * 2, [2, 2, 2]),      # a bucket per window
])
def test_layers_are_grouped_as_vllm_groups_them(windows: list, group_layers: list) -> None:
    shape = shape_of({**TINY, "num_hidden_layers": len(windows), "sliding_window": 64,
                      "layer_types": ["full_attention"] * len(windows)}).model_copy(update={"windows": windows})
    cache = vllm_kv_cache(shape, 2, GiB, block_size=128, max_model_len=512)
    assert sorted(len(group.layers) for group in cache.groups) == sorted(group_layers)
    assert sorted(i for group in cache.groups for i in group.layers) == list(range(len(windows)))
    assert cache.block_bytes == max(group_layers) * cache.page_bytes


def test_a_sliding_layer_holds_its_window_plus_the_tokens_in_flight() -> None:
    mistral = shape_of(MISTRAL_7B)  # window 4096, every layer
    def blocks(**kw) -> int:
        return vllm_kv_cache(mistral, 2, 80 * GiB, block_size=16, **kw).blocks_per_request
    assert blocks(max_model_len=2048) == 2048 // 16 + 1  # the window is longer than the request: + 1 block
    assert blocks(max_model_len=32_768, in_flight_tokens=2048) == (4095 + 2048 + 15) // 16 + 1
    assert blocks(max_model_len=32_768, in_flight_tokens=2 * 8192) == (4095 + 16_384 + 15) // 16 + 1
    assert blocks(max_model_len=32_768, hybrid=False) == 32_768 // 16  # --disable-hybrid-kv-cache-manager


def test_plan_shows_which_layers_slide_and_the_kv_capacity_vllm_will_log() -> None:
    on_cpu = plan(GEMMA3_270M, [None], gpu_spec(memory_gib=16), 512, 1, target=parse_target("cpu"),
                  settings=PlanSettings(kv_space_bytes=GiB))
    assert on_cpu.attention == "15 sliding (window 512) + 3 full"
    assert on_cpu.rows[0].vllm_kv_tokens == 48_198
    assert "layers: 15 sliding (window 512) + 3 full" in plan_title(on_cpu)
    on_gpu = plan(TINY, [None], gpu_spec("L4"), 2048, 1).rows[0]  # KV space: what the row leaves at its utilization
    space = on_gpu.recommended.gpu_memory_utilization * gpu_spec("L4").memory_bytes - (on_gpu.total_bytes - on_gpu.kv_cache_bytes)
    assert on_gpu.vllm_kv_tokens == pytest.approx(space / on_gpu.kv_cache_bytes_per_token, rel=0.01)


# --- the plan: fit, search, recommendations, decode ceiling ----------------------------------------------


def test_70b_is_planned_from_config_alone() -> None:
    result = plan(LLAMA3_70B, [None, recipe(W4A16)], gpu_spec("H100-80GB"), 4096, 8)
    sixteen, w4 = result.rows
    assert (sixteen.fits, w4.fits) == (False, True)
    assert sixteen.recommended is None and sixteen.max_context == 0
    assert w4.weights_source == "predicted"


def test_totals_add_up_and_the_largest_fits_are_boundaries() -> None:
    gpu, settings = gpu_spec("RTX-4090"), PlanSettings()
    row = plan(LLAMA2_7B, [None], gpu, 2048, 4, settings=settings).rows[0]
    assert row.total_bytes == row.weights_bytes + row.kv_cache_bytes + row.activation_bytes + row.overhead_bytes
    assert row.kv_cache_bytes == 4 * 2048 * row.kv_cache_bytes_per_token
    assert row.available_bytes == int(gpu.memory_bytes * settings.max_gpu_memory_utilization)

    def total(context: int, concurrency: int) -> int:
        return plan(LLAMA2_7B, [None], gpu, context, concurrency).rows[0].total_bytes

    assert total(2048, row.max_concurrency) <= row.available_bytes < total(2048, row.max_concurrency + 1)
    assert row.max_context == 4096 or total(row.max_context, 4) <= row.available_bytes < total(row.max_context + 1, 4)


def test_recommendation_lowers_concurrency_when_the_request_does_not_fit() -> None:
    gpu = gpu_spec("RTX-4090")
    row = plan(LLAMA2_7B, [None], gpu, 4096, 64).rows[0]
    assert not row.fits and 1 <= row.max_concurrency < 64
    assert row.recommended.max_num_seqs == row.max_concurrency
    assert row.recommended.max_model_len == 4096
    assert 0.90 <= row.recommended.gpu_memory_utilization <= 0.95
    assert "--max-num-seqs" in row.recommended.vllm_args


def test_decode_ceiling_is_bandwidth_over_bytes_read_per_token() -> None:
    shape = shape_of(LLAMA2_7B)
    row = plan(LLAMA2_7B, [None], gpu_spec("H100-80GB"), 2048, 1).rows[0]
    weights = predict_weight_bytes(shape, None)
    read = weights.total_bytes - weights.embedding_bytes + kv_cache_bytes_for_context(shape, 2, 2048)
    assert row.decode_tokens_per_s == pytest.approx(3350e9 / read, abs=0.1)
    assert plan(LLAMA2_7B, [None], gpu_spec(memory_gib=80), 2048, 1).rows[0].decode_tokens_per_s is None


def test_artifact_rows_are_measured(tmp_path: Path) -> None:
    unquantized = tmp_path / "base"
    unquantized.mkdir()
    (unquantized / "config.json").write_text(json.dumps(TINY))
    size = write_safetensors(unquantized / "model.safetensors", {"w": ("BF16", [10], 1_000_000)})
    rows = plan(unquantized, [None, recipe(W8A8)], gpu_spec("T4"), 512, 1, artifact_dir=unquantized).rows
    assert [(r.scheme, r.weights_source) for r in rows] == [("16-bit", "measured"), ("test", "predicted")]
    assert rows[0].weights_bytes == size

    quantized = tmp_path / "tiny-w8a8"
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({**TINY, "quantization_config": {"format": "int-quantized"}}))
    write_safetensors(quantized / "model.safetensors", {"w": ("I8", [10], 500_000)})
    result = plan(quantized, [recipe(W8A8)], gpu_spec("T4"), 512, 1, artifact_dir=quantized)
    measured = result.rows[-1]
    assert (measured.scheme, measured.weights_source, measured.weights_bytes) == ("tiny-w8a8", "measured", 500_000)
    assert result.fit_row() is measured and measured.fits  # a fit requirement is judged by the measured row
    assert plan(quantized, [recipe(W8A8)], gpu_spec("T4"), 512, 1).fit_row().weights_source == "predicted"


# --- GPUs and bad input ---------------------------------------------------------------------------------


def test_gpu_names_and_aliases() -> None:
    assert {"T4", "L4", "RTX-4090", "A10", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "L40S", "MI300X"} <= set(known_gpus())
    assert gpu_spec("h100").name == gpu_spec("H100 80GB").name == "H100-80GB"
    assert gpu_spec("H100", bandwidth_gbs=1000).bandwidth_bytes_per_s == 1000 * 10**9
    custom = gpu_spec(memory_gib=24, bandwidth_gbs=936)
    assert (custom.memory_bytes, custom.bandwidth_bytes_per_s) == (24 * GiB, 936 * 10**9)


@pytest.mark.parametrize("kwargs, field", [
    ({"name": "B9000"}, "gpu"),
    ({"memory_gib": -1}, "gpu_memory_gib"),
    ({"memory_gib": float("nan")}, "gpu_memory_gib"),
    ({"memory_gib": 24, "bandwidth_gbs": 0}, "gpu_bandwidth_gbs"),
    ({}, "gpu"),
])
def test_bad_gpu_is_an_input_error(kwargs: dict, field: str) -> None:
    with pytest.raises(InputError) as caught:
        gpu_spec(**kwargs)
    assert caught.value.field == field
    if kwargs.get("name"):
        assert "H100-80GB" in caught.value.message  # the known names are listed


@pytest.mark.parametrize("config, field", [
    ({k: v for k, v in TINY.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    ({**TINY, "hidden_size": "big"}, "hidden_size"),
    ({**TINY, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({**TINY, "sliding_window": 64, "layer_types": ["sliding_attention"]}, "layer_types"),
    ({**TINY, "layer_types": ["sliding_attention"] * 4}, "sliding_window"),
    ({**TINY, "kv_lora_rank": 512}, "kv_lora_rank"),
])
def test_config_without_needed_fields_is_an_input_error(config: dict, field: str) -> None:
    with pytest.raises(InputError) as caught:
        plan(config, [None], gpu_spec("T4"), 512, 1)
    assert caught.value.field == field


@pytest.mark.parametrize("max_model_len, concurrency, field", [
    (0, 1, "max_model_len"), (512, -2, "concurrency"), (4096, 1, "max_model_len"),  # TINY allows 2048 tokens
])
def test_nonsense_sizes_are_input_errors(max_model_len: int, concurrency: int, field: str) -> None:
    with pytest.raises(InputError) as caught:
        plan(TINY, [None], gpu_spec("T4"), max_model_len, concurrency)
    assert caught.value.field == field


# --- the command line -------------------------------------------------------------------------------------


@pytest.fixture
def only_the_plan_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI with just `plan` registered, so these tests don't depend on the other commands' imports."""
    monkeypatch.setattr(cli, "COMMANDS", {"plan": cli.COMMANDS["plan"]})


@pytest.mark.usefixtures("only_the_plan_command")
def test_cli_json_has_the_promised_fields(capsys: pytest.CaptureFixture) -> None:
    code = cli.main(["plan", "--config", str(LLAMA3_8B), "--gpu", "L4", "--max-model-len", "4096", "--concurrency", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    row = out["rows"][0]
    assert {"weights_bytes", "kv_cache_bytes_per_token", "kv_cache_bytes", "total_bytes", "fits"} <= set(row)
    assert row["kv_cache_bytes"] == 2 * 4096 * row["kv_cache_bytes_per_token"]


@pytest.mark.usefixtures("only_the_plan_command")
def test_cli_table_names_every_scheme(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    recipe_file = tmp_path / "w4.yaml"
    recipe_file.write_text("name: w4\ngroups:\n  attention: {weights: {bits: 4, granularity: group, group_size: 128}}\n")
    argv = ["--config", str(MISTRAL_7B), "--recipe", str(recipe_file), "--gpu-memory-gib", "24", "--max-model-len", "8192"]
    code = cli.main(["plan", *argv])
    out = capsys.readouterr().out
    assert code == 0 and "16-bit" in out and "w4" in out and "--max-model-len 8192" in out


@pytest.mark.parametrize("argv", [
    ["plan", "--config", str(LLAMA2_7B), "--gpu", "B9000"],
    ["plan", "--config", str(LLAMA2_7B)],
    ["plan", "--config", str(LLAMA2_7B), "--gpu", "T4", "--concurrency", "0"],
    ["plan", "--config", "/nonexistent/config.json", "--gpu", "T4"],
    ["plan", "--artifact", str(CONFIGS / "llama-2-7b"), "--gpu", "T4"],
    ["plan", "--config", str(LLAMA2_7B), "--gpu-memory-gib", "-3"],
])
@pytest.mark.usefixtures("only_the_plan_command")
def test_cli_bad_input_exits_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert cli.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("quantize: error:") and "\n" not in error


# --- input bounds: every size finite, positive and far below what would hang or overflow -------------------


@pytest.mark.parametrize("change, field", [
    ({"num_hidden_layers": 20_000_000}, "num_hidden_layers"),  # used to loop over 20 M layers
    ({"num_hidden_layers": 2e7}, "num_hidden_layers"),
    ({"hidden_size": 10**30, "num_attention_heads": 1}, "hidden_size"),
    ({"vocab_size": 2**40}, "vocab_size"),
    ({"intermediate_size": 10**9}, "intermediate_size"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings"),
    ({"sliding_window": 10**12}, "sliding_window"),
    ({"sliding_window": 64, "sliding_window_pattern": "2"}, "sliding_window_pattern"),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": "a"}, "max_window_layers"),
    ({"quantization_config": {"kv_cache_scheme": {"num_bits": float("inf")}}}, "quantization_config.kv_cache_scheme.num_bits"),
    ({"num_local_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": "x"}, "shared_expert_intermediate_size"),
])
def test_absurd_config_sizes_are_input_errors(change: dict, field: str) -> None:
    with pytest.raises(InputError) as caught:
        plan({**TINY, **change}, [None], gpu_spec("T4"), 512, 1)
    assert caught.value.field == field


@pytest.mark.parametrize("max_model_len, concurrency, field", [(2**24 + 1, 1, "max_model_len"), (512, 10**30, "concurrency")])
def test_absurd_request_sizes_are_input_errors(max_model_len: int, concurrency: int, field: str) -> None:
    with pytest.raises(InputError) as caught:
        config = {key: value for key, value in TINY.items() if key != "max_position_embeddings"}  # no model limit
        plan(config, [None], gpu_spec("T4"), max_model_len, concurrency)
    assert caught.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    ({"memory_gib": 1e300}, "gpu_memory_gib"), ({"memory_gib": float("inf")}, "gpu_memory_gib"),
    ({"memory_gib": 24, "bandwidth_gbs": 1e300}, "gpu_bandwidth_gbs"), ({"name": 5}, "gpu"),
])
def test_absurd_gpus_are_input_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(InputError) as caught:
        gpu_spec(**kwargs)
    assert caught.value.field == field


@pytest.mark.parametrize("text, words", [
    (b'{"hidden_size": NaN}', "NaN is not a number JSON allows"),
    (b'{"hidden_size": Infinity}', "Infinity is not a number JSON allows"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deep"),
    (b'{"a": "\xff"}', "not UTF-8"),
])
def test_config_json_that_is_not_plain_json_is_an_input_error(tmp_path: Path, text: bytes, words: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(text)
    with pytest.raises(InputError, match=words) as caught:
        load_config(path)
    assert caught.value.file == str(path)


def test_an_oversized_config_or_safetensors_header_is_refused_unread(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_bytes(b'{"pad": "' + b"x" * (5 * 1024 * 1024) + b'"}')
    with pytest.raises(InputError, match="larger than 4 MiB"):
        load_config(config)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(InputError, match="not a readable safetensors header"):
        safetensors_bytes(tmp_path)


def test_a_config_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(TINY).encode())
    assert shape_of(path).layers == 4


@pytest.mark.usefixtures("only_the_plan_command")
@pytest.mark.parametrize("argv", [
    ["--gpu-memory-gib", "1e300"], ["--gpu-memory-gib", "inf"], ["--gpu", "T4", "--gpu-bandwidth-gbs", "nan"],
    ["--gpu", "T4", "--max-model-len", "0"], ["--gpu", "T4", "--max-model-len", "99999999999999999999"],
    ["--gpu", "T4", "--concurrency", "10000000000"], ["--gpu", "T4", "--overhead-gib", "inf"],
    ["--gpu", "T4", "--overhead-fraction", "nan"], ["--gpu", "T4", "--max-gpu-memory-utilization", "0"],
    ["--gpu", "T4", "--max-num-batched-tokens", "0"],
])
def test_cli_absurd_numbers_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["plan", "--config", str(LLAMA2_7B), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("quantize: error: quantize plan: argument ")
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize("change, field", [
    ({"num_hidden_layers": 20_000_000}, "num_hidden_layers"),
    ({"num_hidden_layers": 2e7}, "num_hidden_layers"),
    ({"hidden_size": float("nan")}, "hidden_size"),
    ({"rope_scaling": {"factor": float("inf")}}, "rope_scaling.factor"),
    ({"text_config": {"vocab_size": 2**40}}, "vocab_size"),
])
def test_config_bounds_for_any_reader(change: dict, field: str) -> None:
    from pipelines.bounds import check_config_bounds

    with pytest.raises(InputError) as caught:
        check_config_bounds({**TINY, **change}, "m/config.json")
    assert caught.value.field == field and caught.value.file == "m/config.json"


def test_config_bounds_accept_real_configs_with_absent_null_or_zero_sizes() -> None:
    from pipelines.bounds import check_config_bounds

    for path in (LLAMA2_7B, LLAMA3_8B, LLAMA3_70B, MISTRAL_7B):
        check_config_bounds(json.loads(path.read_text()))
    check_config_bounds({**TINY, "sliding_window": None, "num_experts": 0, "use_sliding_window": False})


# --- recipes that cannot apply to the model ----------------------------------------------------------------

SMOLLM2 = {  # models/smollm2-135m's config.json, the sizes that matter
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "model_type": "llama", "dtype": "bfloat16",
}
W4_AUTO = {"weights": {"bits": 4, "granularity": "group", "group_size": "auto"}}


def test_a_recipe_that_cannot_apply_is_marked_with_the_reason_not_fits() -> None:
    gpu = gpu_spec("L4")
    result = plan(SMOLLM2, [None, recipe(W4_AUTO), recipe(W4A16)], gpu, 2048, 1)
    sixteen, auto, fixed = result.rows
    assert sixteen.does_not_apply is None and auto.does_not_apply is None and auto.fits and auto.recommended is not None
    assert fixed.does_not_apply == (
        "groups.attention.weights.group_size: group_size 128 does not divide the input size 576 of "
        "model.layers.0.self_attn.q_proj; 64, 32 would; write `group_size: 64` or `group_size: auto`"
    )
    assert fixed.fits is False and fixed.recommended is None
    assert fixed.weights_bytes > 0  # the memory is still estimated, for what it is worth


def test_auto_group_sizes_are_counted_per_layer() -> None:
    shape = shape_of(SMOLLM2)
    w4 = lambda size: GroupScheme.model_validate({"weights": {"bits": 4, "granularity": "group", "group_size": size}})  # noqa: E731
    per_layer = (
        linear_bytes(576, 576, w4(64)) * 2 + linear_bytes(192, 576, w4(64)) * 2  # q, o; k, v
        + linear_bytes(1536, 576, w4(64)) * 2 + linear_bytes(576, 1536, w4(128))  # gate, up; down
    )
    w4_64 = {"weights": {"bits": 4, "granularity": "group", "group_size": 64}}
    kept = predict_weight_bytes(shape, recipe(w4_64, overrides=[{"match": ".", "keep": True}]))
    assert predict_weight_bytes(shape, recipe(W4_AUTO)).total_bytes == kept.total_bytes - 30 * (
        sum(linear_bytes(o, i, None) for o, i in [(576, 576)] * 2 + [(192, 576)] * 2 + [(1536, 576)] * 2 + [(576, 1536)]) - per_layer
    )


@pytest.mark.parametrize(("override", "words"), [
    ({"layers": [30], "keep": True}, "layer 30 does not exist"),
    ({"match": "q_proj", "keep": True}, "q_proj/k_proj/v_proj"),
])
def test_other_compiler_refusals_also_mean_does_not_apply(override: dict, words: str) -> None:
    (row,) = plan(SMOLLM2, [recipe(W4_AUTO, overrides=[override])], gpu_spec("L4"), 2048, 1).rows
    assert row.does_not_apply is not None and words in row.does_not_apply


def test_the_demo_shape_still_fits_every_shipped_recipe() -> None:
    from pipelines.recipe import load_recipe

    rows = plan(TINY, [load_recipe(name).recipe for name in ("w8a8", "w4a16", "gptq", "aggressive")], gpu_spec("L4"), 2048, 1).rows
    assert [(row.scheme, row.does_not_apply, row.fits) for row in rows] == [
        ("w8a8", None, True), ("w4a16", None, True), ("gptq", None, True), ("aggressive", None, True),
    ]


def config_and_recipe(folder: Path, config: dict, recipe_name: str, groups: str) -> tuple[Path, Path]:
    """A config.json and a recipe file `recipe_name`.yaml with `groups` (YAML lines under `groups:`)."""
    (folder / "config.json").write_text(json.dumps(config))
    (folder / f"{recipe_name}.yaml").write_text(f"name: {recipe_name}\ngroups:\n{groups}")
    return folder / "config.json", folder / f"{recipe_name}.yaml"


@pytest.mark.usefixtures("only_the_plan_command")
def test_cli_prints_does_not_apply_and_why(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config, fixed = config_and_recipe(tmp_path, SMOLLM2, "g128", "  attention: {weights: {bits: 4, granularity: group, group_size: 128}}\n")
    code = cli.main(["plan", "--config", str(config), "--recipe", "w4a16", str(fixed), "--gpu", "L4", "--max-model-len", "2048"])
    out = capsys.readouterr().out
    assert code == 0
    assert "does not" in out and "apply" in out  # the fits cell (the table may wrap it)
    assert "g128: does not apply: groups.attention.weights.group_size: group_size 128 does not divide" in out.replace("\n", " ")
    assert "w4a16: vllm serve ... --gpu-memory-utilization" in out
    code = cli.main(["plan", "--config", str(config), "--recipe", str(fixed), "--gpu", "L4", "--max-model-len", "2048", "--json"])
    (_, row) = json.loads(capsys.readouterr().out)["rows"]
    assert code == 0 and row["fits"] is False and "64, 32 would" in row["does_not_apply"]


# --- serve targets: a plan for a GPU checks recipes against that GPU's kernels ---------------------------------

W8A16 = {"weights": {"bits": 8, "granularity": "channel"}}


def test_a_plan_for_a_known_gpu_checks_recipes_for_its_compute_capability() -> None:
    on_l4 = plan(TINY, [None, recipe(W8A16)], gpu_spec("L4"), 2048, 1)
    assert on_l4.target == "cuda:8.9" and on_l4.rows[1].does_not_apply is None and on_l4.rows[1].fits
    on_v100 = plan(TINY, [recipe(W4A16)], gpu_spec("V100"), 2048, 1)
    assert on_v100.target == "cuda:7.0" and "compute capability 7.5" in (on_v100.rows[0].does_not_apply or "")


def test_a_gpu_given_by_size_checks_the_installed_target_unless_told() -> None:
    by_size = plan(TINY, [recipe(W8A16)], gpu_spec(memory_gib=24), 2048, 1)
    assert by_size.target == "cpu:avx512bf16" and "4 bits only" in (by_size.rows[0].does_not_apply or "")
    told = plan(TINY, [recipe(W8A16)], gpu_spec(memory_gib=24), 2048, 1, target=parse_target("cuda:8.0"))
    assert told.target == "cuda:8.0" and told.rows[0].does_not_apply is None
    assert plan(TINY, [None], gpu_spec(memory_gib=24), 2048, 1).target is None  # nothing to check


@pytest.mark.usefixtures("only_the_plan_command")
def test_cli_plan_target(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config, w8a16 = config_and_recipe(tmp_path, TINY, "w8a16", "  attention: {weights: {bits: 8}}\n  mlp: {weights: {bits: 8}}\n")
    argv = ["plan", "--config", str(config), "--recipe", str(w8a16), "--gpu-memory-gib", "24", "--max-model-len", "2048"]
    assert cli.main([*argv, "--target", "cuda:8.9"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "recipes checked for cuda:8.9" in out and "w8a16: vllm serve ..." in out
    assert cli.main([*argv, "--target", "tpu"]) == 2
    assert "target: unknown serve target 'tpu'" in capsys.readouterr().err


# --- families: what each family's checkpoint holds, from config.json alone -----------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_16_bit_bytes_are_two_per_parameter_of_each_family(family: str) -> None:
    """Qwen2's q/k/v biases, q/k norms (Qwen3, Gemma 3), Gemma's four norms per layer, a head_dim that is not
    hidden / heads, tied embeddings counted once, Phi-3's fused qkv_proj and gate_up_proj: the meta model's own count."""
    import torch
    from families import family_config
    from transformers import AutoConfig, AutoModelForCausalLM

    config = family_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    parameters = sum(p.numel() for p in model.parameters())  # a tied table once
    assert predict_weight_bytes(shape_of(config), None).total_bytes == 2 * parameters


@pytest.mark.parametrize("model_type, head_dim, tied", [
    ("llama", 64, False), ("qwen3", 128, False), ("gemma", 256, True), ("gemma2", 256, True), ("gemma3_text", 256, True),
])
def test_fields_config_json_leaves_out_take_the_family_default(model_type: str, head_dim: int, tied: bool) -> None:
    config = {k: v for k, v in TINY.items() if k != "head_dim"} | {"model_type": model_type}
    shape = shape_of(config)
    assert (shape.head_dim, shape.tied_embeddings) == (head_dim, tied)
    assert shape_of({**config, "head_dim": None}).head_dim == head_dim  # written as null: the same


@pytest.mark.parametrize("config, field, words", [
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}, "model_type", "'gpt2' is not a decoder family the planner can count"),
    ({**TINY, "model_type": "gpt_neox"}, "model_type", "'gpt_neox' is not a decoder family"),
    ({"model_type": "t5", "d_model": 64, "is_encoder_decoder": True}, "is_encoder_decoder", "is an encoder-decoder model"),
    ({k: v for k, v in TINY.items() if k != "model_type"}, "model_type", "missing: the planner counts bytes by family"),
])
def test_an_architecture_the_planner_cannot_count_is_refused(config: dict, field: str, words: str) -> None:
    with pytest.raises(InputError) as caught:
        plan(config, [None], gpu_spec("T4"), 512, 1)
    assert caught.value.field == field and words in caught.value.message


def test_a_mixture_of_experts_plans_at_16_bits_and_refuses_recipes() -> None:
    moe = {**TINY, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2}
    assert plan(moe, [None], gpu_spec("T4"), 512, 1).rows[0].fits
    with pytest.raises(InputError) as caught:
        plan(moe, [None, recipe(W4A16)], gpu_spec("T4"), 512, 1)
    assert caught.value.message.startswith("MixtralForCausalLM (mixtral) is a mixture-of-experts model (8 experts per layer)")
