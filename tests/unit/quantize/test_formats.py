"""FP8 schemes and the KV cache's precision: the recipe vocabulary, what it compiles to, the written rules per target,
the kernel probe's cases, what the planner counts and what the server is started with. No servers (fakes only)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import answered_probe

from pipelines import artifact
from pipelines.artifact import KvCacheRecord, served_kv_cache_dtype
from pipelines.errors import InputError
from pipelines.hardware import probe_rules
from pipelines.hardware.kernels import KernelCase, KvCase, checkpoint_format, kernel_facts
from pipelines.hardware.targets import Layer, ServeTarget, kv_cache_problem, parse_target, serve_problem
from pipelines.paths import DEMO_MODEL_DIR
from pipelines.planner import gpu_spec, plan
from pipelines.planner.shape import load_config, model_shape
from pipelines.planner.weights import linear_bytes, predict_weight_bytes
from pipelines.quantize.compiler import KV_CACHE_SCHEME, compile_recipe, scheme_summary
from pipelines.quantize.layout import layout_from_model_dir
from pipelines.recipe import GroupScheme, KvCache, Recipe, load_recipe, parse_recipe
from pipelines.serve import serving

FP8 = {"weights": {"bits": 8, "type": "float", "granularity": "channel"},
       "activations": {"type": "float", "granularity": "token", "dynamic": True}}
FP8_BLOCK = {"weights": {"bits": 8, "type": "float", "granularity": "block"},
             "activations": {"type": "float", "granularity": "group", "group_size": 128, "dynamic": True}}
FP8_WEIGHT_ONLY = {"weights": {"bits": 8, "type": "float", "granularity": "channel"}}
TINY = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096, "model_type": "llama", "dtype": "bfloat16"}


def group(data: dict) -> GroupScheme:
    return GroupScheme.model_validate(data)


def problem_field(scheme: dict, target: str, layer: Layer | None = None) -> str | None:
    found = serve_problem(group(scheme), parse_target(target), layer)
    return None if found is None else found.field


@pytest.fixture(scope="module")
def demo_layout():
    return layout_from_model_dir(DEMO_MODEL_DIR)


# --- the vocabulary ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "field", "words"), [
    ("groups: {attention: {weights: {type: float, bits: 4}}}", "groups.attention.weights", "bits must be 8"),
    ("groups: {attention: {weights: {type: float, symmetric: false}}}", "groups.attention.weights", "symmetric"),
    ("groups: {attention: {weights: {granularity: block}}}", "groups.attention.weights", "type: float"),
    ("groups: {attention: {weights: {type: float, block: [128, 128]}}}", "groups.attention.weights", "granularity 'block'"),
    ("groups: {attention: {weights: {type: float}, activations: {type: float, granularity: group}}}", "groups.attention.activations",
     "needs group_size"),
    ("groups: {attention: {weights: {type: float}, activations: {type: float, granularity: group, group_size: 128, dynamic: false}}}",
     "groups.attention.activations", "static"),
    ("kv_cache: fp9", "kv_cache.dtype", "vLLM 0.32 knows"),
    ("kv_cache: turboquant_k8v4", "kv_cache.dtype", "does not count or serve yet"),
    ("kv_cache: {dtype: fp8_e5m2, scales: calibrated}", "kv_cache", "calibrated KV scales are FP8 E4M3"),
    ("kv_cache: {dtype: fp8, scales: calibrated}", "(top level)", "calibrated KV scales"),
    ("kv_cache: {dtype: fp8, scales: online}", "kv_cache.scales", "dynamic"),
    ("kv_cache: 8", "kv_cache.dtype", "is a string"),
])
def test_bad_fp8_and_kv_fields_are_refused_in_one_line_naming_the_field(text: str, field: str, words: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_recipe(f"name: x\n{text}\n", "x.yaml")
    assert caught.value.field == field and words in caught.value.message
    assert "\n" not in str(caught.value)


def test_kv_cache_short_form_aliases_and_default() -> None:
    assert parse_recipe("name: x\nkv_cache: FP8\n", "x.yaml").kv_cache == KvCache(dtype="fp8", scales="dynamic")
    assert parse_recipe("name: x\nkv_cache: bf16\n", "x.yaml").kv_cache.vllm_dtype == "bfloat16"
    recipe = load_recipe("w8a8").recipe
    assert recipe.kv_cache == KvCache() and recipe.kv_cache.dtype == "auto" and not recipe.kv_cache.quantized
    with pytest.raises(InputError, match="quantizes nothing"):
        parse_recipe("name: x\nkv_cache: auto\n", "x.yaml")


def test_a_kv_only_recipe_quantizes_no_weights_and_needs_calibration_only_when_calibrated() -> None:
    kv_only = load_recipe("kv-fp8").recipe
    assert not kv_only.quantizes_weights and not kv_only.needs_calibration
    assert load_recipe("fp8-kv").recipe.needs_calibration and not load_recipe("fp8").recipe.needs_calibration


# --- compiled for llm-compressor ---------------------------------------------------------------------------------


def test_fp8_compiles_to_float_schemes_data_free(demo_layout) -> None:
    compiled = compile_recipe(load_recipe("fp8").recipe, demo_layout, "fp8.yaml", parse_target("cuda:8.9"))
    modifier = compiled.llmcompressor["quant_stage"]["quant_modifiers"]["QuantizationModifier"]
    attention = modifier["config_groups"]["attention"]
    assert attention["weights"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    assert attention["input_activations"]["type"] == "float" and attention["input_activations"]["strategy"] == "token"
    assert "kv_cache_scheme" not in modifier and not compiled.needs_calibration
    assert set(compiled.layers.values()) == {"16-bit", "w-fp8 channel sym / a-fp8 token dynamic"}


def test_block_fp8_carries_its_block_and_activation_groups(demo_layout) -> None:
    compiled = compile_recipe(load_recipe("fp8-block").recipe, demo_layout, "fp8-block.yaml", parse_target("cuda:9.0"))
    mlp = compiled.llmcompressor["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["config_groups"]["mlp"]
    assert mlp["weights"]["block_structure"] == [128, 128] and mlp["weights"]["strategy"] == "block"
    assert mlp["input_activations"]["group_size"] == 128 and mlp["input_activations"]["strategy"] == "group"
    assert scheme_summary(group(FP8_BLOCK)) == "w-fp8 block128x128 sym / a-fp8 group128 dynamic"


def test_calibrated_kv_scales_compile_to_kv_cache_scheme_and_a_dynamic_kv_to_nothing(demo_layout) -> None:
    calibrated = compile_recipe(load_recipe("fp8-kv").recipe, demo_layout, "fp8-kv.yaml", parse_target("cuda:8.9"))
    assert calibrated.llmcompressor["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["kv_cache_scheme"] == KV_CACHE_SCHEME
    assert calibrated.needs_calibration and calibrated.kv_cache.scales == "calibrated"
    kv_only = compile_recipe(load_recipe("kv-fp8").recipe, demo_layout, "kv-fp8.yaml", parse_target("cpu:avx512"))
    assert kv_only.llmcompressor == {} and kv_only.kv_cache.vllm_dtype == "fp8"
    text = "name: kvc\nkv_cache: {dtype: fp8, scales: calibrated}\ncalibration: {dataset: calibration}\n"
    alone = compile_recipe(parse_recipe(text, "kvc.yaml"), demo_layout, "kvc.yaml", parse_target("cpu:avx512"))
    assert alone.llmcompressor["quant_stage"]["quant_modifiers"] == {"QuantizationModifier": {"kv_cache_scheme": KV_CACHE_SCHEME}}


# --- the written rules -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scheme", "target", "field"), [
    (FP8, "cpu:avx2", None), (FP8, "cpu:avx512", None), (FP8, "cpu", None),
    (FP8_BLOCK, "cpu:avx2", "weights.granularity"), (FP8_BLOCK, "cpu", "weights.granularity"),
    (FP8_WEIGHT_ONLY, "cpu:avx512", "activations"), (FP8_WEIGHT_ONLY, "cpu:avx2", "activations"),
    (FP8, "cuda:8.0", "activations"), (FP8_BLOCK, "cuda:8.6", "activations"), (FP8, "cuda:8.9", None), (FP8_BLOCK, "cuda:9.0", None),
    (FP8_WEIGHT_ONLY, "cuda:7.5", None), (FP8_WEIGHT_ONLY, "cuda:9.0", None), (FP8_WEIGHT_ONLY, "cuda:7.0", ""),
    ({**FP8, "activations": {"type": "float", "granularity": "tensor", "dynamic": False}}, "cpu:avx2", "activations.dynamic"),
    ({**FP8, "weights": {"bits": 8, "type": "float", "granularity": "tensor"}}, "cpu:avx512", "weights.granularity"),
    ({**FP8, "weights": {"bits": 8, "granularity": "channel"}}, "cuda:9.0", "activations.type"),
    ({**FP8_WEIGHT_ONLY, "activations": {"granularity": "token"}}, "cuda:9.0", "activations.type"),
    ({**FP8_BLOCK, "activations": {"type": "float", "granularity": "token", "dynamic": True}}, "cuda:9.0", "activations.granularity"),
    ({**FP8_BLOCK, "activations": {"type": "float", "granularity": "group", "group_size": 64}}, "cuda:9.0", "activations.group_size"),
])
def test_fp8_rules_per_target(scheme: dict, target: str, field: str | None) -> None:
    assert problem_field(scheme, target) == field


def test_fp8_refusals_name_the_class_and_what_serves_instead() -> None:
    avx2 = serve_problem(group(FP8_BLOCK), parse_target("cpu:avx2"))
    assert avx2 is not None and "cpu:avx2" in avx2.why and "AMX" in avx2.why and "fp8 recipe" in avx2.why
    ampere = serve_problem(group(FP8), parse_target("cuda:8.0"))
    assert ampere is not None and "8.9" in ampere.why and "cuda:8.0" in ampere.why and "fp8-w8a16" in ampere.why


def test_block_fp8_needs_input_sizes_its_blocks_divide() -> None:
    assert problem_field(FP8_BLOCK, "cuda:9.0", Layer("model.layers.0.mlp.down_proj", 576, 576)) == "weights.block"
    assert problem_field(FP8_BLOCK, "cuda:9.0", Layer("model.layers.0.mlp.down_proj", 768, 576)) is None


@pytest.mark.parametrize(("dtype", "target", "head", "refused"), [
    ("fp8", "cpu:avx2", 64, True), ("fp8_e5m2", "cpu:arm", 64, True), ("fp8", "cpu:avx512", 64, False), ("fp8", "cpu", 128, False),
    ("fp8", "cpu:avx512", 80, True), ("bfloat16", "cpu:avx2", 64, True), ("bfloat16", "cpu:avx512", 64, True),
    ("bfloat16", "cpu:avx512bf16", 64, False), ("auto", "cpu:avx2", 80, False),
    ("fp8", "cuda:7.5", 80, False), ("fp8_e5m2", "cuda:9.0", 64, False),
])
def test_kv_cache_rules_per_target(dtype: str, target: str, head: int, refused: bool) -> None:
    problem = kv_cache_problem(KvCache(dtype=dtype), parse_target(target), head)
    assert (problem is not None) == refused
    if problem is not None:
        assert problem.field == "dtype" and (target in problem.why or str(head) in problem.why)


def test_a_16_bit_kv_cache_unlike_the_served_dtype_is_refused_on_a_cpu_naming_what_it_did() -> None:
    # vLLM's CPU attention read a bfloat16 cache beside float32 attention back wrong: the demo model 100 -> 10 (cpu:avx2)
    problem = kv_cache_problem(KvCache(dtype="bfloat16"), parse_target("cpu:avx2"), 64)
    assert problem is not None and "serves this class's models in float32" in problem.why and "100 -> 10" in problem.why
    assert "kv_cache: auto" in problem.why


def test_an_fp8_kv_cache_is_refused_at_validation_on_avx2_naming_class_and_format(demo_layout) -> None:
    with pytest.raises(InputError) as caught:
        compile_recipe(load_recipe("kv-fp8").recipe, demo_layout, "kv-fp8.yaml", parse_target("cpu:avx2"))
    assert caught.value.field == "kv_cache.dtype" and "cpu:avx2" in caught.value.message and "fp8" in caught.value.message


# --- the probe ----------------------------------------------------------------------------------------------------


def test_fp8_probe_cases_are_the_checkpoints_llmcompressor_writes() -> None:
    case = KernelCase.of(group(FP8_BLOCK))
    assert case.key == "w8f-b128x128-sym/a8f-group128-dyn-sym"
    assert case.label == "fp8 weights per 128x128 block, fp8 activations dynamic per token group of 128"
    config = case.quantization_config()
    assert config["format"] == "float-quantized"
    assert config["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    assert case.probe_request()["in_features"] % 128 == 0
    assert checkpoint_format(group(FP8_WEIGHT_ONLY).weights, None) == "naive-quantized"  # what llm-compressor wrote


@pytest.fixture
def fake_kv_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict]:
    """The probe answered as on an AVX2 host: FP8 W8A8 served, an FP8 KV cache refused by vLLM's own check."""
    from test_hardware import PROFILE

    calls: list[dict] = []

    def run_probe(request: dict, *, timeout_s: float) -> dict:
        calls.append(request)
        cases = {case["key"]: {"scheme": "CompressedTensorsW8A8Fp8", "kernel": "ChannelWiseTorchFP8ScaledMMLinearKernel", "error": None}
                 for case in request["cases"]}
        kv = {case["key"]: {"isa": None, "error": "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."}
              for case in request["kv_cases"]}
        return {"host": {}, "cases": cases, "kv_cases": kv}

    with answered_probe(monkeypatch, tmp_path, PROFILE, run_probe):
        yield calls


