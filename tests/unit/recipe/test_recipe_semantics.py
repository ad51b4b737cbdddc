"""One meaning per recipe: the compiler (what llm-compressor is told to quantize), the planner (what it counts
bytes for) and the repair units (what a repair moves and prices) agree layer by layer, on recipes with
overrides, for every decoder family in tests/families.py (layouts built from the configs on the meta device)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from families import FAMILIES, family_config, target_that_serves

from pipelines.hardware.targets import CPU
from pipelines.planner import ModelShape, linear_bytes, linear_schemes, model_shape, predict_weight_bytes, shape_layout
from pipelines.quantize.compiler import check_recipe, resolve_schemes
from pipelines.quantize.layout import FUSED_SHARDS, ModelLayout, layout_from_config
from pipelines.recipe import Recipe, load_recipe, shipped_recipes
from pipelines.repair.pricing import unit_bytes
from pipelines.repair.units import units_of

W4 = {"weights": {"bits": 4, "granularity": "group", "group_size": 128}}
W4_64 = {"weights": {"bits": 4, "granularity": "group", "group_size": 64}}
W4_AUTO = {"weights": {"bits": 4, "granularity": "group", "group_size": "auto"}}
W8A8 = {"weights": {"bits": 8}, "activations": {"granularity": "token", "dynamic": True}}
BOTH_W4 = {"attention": W4, "mlp": W4}

RECIPES: dict[str, dict[str, Any]] = {
    "by layer range": {"groups": BOTH_W4, "overrides": [{"layers": [0, -1], "keep": True}]},
    "by module name": {"groups": BOTH_W4, "overrides": [{"match": r"down_proj$", "mlp": W8A8}]},
    "by kind": {"groups": {"attention": W8A8, "mlp": W8A8}, "overrides": [{"layers": [1, 2], "mlp": W4_64}]},
    "layers and name ANDed, later wins": {
        "groups": {"attention": W8A8, "mlp": W4},
        "overrides": [
            {"layers": [1, 2, 3], "match": r"self_attn", "attention": W4_64},
            {"layers": [-1], "keep": True},
            {"match": r"layers\.2\.mlp\.down_proj", "mlp": W8A8},
        ],
    },
    # gate/up as vLLM fuses them: two shards on a Llama, Phi-3's one gate_up_proj
    "one group only, auto in an override": {"groups": {"mlp": W8A8}, "overrides": [{"match": r"\.(gate|up|gate_up)_proj", "mlp": W4_AUTO}]},
}
CASES = [(family, name) for family in FAMILIES for name in RECIPES]


@cache
def model(family: str) -> tuple[ModelLayout, ModelShape]:
    config = family_config(family)
    return layout_from_config(config), model_shape(config)


def recipe_of(name: str) -> Recipe:
    return Recipe.model_validate({"name": "t", **RECIPES[name]})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planner_counts_the_linears_the_compiler_finds(family: str) -> None:
    """Every Linear of the decoder layers, named and sized as the checkpoint has it (Phi-3's fused qkv_proj and
    gate_up_proj, Qwen3's and Gemma's head_dim that is not hidden / heads), in the same group and layer."""
    layout, shape = model(family)
    def seen(linears: list) -> dict:
        return {info.name: (info.in_features, info.out_features, info.kind, info.layer) for info in linears}
    assert seen(layout.linears) == seen(shape_layout(shape).linears)
    assert all(info.kind is not None for info in layout.linears)  # every Linear of the decoder layers is in a group
    assert len(layout.of_kind("attention")) == shape.layers * (2 if shape.fused_qkv else 4)
    assert len(layout.of_kind("mlp")) == shape.layers * (2 if shape.fused_gate_up else 3)
    assert shape.tied_embeddings == family_config(family)["tie_word_embeddings"]


@pytest.mark.parametrize(("family", "name"), CASES)
def test_compiler_and_planner_give_every_linear_the_same_scheme(family: str, name: str) -> None:
    layout, shape = model(family)
    recipe = recipe_of(name)
    compiled = resolve_schemes(recipe, layout, "t.yaml")
    planned = linear_schemes(shape, recipe)
    assert planned == {module: entry.scheme for module, entry in compiled.items()}
    assert any(entry.source.startswith("overrides.") for entry in compiled.values())  # the overrides took part


@pytest.mark.parametrize(("family", "name"), CASES)
def test_the_planners_bytes_are_the_compiled_layers_bytes(family: str, name: str) -> None:
    layout, shape = model(family)
    recipe = recipe_of(name)
    concrete = check_recipe(recipe, layout, "t.yaml", CPU)  # applies, with `auto` made concrete per layer
    unquantized = sum(linear_bytes(e.module.out_features, e.module.in_features, None) for e in concrete.values())
    compiled = sum(linear_bytes(e.module.out_features, e.module.in_features, e.scheme) for e in concrete.values())
    predicted = predict_weight_bytes(shape, recipe).total_bytes
    assert predicted == predict_weight_bytes(shape, None).total_bytes - unquantized + compiled
    assert compiled < unquantized


@pytest.mark.parametrize(("family", "recipe_name"), [(family, name) for family in FAMILIES for name in shipped_recipes()])
def test_repair_units_are_what_vllm_serves_and_price_what_the_planner_predicts(family: str, recipe_name: str) -> None:
    """One unit per Linear as vLLM serves it: q/k/v and gate/up fused (Phi-3's checkpoint fuses them already),
    its shards sharing one scheme; the units' bytes are the planner's whole difference to the 16-bit model."""
    layout, shape = model(family)
    recipe = load_recipe(recipe_name).recipe
    units = units_of(check_recipe(recipe, layout, recipe_name, target_that_serves(recipe_name)))
    assert [unit.name.split(".", 2)[2] for unit in units if unit.layer == 0] == ["self_attn.qkv", "self_attn.o", "mlp.gate_up", "mlp.down"]
    assert sorted(info.name for unit in units for info in unit.modules) == sorted(info.name for info in layout.linears)
    for unit in units:
        fused = [shard for shard in unit.shards if shard in FUSED_SHARDS[unit.kind]]
        assert len(unit.shards) == (len(FUSED_SHARDS[unit.kind]) if fused else 1), unit.name
    saved = sum(unit_bytes(unit, None) - unit_bytes(unit, unit.scheme) for unit in units)
    kv_scales = 2 * shape.layers * shape.param_bytes if recipe.kv_cache.scales == "calibrated" else 0  # k_scale, v_scale per layer
    assert saved - kv_scales == predict_weight_bytes(shape, None).total_bytes - predict_weight_bytes(shape, recipe).total_bytes
