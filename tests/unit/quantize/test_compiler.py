"""The compiler: recipes -> llm-compressor recipes for a concrete model, and every check it makes first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from compressed_tensors.utils.match import match_name
from families import FAMILIES, family_config

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.hardware.targets import parse_target
from pipelines.quantize.compiler import CompiledRecipe, cannot_apply, compile_recipe
from pipelines.quantize.layout import LinearInfo, ModelLayout, layout_from_config
from pipelines.recipe import load_recipe, parse_recipe

W8_DYNAMIC = {"weights": {"bits": 8}, "activations": {"granularity": "token", "dynamic": True}}
W4_GROUP = {"weights": {"bits": 4, "granularity": "group", "group_size": 128}}
# What a Llama's compiled recipe targets (the group regexes narrowed to the shards a Llama has), as before Phi-3.
LLAMA_ATTENTION, LLAMA_MLP = r"re:.*self_attn\.(q|k|v|o)_proj$", r"re:.*mlp\.(gate|up|down)_proj$"


@pytest.fixture(scope="module")
def layout(tiny_llama_config: dict) -> ModelLayout:
    return layout_from_config(tiny_llama_config)


def recipe_text(groups: dict | None = None, **top) -> str:
    data = {"name": "t", "groups": groups or {"attention": W4_GROUP, "mlp": W4_GROUP}, **top}
    return yaml.safe_dump(data)


def compile_text(text: str, layout: ModelLayout, file: str = "recipes/t.yaml") -> CompiledRecipe:
    return compile_recipe(parse_recipe(text, file), layout, file)


def compile_error(text: str, layout: ModelLayout) -> InputError:
    with pytest.raises(InputError) as caught:
        compile_text(text, layout)
    assert caught.value.file == "recipes/t.yaml"
    return caught.value


def claimed_by(compiled: CompiledRecipe, module: str) -> list[str]:
    """Config groups whose targets match `module`, by compressed-tensors' own matching rule."""
    quantizer = list(compiled.llmcompressor["quant_stage"]["quant_modifiers"].values())[-1]
    if any(match_name(module, target) for target in quantizer["ignore"]):
        return []
    return [name for name, group in quantizer["config_groups"].items() if any(match_name(module, t) for t in group["targets"])]


def test_layout_of_the_demo_shape(layout: ModelLayout) -> None:
    assert layout.num_layers == 4
    assert len(layout.of_kind("attention")) == 16 and len(layout.of_kind("mlp")) == 12
    assert layout.lm_head == "lm_head" and layout.embeddings == ["model.embed_tokens"]
    shapes = {info.name: (info.in_features, info.out_features) for info in layout.linears}
    assert shapes["model.layers.0.self_attn.k_proj"] == (256, 128)  # 2 KV heads x 64
    assert shapes["model.layers.3.mlp.down_proj"] == (768, 256)


def test_shipped_w8a8_compiles_to_smoothquant_then_gptq_with_mixed_activations(layout: ModelLayout) -> None:
    loaded = load_recipe("w8a8")
    recipe, path = loaded.recipe, loaded.path
    compiled = compile_recipe(recipe, layout, path)
    modifiers = compiled.llmcompressor["quant_stage"]["quant_modifiers"]
    assert list(modifiers) == ["SmoothQuantModifier", "GPTQModifier"]
    gptq = modifiers["GPTQModifier"]
    assert "lm_head" in gptq["ignore"] and gptq["actorder"] is None
    attention, mlp = gptq["config_groups"]["attention"], gptq["config_groups"]["mlp"]
    assert attention["targets"] == [LLAMA_ATTENTION] and mlp["targets"] == [LLAMA_MLP]
    assert attention["input_activations"] | {} == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    assert (mlp["input_activations"]["strategy"], mlp["input_activations"]["dynamic"]) == ("tensor", False)
    assert yaml.safe_load(compiled.yaml) == compiled.llmcompressor
    assert compiled.layers["model.layers.0.self_attn.q_proj"] == "w8 channel sym / a8 token dynamic, gptq"  # the layer table names GPTQ
    assert compiled.layers["model.layers.0.mlp.down_proj"] == "w8 channel sym / a8 tensor static, gptq"
    assert compiled.layers["lm_head"] == compiled.layers["model.embed_tokens"] == "16-bit"