def test_the_local_kv_check_is_vllms_own_start_up_check_probed_once(fake_kv_probe: list[dict]) -> None:
    local = ServeTarget(kind="cpu", isa="avx512", local=True)  # the written rules would allow it: the probe decides here
    problem = kv_cache_problem(KvCache(dtype="fp8"), local, 64)
    assert problem is not None and "requires x86 with AVX-512 or AMX" in problem.why
    assert kv_cache_problem(KvCache(dtype="fp8"), local, 64) is not None and len(fake_kv_probe) == 1
    case = KvCase(kv_cache_dtype="fp8", head_size=96)
    assert not kernel_facts(probe_rules.host_profile(), [case])[case.key].served
    assert fake_kv_probe[-1]["kv_cases"] == [case.probe_request()] and fake_kv_probe[-1]["cases"] == []


# --- the planner ----------------------------------------------------------------------------------------------------


def test_fp8_weight_bytes_one_per_weight_plus_scales() -> None:
    assert linear_bytes(512, 256, group(FP8)) == 512 * 256 + 512 * 2
    assert linear_bytes(512, 256, group(FP8_BLOCK)) == 512 * 256 + 4 * 2 * 2
    assert linear_bytes(576, 576, group(FP8_BLOCK)) == 576 * 576 + 5 * 5 * 2
    assert linear_bytes(512, 256, group(FP8_WEIGHT_ONLY)) == linear_bytes(512, 256, group(FP8))


