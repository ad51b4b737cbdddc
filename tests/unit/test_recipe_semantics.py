"""One meaning per recipe: the compiler (what llm-compressor is told to quantize) and the planner (what it
counts bytes for) agree layer by layer on recipes with overrides, on a real architecture's module names."""

from __future__ import annotations

from typing import Any

import pytest

from pipelines.compiler import ModelLayout, check_recipe, layout_from_config, resolve_schemes
from pipelines.planner import ModelShape, linear_bytes, linear_schemes, model_shape, predict_weight_bytes
from pipelines.recipe import Recipe
from pipelines.targets import CPU

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
    "one group only, auto in an override": {"groups": {"mlp": W8A8}, "overrides": [{"match": r"\.(gate|up)_proj", "mlp": W4_AUTO}]},
}


@pytest.fixture(scope="module")
def model(tiny_llama_config: dict) -> tuple[ModelLayout, ModelShape]:
    return layout_from_config(tiny_llama_config), model_shape(tiny_llama_config)


@pytest.mark.parametrize("name", RECIPES)
def test_compiler_and_planner_give_every_linear_the_same_scheme(model: tuple[ModelLayout, ModelShape], name: str) -> None:
    layout, shape = model
    recipe = Recipe.model_validate({"name": "t", **RECIPES[name]})
    compiled = resolve_schemes(recipe, layout, "t.yaml")
    planned = linear_schemes(shape, recipe)
    assert planned == {module: entry.scheme for module, entry in compiled.items()}
    assert any(entry.source.startswith("overrides.") for entry in compiled.values())  # the overrides took part


@pytest.mark.parametrize("name", RECIPES)
def test_the_planners_bytes_are_the_compiled_layers_bytes(model: tuple[ModelLayout, ModelShape], name: str) -> None:
    layout, shape = model
    recipe = Recipe.model_validate({"name": "t", **RECIPES[name]})
    concrete = check_recipe(recipe, layout, "t.yaml", CPU)  # applies, with `auto` made concrete per layer
    unquantized = sum(linear_bytes(e.module.out_features, e.module.in_features, None) for e in concrete.values())
    compiled = sum(linear_bytes(e.module.out_features, e.module.in_features, e.scheme) for e in concrete.values())
    predicted = predict_weight_bytes(shape, recipe).total_bytes
    assert predicted == predict_weight_bytes(shape, None).total_bytes - unquantized + compiled
    assert compiled < unquantized