@pytest.mark.parametrize("name", ["w8a8", "w4a16", "gptq", "aggressive"])
def test_every_shipped_recipe_claims_each_decoder_linear_once(layout: ModelLayout, name: str) -> None:
    loaded = load_recipe(name)
    recipe, path = loaded.recipe, loaded.path
    compiled = compile_recipe(recipe, layout, path)
    for info in layout.linears:
        assert claimed_by(compiled, info.name) == [info.kind], info.name
    assert claimed_by(compiled, "lm_head") == []


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_each_decoder_linear_claimed_once_by_compressed_tensors(family: str) -> None:
    """By compressed-tensors' own matching, on every family's module names (Phi-3's qkv_proj and gate_up_proj)."""
    layout = layout_from_config(family_config(family))
    for name in ("w8a8", "w4a16"):
        loaded = load_recipe(name)
        compiled = compile_recipe(loaded.recipe, layout, loaded.path)
        for info in layout.linears:
            assert claimed_by(compiled, info.name) == [info.kind], (name, info.name)
        assert claimed_by(compiled, "lm_head") == [] and claimed_by(compiled, "model.embed_tokens") == []


@pytest.mark.parametrize("config, field, words", [
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}, "num_experts", "is a mixture-of-experts model (8 experts"),
    ({"model_type": "bart", "d_model": 64, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": 128}, "model_type",
     "model_type 'bart' is an encoder-decoder model"),  # said by BartConfig, not config.json
    ({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128},
     "model_type", "8 weight matrices of its decoder layers match no group (gpt_neox.layers.0.attention.query_key_value (Linear)"),
    ({"architectures": ["LlamaForCausalLM"]}, "model_type", "missing"),
])
def test_a_layout_the_groups_cannot_cover_is_refused_naming_what_is_missing(config: dict, field: str, words: str) -> None:
    with pytest.raises(InputError) as caught:
        layout_from_config(config, "m/config.json")
    assert (caught.value.file, caught.value.field) == ("m/config.json", field)
    assert words in caught.value.message


def test_compiled_yaml_is_an_llmcompressor_recipe(layout: ModelLayout) -> None:
    from llmcompressor.recipe import Recipe as LlmcRecipe

    loaded = load_recipe("gptq")
    recipe, path = loaded.recipe, loaded.path
    modifiers = LlmcRecipe.create_instance(compile_recipe(recipe, layout, path).yaml).modifiers
    (gptq,) = modifiers
    assert type(gptq).__name__ == "GPTQModifier"
    assert gptq.actorder == "weight"
    assert gptq.config_groups["attention"].weights.group_size == 128


def test_rtn_compiles_to_quantization_modifier_without_gptq_knobs(layout: ModelLayout) -> None:
    compiled = compile_text(recipe_text(), layout)
    (name, quantizer), = compiled.llmcompressor["quant_stage"]["quant_modifiers"].items()
    assert name == "QuantizationModifier" and "actorder" not in quantizer
    assert quantizer["config_groups"]["mlp"]["weights"] == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    assert "input_activations" not in quantizer["config_groups"]["mlp"]


def test_keeping_first_and_last_layers_16_bit(layout: ModelLayout) -> None:
    compiled = compile_text(recipe_text(overrides=[{"layers": [0, -1], "keep": True}]), layout)
    for info in layout.linears:
        kept = info.layer in (0, 3)
        assert claimed_by(compiled, info.name) == ([] if kept else [info.kind]), info.name
        assert (compiled.layers[info.name] == "16-bit") == kept
    quantizer = compiled.llmcompressor["quant_stage"]["quant_modifiers"]["QuantizationModifier"]
    assert quantizer["config_groups"]["attention"]["targets"] == [r"re:.*\.layers\.(1|2)\.self_attn\.(q|k|v|o)_proj$"]