def test_the_planner_counts_each_recipes_kv_precision_and_each_asked_one() -> None:
    recipes: list[Recipe | None] = [None, load_recipe("fp8").recipe, load_recipe("kv-fp8").recipe]
    result = plan(TINY, recipes, gpu_spec("L4"), 4096, 8, kv_cache_dtype=["auto", "bfloat16"])
    rows = {row.scheme: row for row in result.rows}
    assert list(rows) == ["16-bit", "fp8", "kv-fp8", "16-bit + kv bfloat16", "fp8 + kv bfloat16"]
    assert rows["kv-fp8"].kv_cache_bytes_per_token * 2 == rows["16-bit"].kv_cache_bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert rows["kv-fp8"].max_concurrency > rows["16-bit"].max_concurrency
    assert rows["kv-fp8"].recommended is not None and rows["kv-fp8"].recommended.kv_cache_dtype == "fp8"
    assert rows["kv-fp8"].weights_bytes == rows["16-bit"].weights_bytes


def test_a_kv_precision_the_target_cannot_store_does_not_apply() -> None:
    result = plan(TINY, [None, load_recipe("kv-fp8").recipe], gpu_spec(memory_gib=8), 512, 1, kv_cache_dtype=["auto", "fp8"],
                  target=parse_target("cpu:avx2"))
    rows = {row.scheme: row for row in result.rows}
    assert rows["kv-fp8"].does_not_apply and "cpu:avx2" in rows["kv-fp8"].does_not_apply and not rows["kv-fp8"].fits
    assert rows["16-bit + kv fp8"].does_not_apply
    assert rows["16-bit"].kv_cache_bytes_per_token == 2 * 4 * 2 * 64 * 4  # auto on cpu:avx2 is the float32 serve dtype


