"""The shape probe without the serve environment: the model's Linear shapes as vLLM fuses them (every family, against
hand-computed values), the schemes they get from a recipe or an artifact, the working set's copies, the cache key, the
sum of per-shape timings into the model's ratio on known numbers, and `doctor --model`'s bad input.

The probe itself runs in the serve environment (tests/integration/test_hardware_e2e.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from families import FAMILIES, family_config

from pipelines.errors import InputError
from pipelines.hardware import host, shape_probe
from pipelines.hardware.host import HostProfile, LastLevelCache, last_level_cache
from pipelines.hardware.kernels import KernelCase
from pipelines.hardware.prediction import ShapePrediction, ShapeTiming, direction_of, predict_for_artifact, predict_for_recipe
from pipelines.hardware.shape_probe import PREFILL_ROWS, ShapeCase, decode_rows, shape_facts
from pipelines.hardware.shapes import (
    LLC_MULTIPLE,
    MEMORY_CAP_BYTES,
    VllmLinear,
    artifact_linear_cases,
    copies_for,
    recipe_cases,
    vllm_linears,
)
from pipelines.planner.shape import model_shape
from pipelines.planner.weights import decoder_linears, linear_schemes
from pipelines.recipe import GroupScheme, load_recipe

PROFILE = HostProfile(host_class="cpu:avx512bf16", library="_C", serve_dtype="bfloat16", dtype_reason="", fingerprint="f" * 16,
                      vllm_version="0.32.0")
MiB = 2**20
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}


def linears_of(config: dict) -> list:
    shape = model_shape(config)
    return [linear for layer in range(shape.layers) for linear in decoder_linears(shape, layer)]


def shapes_of(config: dict) -> dict[str, tuple[int, int, bool, int]]:
    return {use.linear.name: (use.linear.in_features, use.linear.out_features, use.linear.bias, use.layers)
            for use in vllm_linears(linears_of(config), {})}


# hidden 256, intermediate 512, 4 heads, 2 KV heads, 4 layers (tests/families.py); head_dim 64 unless the family says
# 96: QKV out = (4 + 2 x 2) x head_dim, o_proj in = 4 x head_dim, gate_up out = 2 x 512.
EXPECTED_HEAD_DIM = {"llama": 64, "mistral": 64, "qwen2": 64, "qwen3": 96, "gemma2": 96, "gemma3": 96, "phi3": 64}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_four_linears_a_layer_as_vllm_fuses_them(family: str) -> None:
    head = EXPECTED_HEAD_DIM[family]
    assert shapes_of(family_config(family)) == {
        "qkv_proj": (256, 8 * head, family == "qwen2", 4),  # Qwen2's q/k/v carry biases
        "o_proj": (4 * head, 256, False, 4),
        "gate_up_proj": (256, 1024, False, 4),
        "down_proj": (512, 256, False, 4),
    }


def test_smollm2_shapes_by_hand() -> None:
    uses = vllm_linears(linears_of(SMOLLM2), {})
    assert {use.linear.name: (use.linear.in_features, use.linear.out_features, use.layers) for use in uses} == {
        "qkv_proj": (576, (9 + 2 * 3) * 64, 30), "o_proj": (576, 576, 30), "gate_up_proj": (576, 3072, 30), "down_proj": (1536, 576, 30)}
    assert uses[0].linear.shards == ("q_proj", "k_proj", "v_proj") and uses[2].linear.shards == ("gate_proj", "up_proj")


def test_phi3s_checkpoint_is_fused_already() -> None:
    uses = vllm_linears(linears_of(family_config("phi3")), {})
    assert [use.linear.shards for use in uses] == [("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",)]


def test_w8a8_gives_attention_dynamic_and_the_mlp_static_activations() -> None:
    linears = linears_of(SMOLLM2)
    uses = vllm_linears(linears, recipe_cases(linears, linear_schemes(model_shape(SMOLLM2), load_recipe("w8a8").recipe)))
    keys = {use.linear.name: use.case.key for use in uses if use.case}
    assert keys == {"qkv_proj": "w8i-ch-sym/a8i-token-dyn-sym", "o_proj": "w8i-ch-sym/a8i-token-dyn-sym",
                    "gate_up_proj": "w8i-ch-sym/a8i-tensor-static-sym", "down_proj": "w8i-ch-sym/a8i-tensor-static-sym"}


def test_group_size_auto_is_each_linears_own() -> None:
    linears = linears_of(SMOLLM2)
    cases = recipe_cases(linears, linear_schemes(model_shape(SMOLLM2), load_recipe("w4a16").recipe))
    uses = {use.linear.name: use.case for use in vllm_linears(linears, cases)}
    assert uses["qkv_proj"] and uses["qkv_proj"].weights.group_size == 64  # 576 inputs: 128 does not divide
    assert uses["down_proj"] and uses["down_proj"].weights.group_size == 128  # 1536 inputs


def test_an_override_splits_a_shape_by_layers() -> None:
    recipe = load_recipe("w8a8").recipe.model_copy(update={"overrides": []})
    recipe = type(recipe).model_validate({**recipe.model_dump(), "overrides": [{"layers": [0, -1], "keep": True}]})
    linears = linears_of(SMOLLM2)
    uses = vllm_linears(linears, recipe_cases(linears, linear_schemes(model_shape(SMOLLM2), recipe)))
    down = [(use.case is None, use.layers) for use in uses if use.linear.name == "down_proj"]
    assert sorted(down) == [(False, 28), (True, 2)]


def artifact(tmp_path: Path, groups: dict, ignore: list[str] | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": groups, "ignore": ignore or ["lm_head"]}}))
    return tmp_path


W8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
DYNAMIC = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}


def test_an_artifacts_groups_are_matched_as_compressed_tensors_matches_them(tmp_path: Path) -> None:
    folder = artifact(tmp_path, {"attention": {"targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"], "weights": W8, "input_activations": DYNAMIC},
                                 "mlp": {"targets": [r"re:.*mlp\.(gate|up|down)_proj$"], "weights": {**W8, "num_bits": 4, "strategy": "group",
                                                                                                       "group_size": 64}}},
                      ignore=["lm_head", "model.layers.0.mlp.down_proj"])
    linears = linears_of(SMOLLM2)
    cases = artifact_linear_cases(folder / "config.json", [linear.name for linear in linears])
    assert cases["model.layers.3.self_attn.q_proj"] == KernelCase.model_validate({"weights": {"bits": 8}, "activations": {}})
    assert cases["model.layers.3.mlp.up_proj"] and cases["model.layers.3.mlp.up_proj"].key == "w4i-g64-sym/a16"
    assert cases["model.layers.0.mlp.down_proj"] is None  # ignored: kept in 16 bits
    downs = {use.case.key if use.case else None: use.layers for use in vllm_linears(linears, cases) if use.linear.name == "down_proj"}
    assert downs == {None: 1, "w4i-g64-sym/a16": 29}


def test_fused_shards_with_different_schemes_are_refused(tmp_path: Path) -> None:
    folder = artifact(tmp_path, {"q": {"targets": [r"re:.*q_proj$"], "weights": W8, "input_activations": DYNAMIC},
                                 "rest": {"targets": ["Linear"], "weights": W8}})
    linears = linears_of(SMOLLM2)
    with pytest.raises(InputError, match="one qkv_proj Linear"):
        vllm_linears(linears, artifact_linear_cases(folder / "config.json", [linear.name for linear in linears]))


def test_a_16_bit_model_is_no_artifact(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    with pytest.raises(InputError, match="config_groups"):
        predict_for_artifact(linears_of(SMOLLM2), tmp_path, 16, profile=PROFILE)


# ------------------------------------------------------------------------------------ the working set


def test_copies_follow_the_models_working_set() -> None:
    llc = 32 * MiB
    assert copies_for(6 * MiB, MiB // 4, llc) == 24  # the demo model fits the cache: its own bytes, in cache
    assert copies_for(212 * MiB, MiB, llc) == LLC_MULTIPLE * 32  # SmolLM2 does not: twice the cache
    assert copies_for(40 * MiB, MiB, llc) == 40  # just above the cache: the model's own bytes, past it
    assert copies_for(100 * 2**30, 2 * 2**30, llc) == 1  # one copy larger than the cap: one
    assert copies_for(100 * 2**30, MiB, 2**30) == MEMORY_CAP_BYTES // MiB  # a huge cache: the memory cap


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    for index, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                                  (3, "Unified", "32768K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    assert last_level_cache(tmp_path) == LastLevelCache(level=3, bytes=32 * MiB, source="sysfs")


def test_decode_rows_reach_max_num_seqs() -> None:
    assert decode_rows(16) == [1, 2, 4, 8, 16]
    assert decode_rows(12) == [1, 2, 4, 8, 12]
    assert decode_rows(1) == [1]
    assert decode_rows(10_000)[-1] == 256


# ------------------------------------------------------------------------------------ the cache


LINEAR = VllmLinear(name="qkv_proj", shards=("q_proj", "k_proj", "v_proj"), kind="attention", in_features=576, out_features=960)
INT8 = KernelCase.model_validate({"weights": {"bits": 8}, "activations": {}})


def test_the_cache_key_holds_shape_scheme_copies_and_rows() -> None:
    case = ShapeCase(linear=LINEAR, case=INT8, copies_quant=8, copies_base=4, rows=(1, 2, 256))
    assert case.key == "576x960/w8i-ch-sym/a8i-token-dyn-sym/n8-4/r1-2-256"
    others = [case.model_copy(update=change) for change in (
        {"linear": LINEAR.model_copy(update={"bias": True})}, {"case": None}, {"copies_quant": 9}, {"rows": (1, 256)})]
    assert len({case.key, *(other.key for other in others)}) == 5
    assert case.probe_request()["config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    assert ShapeCase(linear=LINEAR, case=None, copies_quant=1, copies_base=1, rows=(1,)).probe_request()["config"] is None


@pytest.fixture
def fake_shape_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict]:
    """The serve environment answered with 2 ms per 16-bit call and 1 ms per quantized call at every row count."""
    calls: list[dict] = []

    def run_probe(request: dict, *, timeout_s: float) -> dict:
        calls.append(request)
        ms = {str(rows): 1.0 for rows in request["shape_rows"]}
        return {"shape_cases": {case["key"]: {"scheme": "S", "kernel": "K", "quant_ms": ms, "base_ms": dict.fromkeys(ms, 2.0),
                                              "fresh_ms": {"quant": 3.0, "base": 2.0}} for case in request["shape_cases"]}}

    monkeypatch.setattr(shape_probe, "run_probe", run_probe)
    monkeypatch.setattr(shape_probe, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr("pipelines.hardware.prediction.last_level_cache", lambda: LastLevelCache(level=3, bytes=32 * MiB, source="sysfs"))
    monkeypatch.setattr("pipelines.hardware.prediction.serve_threads", lambda: 1)
    return calls


def test_a_model_is_probed_once_per_host_vllm_dtype_and_threads(fake_shape_probe: list[dict]) -> None:
    case = ShapeCase(linear=LINEAR, case=INT8, copies_quant=8, copies_base=4, rows=(1, 256))
    facts, seconds = shape_facts(PROFILE, [case], dtype="bfloat16", threads=1)
    assert facts[case.key].quant_ms == {"1": 1.0, "256": 1.0} and seconds >= 0 and len(fake_shape_probe) == 1
    assert fake_shape_probe[0]["threads"] == 1 and fake_shape_probe[0]["dtype"] == "bfloat16"
    assert shape_facts(PROFILE, [case], dtype="bfloat16", threads=1) == (facts, 0.0) and len(fake_shape_probe) == 1
    shape_facts(PROFILE, [case], dtype="float32", threads=1)
    shape_facts(PROFILE, [case], dtype="bfloat16", threads=2)
    shape_facts(PROFILE.model_copy(update={"vllm_version": "0.33.0"}), [case], dtype="bfloat16", threads=1)
    shape_facts(PROFILE.model_copy(update={"fingerprint": "e" * 16}), [case], dtype="bfloat16", threads=1)
    assert len(fake_shape_probe) == 5


def test_a_recipe_prediction_probes_each_distinct_shape_once(fake_shape_probe: list[dict]) -> None:
    linears = linears_of(SMOLLM2)
    prediction = predict_for_recipe(linears, linear_schemes(model_shape(SMOLLM2), load_recipe("w8a8").recipe), 16, model="smol",
                                    recipe="w8a8", profile=PROFILE)
    assert len(fake_shape_probe[0]["shape_cases"]) == 4 and fake_shape_probe[0]["shape_rows"] == [1, 2, 4, 8, 16, PREFILL_ROWS]
    # 212 MiB of bf16 weights, 106 MiB in int8: both past the 32 MiB cache, so each shape's copies fill twice the cache
    qkv = fake_shape_probe[0]["shape_cases"][0]
    assert qkv["copies"] == {"quant": -(-64 * MiB // (576 * 960)), "base": -(-64 * MiB // (576 * 960 * 2))}
    assert prediction.working_set == {"base": 30 * 2 * 3_538_944, "quant": 30 * 3_538_944}
    assert prediction.decode_speeds == {1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0} and prediction.direction(100, 10, 4) == "faster"
    assert prediction.fresh_rows_ms == {"base": 4 * 30 * 2.0, "quant": 4 * 30 * 3.0}


# ------------------------------------------------------------------------------------ the model-level ratio


def timing(name: str, layers: int, base: dict[int, float], quant: dict[int, float]) -> ShapeTiming:
    linear = LINEAR.model_copy(update={"name": name})
    return ShapeTiming(linear=linear, layers=layers, case_key="k", scheme_label="s", copies={"quant": 1, "base": 1}, base_ms=base,
                       quant_ms=quant)


def prediction(*shapes: ShapeTiming) -> ShapePrediction:
    return ShapePrediction(model="m", source="w8a8", host_class="cpu:avx512bf16", cpu_model="", serve_dtype="bfloat16", vllm_version="",
                           threads=1, llc=LastLevelCache(level=3, bytes=32 * MiB, source="sysfs"), working_set={"base": 0, "quant": 0},
                           max_num_seqs=4, decode_rows=[1, 2, 4], prefill_rows=256, shapes=list(shapes), probe_seconds=0.0)


# Two shapes: attention (2 layers) and MLP (2 layers), ms per call at 1, 2, 4 rows and the 256-row chunk.
KNOWN = prediction(
    timing("qkv_proj", 2, {1: 1.0, 2: 1.0, 4: 2.0, 256: 10.0}, {1: 2.0, 2: 2.0, 4: 2.0, 256: 5.0}),
    timing("gate_up_proj", 2, {1: 3.0, 2: 3.0, 4: 4.0, 256: 30.0}, {1: 2.0, 2: 2.0, 4: 4.0, 256: 15.0}),
)


def test_the_models_linear_time_is_the_sum_over_shapes_and_layers() -> None:
    assert KNOWN.linear_ms(1, quantized=False) == 2 * 1.0 + 2 * 3.0 == 8.0
    assert KNOWN.linear_ms(1, quantized=True) == 2 * 2.0 + 2 * 2.0 == 8.0
    assert KNOWN.speed(1) == 1.0 and KNOWN.speed(4) == (2 * 2 + 2 * 4) / (2 * 2 + 2 * 4) == 1.0
    assert KNOWN.prefill_speed == (2 * 10 + 2 * 30) / (2 * 5 + 2 * 15) == 2.0
    assert KNOWN.linear_ms(3, quantized=False) == (8.0 + 12.0) / 2  # between the probed batches 2 and 4
    assert KNOWN.linear_ms(9, quantized=False) == 12.0  # above max_num_seqs: the server batches at most that many


def test_a_workloads_ratio_weights_prefill_and_decode_by_time() -> None:
    # 512 prompt tokens = 2 chunks; 40 output tokens at concurrency 4 = 10 decode steps at batch 4
    found = KNOWN.workload(prompt_tokens=512, output_tokens=40, concurrency=4)
    assert found is not None
    base, quant = 2 * 80.0 + 10 * 12.0, 2 * 40.0 + 10 * 12.0
    assert found.throughput_ratio == pytest.approx(base / quant) and found.linear_time_ratio == pytest.approx(quant / base)
    assert found.prefill_share == pytest.approx(160 / 280) and found.direction == "faster" and found.decode_batch == 4
    assert KNOWN.throughput_ratio(0, 40, 16) == pytest.approx(1.0) and KNOWN.direction(0, 40, 16) == "no difference within ±10%"
    assert KNOWN.throughput_ratio(0, 0, 1) is None and KNOWN.throughput_ratio(10, 10, 0) is None


def test_a_shape_that_was_not_timed_makes_no_prediction() -> None:
    broken = prediction(timing("qkv_proj", 2, {}, {}).model_copy(update={"error": "RuntimeError: no kernel"}))
    assert broken.error == "qkv_proj: RuntimeError: no kernel"
    assert broken.speed(1) is None and broken.throughput_ratio(100, 10, 1) is None


@pytest.mark.parametrize(("speed", "direction"), [(1.2, "faster"), (1.1, "no difference within ±10%"), (0.95, "no difference within ±10%"),
                                                  (0.89, "slower")])
def test_the_direction_has_a_band_of_ten_percent(speed: float, direction: str) -> None:
    assert direction_of(speed) == direction


# ------------------------------------------------------------------------------------ doctor --model


@pytest.mark.parametrize(("args", "field"), [
    (["--model", "{tmp}"], "--model"),  # a folder with no config.json
    (["--model", "{model}", "--recipe", "no-such-recipe"], "--recipe"),
    (["--recipe", "w8a8"], "--recipe"),  # a recipe without a model
    (["--model", "{model}", "--target", "cpu"], "--model"),
])
def test_doctor_model_refuses_bad_input_naming_the_option(args: list[str], field: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines import cli

    monkeypatch.setattr("pipelines.commands.doctor.diagnose", lambda target: pytest.fail("nothing is probed on bad input"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    code = cli.main(["doctor", *(arg.format(tmp=tmp_path, model=model) for arg in args)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and field in err, err


def test_serve_threads_leave_vllm_its_scheduler_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert host.serve_threads() == 1
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert host.serve_threads() == 1
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert host.serve_threads() == 7


def test_recipe_cases_refuse_an_auto_group_that_does_not_divide() -> None:
    scheme = GroupScheme.model_validate({"weights": {"bits": 4, "granularity": "group", "group_size": {"auto": 4}}})
    odd = linears_of({**SMOLLM2, "hidden_size": 575, "head_dim": 64})[:1]
    with pytest.raises(InputError, match="group_size auto"):
        recipe_cases(odd, {odd[0].name: scheme})