def test_an_override_scheme_becomes_its_own_config_group(layout: ModelLayout) -> None:
    w8 = {"weights": {"bits": 8}, "activations": {"granularity": "token"}}
    compiled = compile_text(recipe_text(overrides=[{"layers": [1], "attention": w8, "mlp": w8}]), layout)
    assert claimed_by(compiled, "model.layers.1.self_attn.v_proj") == ["attention_1"]
    assert claimed_by(compiled, "model.layers.1.mlp.up_proj") == ["mlp_1"]
    assert claimed_by(compiled, "model.layers.2.self_attn.v_proj") == ["attention"]
    assert compiled.layers["model.layers.1.mlp.up_proj"] == "w8 channel sym / a8 token dynamic"


def test_a_regex_override_on_whole_fused_sets_is_fine(layout: ModelLayout) -> None:
    compiled = compile_text(recipe_text(overrides=[{"match": r"\.o_proj$|down_proj", "keep": True}]), layout)
    assert claimed_by(compiled, "model.layers.2.self_attn.o_proj") == []
    assert claimed_by(compiled, "model.layers.2.mlp.down_proj") == []
    assert claimed_by(compiled, "model.layers.2.mlp.gate_proj") == ["mlp"]


@pytest.mark.parametrize(
    ("override", "field", "fragment"),
    [
        ({"match": r"q_proj$", "keep": True}, "overrides.0", "q_proj/k_proj/v_proj"),
        ({"match": "up_proj", "mlp": W8_DYNAMIC}, "overrides.0.mlp", "gate_proj/up_proj"),
        ({"match": "nothing_like_this", "keep": True}, "overrides.0", "selects no"),
        ({"layers": [4], "keep": True}, "overrides.0.layers", "layer 4 does not exist"),
        ({"match": "mlp", "attention": W8_DYNAMIC}, "overrides.0.attention", "selects no module"),
        ({"match": "lm_head|embed", "keep": True}, "overrides.0.match", "quantize: true"),
    ],
)
def test_override_errors_name_the_override(layout: ModelLayout, override: dict, field: str, fragment: str) -> None:
    error = compile_error(recipe_text(overrides=[override]), layout)
    assert error.field == field
    assert fragment in error.message


def test_a_later_override_that_splits_fused_shards_is_the_one_named(layout: ModelLayout) -> None:
    w4_channel = {"weights": {"bits": 4, "granularity": "channel"}}
    text = recipe_text(overrides=[{"layers": [2], "mlp": w4_channel}, {"layers": [2], "match": "gate_proj", "keep": True}])
    error = compile_error(text, layout)
    assert error.field == "overrides.1"
    assert "model.layers.2.mlp" in error.message