def test_planner_bytes_of_the_fp8_recipes_on_the_demo_shape() -> None:
    shape = model_shape(*load_config(DEMO_MODEL_DIR))
    assert predict_weight_bytes(shape, load_recipe("fp8").recipe).total_bytes == 4_219_392  # llm-compressor wrote exactly this
    assert predict_weight_bytes(shape, load_recipe("kv-fp8").recipe).total_bytes == 7_344_640  # the 16-bit files, copied
    assert predict_weight_bytes(shape, load_recipe("fp8-block").recipe).total_bytes == 4_199_296
    assert predict_weight_bytes(shape, load_recipe("fp8-kv").recipe).total_bytes == 4_219_392 + 4 * 2 * 2  # + k/v scales per layer


# --- serving --------------------------------------------------------------------------------------------------------


def _model(folder: Path, kv_scheme: bool = False) -> Path:
    folder.mkdir()
    config = {"model_type": "llama", **({"quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}} if kv_scheme else {})}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_server_gets_the_artifacts_own_kv_cache_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _model(tmp_path / "plain")
    assert served_kv_cache_dtype(plain) == "auto"
    assert "--kv-cache-dtype" not in serving._command(plain, "model", 8000, serving.ServeSettings())
    calibrated = _model(tmp_path / "calibrated", kv_scheme=True)
    assert served_kv_cache_dtype(calibrated) == "fp8"  # vLLM itself serves such a checkpoint's KV cache in FP8
    command = serving._command(calibrated, "model", 8000, serving.ServeSettings())
    assert command[command.index("--kv-cache-dtype") + 1] == "fp8"
    recorded = _model(tmp_path / "recorded")
    (recorded / "manifest.json").write_text("{}")
    monkeypatch.setattr(artifact, "read_manifest", lambda folder: SimpleNamespace(kv_cache=KvCacheRecord(dtype="bfloat16", scales="dynamic",
                                                                                                        served_as="bfloat16")))
    command = serving._command(recorded, "model", 8000, serving.ServeSettings())
    assert command[command.index("--kv-cache-dtype") + 1] == "bfloat16"  # the manifest's record wins