@pytest.mark.parametrize(
    ("groups", "field", "fragment"),
    [
        (
            {"attention": {"weights": {"bits": 4, "granularity": "group", "group_size": 96}}},
            "groups.attention.weights.group_size", "does not divide the input size 256",
        ),
        ({"mlp": {"weights": {"bits": 2, "granularity": "channel"}}}, "groups.mlp.weights.bits", "4 bits only"),
        ({"mlp": {"weights": {"bits": 3, "granularity": "group", "group_size": 128}}}, "groups.mlp.weights.bits", "4 bits only"),
        ({"mlp": {"weights": {"bits": 8, "granularity": "channel"}}}, "groups.mlp.weights.bits", "4 bits only"),
        ({"mlp": {"weights": {"bits": 4, "granularity": "tensor"}}}, "groups.mlp.weights.granularity", "channel' or 'group"),
        ({"mlp": {"weights": {"bits": 4, "granularity": "tensor"}, "activations": {}}}, "groups.mlp.weights.granularity",
         "W4A8 weights must be per channel or per group"),
        ({"mlp": {"weights": {"bits": 4, "symmetric": False}, "activations": {}}}, "groups.mlp.weights.symmetric", "symmetric int4"),
        (
            {"mlp": {"weights": {"bits": 8, "granularity": "group", "group_size": 128}, "activations": {}}},
            "groups.mlp.weights.granularity", "per channel",
        ),
        ({"mlp": {"weights": {"bits": 8, "symmetric": False}, "activations": {}}}, "groups.mlp.weights.symmetric", "symmetric"),
        (
            {"mlp": {"weights": {"bits": 8}, "activations": {"granularity": "tensor", "dynamic": True}}},
            "groups.mlp.activations.granularity", "dynamic",
        ),
        ({"mlp": W4_GROUP, "embeddings": {"quantize": True, "weights": {"bits": 8}}}, "groups.embeddings.quantize", "embeddings"),
        ({"mlp": W4_GROUP, "lm_head": {"quantize": True, "weights": {"bits": 2}}}, "groups.lm_head.weights.bits", "4 bits only"),
    ],
)
def test_scheme_errors_name_the_field(layout: ModelLayout, groups: dict, field: str, fragment: str) -> None:
    error = compile_error(recipe_text(groups), layout)
    assert error.field == field
    assert fragment in error.message


def test_quantized_lm_head_needs_and_gets_its_own_group(layout: ModelLayout) -> None:
    compiled = compile_text(recipe_text({"mlp": W4_GROUP, "lm_head": {"quantize": True, "weights": W4_GROUP["weights"]}}), layout)
    assert claimed_by(compiled, "lm_head") == ["lm_head"]
    assert compiled.layers["lm_head"] == "w4 group128 sym / a16"


def _layout(linears: list[LinearInfo]) -> ModelLayout:
    return ModelLayout(architecture="Toy", num_layers=1, linears=linears, embeddings=["embed"], lm_head="lm_head")


def test_a_group_matching_no_module_is_an_error() -> None:
    toy = _layout([LinearInfo(name="h.0.attn.c_attn", in_features=256, out_features=768, layer=0)])
    error = compile_error(recipe_text({"attention": W4_GROUP}), toy)
    assert error.field == "groups.attention"
    assert "matches no module" in error.message


def test_four_bit_layers_need_sizes_in_multiples_of_32() -> None:
    odd = _layout([LinearInfo(name="model.layers.0.mlp.down_proj", in_features=100, out_features=256, kind="mlp", layer=0)])
    error = compile_error(recipe_text({"mlp": {"weights": {"bits": 4, "granularity": "channel"}}}), odd)
    assert error.field == "groups.mlp.weights"
    assert "multiples of 32" in error.message


def _model_folder(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_cli_show_prints_the_compiled_yaml(tmp_path: Path, tiny_llama_config: dict, capsys: pytest.CaptureFixture) -> None:
    assert main(["recipe", "show", "w4a16", "--model", str(_model_folder(tmp_path, tiny_llama_config))]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["ignore"] == ["lm_head"]


def test_cli_show_json(tmp_path: Path, tiny_llama_config: dict, capsys: pytest.CaptureFixture) -> None:
    assert main(["recipe", "show", "w8a8", "--json", "--model", str(_model_folder(tmp_path, tiny_llama_config))]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert yaml.safe_load(shown["yaml"]) == shown["llmcompressor"]
    assert shown["layers"]["lm_head"] == "16-bit"


def test_cli_validate_exit_codes(tmp_path: Path, tiny_llama_config: dict, capsys: pytest.CaptureFixture) -> None:
    model = _model_folder(tmp_path, tiny_llama_config)
    assert main(["recipe", "validate", "aggressive", "--model", str(model)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe_text({"mlp": {"weights": {"bits": 4, "granularity": "group", "group_size": 512}}}))
    assert main(["recipe", "validate", str(bad), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: groups.mlp.weights.group_size:" in err and "does not divide" in err


def test_cli_validate_bad_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["recipe", "validate", "w4a16", "--model", str(tmp_path / "absent")]) == 2
    assert "model folder does not exist" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert main(["recipe", "validate", "w4a16", "--model", str(broken)]) == 2
    assert f"{broken / 'config.json'}: line 1: not valid JSON" in capsys.readouterr().err


# --- group_size auto: one recipe for the demo shape (hidden 256) and SmolLM2's (hidden 576) ---------------

SMOLLM2_SHAPE = {  # models/smollm2-135m, two of its 30 layers: the shapes are what matter
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "max_position_embeddings": 8192, "tie_word_embeddings": True, "dtype": "bfloat16",
}
W4_AUTO = {"weights": {"bits": 4, "granularity": "group", "group_size": "auto"}}


@pytest.fixture(scope="module")
def smollm2() -> ModelLayout:
    return layout_from_config(SMOLLM2_SHAPE)


def config_groups(compiled: CompiledRecipe) -> dict:
    return list(compiled.llmcompressor["quant_stage"]["quant_modifiers"].values())[-1]["config_groups"]


@pytest.mark.parametrize("name", ["w4a16", "gptq"])
def test_shipped_four_bit_recipes_apply_to_a_hidden_576_model(smollm2: ModelLayout, name: str) -> None:
    loaded = load_recipe(name)
    recipe, path = loaded.recipe, loaded.path
    compiled = compile_recipe(recipe, smollm2, path)
    sizes = {info.name: info.in_features for info in smollm2.linears}
    for module, in_features in sizes.items():
        expected = 64 if in_features == 576 else 128  # 128 does not divide 576; 1536 = 12 x 128
        assert compiled.layers[module] == f"w4 group{expected} sym / a16" + (", gptq" if name == "gptq" else ""), module
        assert len(claimed_by(compiled, module)) == 1, module
    assert {module.rsplit(".", 1)[1] for module, size in sizes.items() if size == 1536} == {"down_proj"}
    groups = config_groups(compiled)
    assert {name: (group["targets"], group["weights"]["group_size"]) for name, group in groups.items()} == {
        "attention": ([LLAMA_ATTENTION], 64),
        "mlp": ([r"re:.*mlp\.(gate|up)_proj$"], 64),
        "mlp_1": ([r"re:.*mlp\.down_proj$"], 128),
    }


@pytest.mark.parametrize("name", ["w4a16", "gptq"])
def test_auto_compiles_the_demo_shape_exactly_as_group_128_did(layout: ModelLayout, name: str) -> None:
    loaded = load_recipe(name)
    recipe, path = loaded.recipe, loaded.path
    fixed = recipe.model_copy(update={"groups": recipe.groups.model_copy(update={
        kind: parse_recipe(recipe_text(), "x").groups.attention for kind in ("attention", "mlp")
    })})
    auto, pinned = compile_recipe(recipe, layout, path), compile_recipe(fixed, layout, path)
    assert auto.yaml == pinned.yaml and auto.layers == pinned.layers
    assert all(group["weights"]["group_size"] == 128 for group in config_groups(auto).values())


def test_a_fixed_group_size_that_does_not_divide_names_the_sizes_that_would(smollm2: ModelLayout) -> None:
    error = compile_error(recipe_text(), smollm2)
    assert error.field == "groups.attention.weights.group_size"
    assert error.message == (
        "group_size 128 does not divide the input size 576 of model.layers.0.self_attn.q_proj; 64, 32 would; "
        "write `group_size: 64` or `group_size: auto`"
    )
    mlp_only = compile_error(recipe_text({"mlp": W4_GROUP}), smollm2)
    assert mlp_only.field == "groups.mlp.weights.group_size" and "64, 32 would" in mlp_only.message  # divide 576 and 1536


def test_the_suggested_fixed_size_compiles(smollm2: ModelLayout) -> None:
    w4_64 = {"weights": {"bits": 4, "granularity": "group", "group_size": 64}}
    compiled = compile_text(recipe_text({"attention": w4_64, "mlp": w4_64}), smollm2)
    assert set(compiled.layers.values()) == {"w4 group64 sym / a16", "16-bit"}


def test_auto_with_a_cap_and_in_an_override(smollm2: ModelLayout) -> None:
    capped = {"weights": {"bits": 4, "granularity": "group", "group_size": {"auto": 32}}}
    compiled = compile_text(recipe_text({"attention": W4_AUTO, "mlp": W4_AUTO}, overrides=[{"layers": [1], "mlp": capped}]), smollm2)
    assert compiled.layers["model.layers.0.mlp.down_proj"] == "w4 group128 sym / a16"
    assert compiled.layers["model.layers.1.mlp.down_proj"] == compiled.layers["model.layers.1.mlp.up_proj"] == "w4 group32 sym / a16"
    for info in smollm2.linears:
        assert len(claimed_by(compiled, info.name)) == 1, info.name
    targets = {name: group["targets"] for name, group in config_groups(compiled).items()}
    assert targets["mlp"] == [r"re:.*\.layers\.(0)\.mlp\.(gate|up)_proj$"]  # a layer and a shard regex together


def test_auto_that_finds_no_size_is_refused_naming_the_layer() -> None:
    odd = _layout([LinearInfo(name="model.layers.0.mlp.down_proj", in_features=99, out_features=256, kind="mlp", layer=0)])
    error = compile_error(recipe_text({"mlp": W4_AUTO}), odd)
    assert error.field == "groups.mlp.weights.group_size"
    assert "no even group size up to 128 that divides the input size 99 of model.layers.0.mlp.down_proj" in error.message


def test_auto_still_needs_kernel_sized_layers() -> None:
    odd = _layout([LinearInfo(name="model.layers.0.mlp.down_proj", in_features=808, out_features=256, kind="mlp", layer=0)])
    error = compile_error(recipe_text({"mlp": W4_AUTO}), odd)  # auto would pick 8; vLLM's CPU kernel needs multiples of 32
    assert error.field == "groups.mlp.weights" and "multiples of 32" in error.message


def test_a_quantized_lm_head_takes_auto_from_its_own_input_size(smollm2: ModelLayout) -> None:
    compiled = compile_text(recipe_text({"mlp": W4_AUTO, "lm_head": {"quantize": True, "weights": W4_AUTO["weights"]}}), smollm2)
    assert compiled.layers["lm_head"] == "w4 group64 sym / a16"
    assert config_groups(compiled)["lm_head"]["weights"]["group_size"] == 64
    error = compile_error(recipe_text({"mlp": W4_AUTO, "lm_head": {"quantize": True, "weights": W4_GROUP["weights"]}}), smollm2)
    assert error.field == "groups.lm_head.weights.group_size" and "576 of lm_head; 64, 32 would" in error.message


def test_the_compiled_auto_recipe_is_an_llmcompressor_recipe(smollm2: ModelLayout) -> None:
    from llmcompressor.recipe import Recipe as LlmcRecipe

    loaded = load_recipe("gptq")
    recipe, path = loaded.recipe, loaded.path
    (gptq,) = LlmcRecipe.create_instance(compile_recipe(recipe, smollm2, path).yaml).modifiers
    assert {name: group.weights.group_size for name, group in gptq.config_groups.items()} == {"attention": 64, "mlp": 64, "mlp_1": 128}


def test_cannot_apply_says_why_in_one_line(smollm2: ModelLayout) -> None:
    assert cannot_apply(load_recipe("w4a16").recipe, smollm2) is None
    reason = cannot_apply(parse_recipe(recipe_text(), "x"), smollm2)
    assert reason.startswith("groups.attention.weights.group_size: group_size 128 does not divide the input size 576")


# --- serve targets: the same recipe, checked against the CPU build or a GPU's kernels -------------------------

W8A16 = {"weights": {"bits": 8, "granularity": "channel"}}


def test_w8a16_is_refused_on_cpu_and_compiles_for_a_gpu(layout: ModelLayout) -> None:
    text = recipe_text({"attention": W8A16, "mlp": W8A16})
    error = compile_error(text, layout)  # the unit tests' installed target is the CPU build
    assert error.field == "groups.attention.weights.bits" and "4 bits only" in error.message
    compiled = compile_recipe(parse_recipe(text, "t.yaml"), layout, "t.yaml", parse_target("cuda:8.0"))
    attention = config_groups(compiled)["attention"]
    assert attention["weights"]["num_bits"] == 8 and "input_activations" not in attention
    assert compiled.layers["model.layers.0.mlp.down_proj"] == "w8 channel sym / a16"


def test_a_gpu_target_names_its_own_refusals(layout: ModelLayout) -> None:
    recipe = parse_recipe(recipe_text({"attention": W4_GROUP, "mlp": W8A16}), "t.yaml")
    assert cannot_apply(recipe, layout, "t.yaml", parse_target("cuda:8.9")) is None
    assert "compute capability 7.5" in (cannot_apply(recipe, layout, "t.yaml", parse_target("cuda:7.0")) or "")
    lm_head = parse_recipe(recipe_text({"mlp": W4_GROUP, "lm_head": {"quantize": True, "weights": {"bits": 3}}}), "t.yaml")
    assert (cannot_apply(lm_head, layout, "t.yaml", parse_target("cuda:9.0")) or "").startswith("groups.lm_head.weights.bits:")


def test_a_layer_the_cpu_kernel_cannot_take_serves_on_a_gpu() -> None:
    odd = _layout([LinearInfo(name="model.layers.0.mlp.down_proj", in_features=768, out_features=808, kind="mlp", layer=0)])
    recipe = parse_recipe(recipe_text({"mlp": W4_AUTO}), "t.yaml")
    assert "multiples of 32" in (cannot_apply(recipe, odd) or "")
    assert cannot_apply(recipe, odd, "t.yaml", parse_target("cuda:8.0")) is None  # Marlin zero-pads the tile


@pytest.mark.parametrize("head_dim, refusal", [
    (48, None),  # k and v are 48 wide each, but vLLM's fused q/k/v is 192 + 48 + 48 = 288 = 9 x 32
    (40, "model.layers.0.self_attn.q_proj+k_proj+v_proj is 256 -> 240"),  # 160 + 40 + 40
])
def test_the_cpu_kernel_judges_fused_shards_as_the_one_layer_vllm_serves(head_dim: int, refusal: str | None) -> None:
    config = {**SMOLLM2_SHAPE, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": head_dim}
    problem = cannot_apply(load_recipe("w4a16").recipe, layout_from_config(config), "w4a16.yaml")
    assert problem is None if refusal is None else refusal in (problem or ""), problem


def test_cli_validate_for_a_gpu_from_a_cpu_machine(tmp_path: Path, tiny_llama_config: dict, capsys: pytest.CaptureFixture) -> None:
    model = _model_folder(tmp_path, tiny_llama_config)
    w8a16 = tmp_path / "w8a16.yaml"
    w8a16.write_text(recipe_text({"attention": W8A16, "mlp": W8A16}))
    assert main(["recipe", "validate", "--target", "cuda:8.9", str(w8a16), "--model", str(model), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "cuda:8.9"
    assert main(["recipe", "validate", str(w8a16), "--model", str(model)]) == 2
    assert f"{w8a16}: groups.attention.weights.bits: vLLM CPU serves weight-only quantization at 4 bits only" in capsys.readouterr().err
    assert main(["recipe", "validate", "--target", "cuda:7.0", str(w8a16), "--model", str(model)]) == 2
    assert f"{w8a16}: groups.attention: vLLM's compressed-tensors int schemes need compute capability 7.5" in capsys.readouterr().err
    assert main(["recipe", "validate", "--target", "gpu", str(w8a16), "--model", str(model)]) == 2
    assert "target: unknown serve target 'gpu'" in capsys.readouterr().err
