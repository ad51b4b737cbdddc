"""The recipe schema: shipped recipes parse; every bad recipe is one InputError naming file and field."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from pipelines.errors import InputError
from pipelines.recipe import load_recipe, shipped_recipes

GOOD = """
name: t
algorithm: {method: rtn}
groups:
  attention:
    weights: {bits: 4, granularity: group, group_size: 128}
  mlp:
    weights: {bits: 4, granularity: group, group_size: 128}
"""


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def patched(**changes) -> str:
    """GOOD with top-level keys replaced (a value of None removes the key)."""
    data = yaml.safe_load(GOOD)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return yaml.safe_dump(data)


def error_for(path: Path) -> InputError:
    with pytest.raises(InputError) as caught:
        load_recipe(str(path))
    assert caught.value.file == str(path)
    assert "\n" not in caught.value.one_line()
    return caught.value


def test_shipped_recipes_parse_with_their_file_names() -> None:
    assert {"w8a8", "w4a16", "gptq", "aggressive"} <= set(shipped_recipes())
    for name in shipped_recipes():
        recipe, path, text = load_recipe(name)
        assert recipe.name == path.stem == name
        assert text == path.read_text()


def test_shipped_w8a8_says_what_the_design_says() -> None:
    recipe, _, _ = load_recipe("w8a8")
    attention, mlp = recipe.groups.attention, recipe.groups.mlp
    assert recipe.smoothquant is not None and recipe.algorithm.method == "gptq"
    assert (attention.activations.granularity, attention.activations.dynamic) == ("token", True)
    assert (mlp.activations.granularity, mlp.activations.dynamic) == ("tensor", False)
    assert attention.weights.bits == mlp.weights.bits == 8
    assert not recipe.groups.embeddings.quantize and not recipe.groups.lm_head.quantize


def test_a_good_recipe_loads(tmp_path: Path) -> None:
    recipe, _, _ = load_recipe(str(write(tmp_path, GOOD)))
    assert recipe.groups.attention.weights.group_size == 128
    assert not recipe.needs_calibration


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        (GOOD + "colour: blue\n", "colour", "unknown key"),
        (GOOD.replace("{bits: 4, granularity: group, group_size: 128}\n  mlp", "{bits: 4, granularity: group, group_size: 128, colour: 1}\n  mlp"),
         "groups.attention.weights.colour", "unknown key"),
        (GOOD.replace("bits: 4, granularity: group, group_size: 128}\n  mlp", "bits: 5, granularity: group, group_size: 128}\n  mlp"),
         "groups.attention.weights.bits", "5"),
        (GOOD.replace("group_size: 128}\n  mlp", "group_size: 127}\n  mlp"), "groups.attention.weights", "even"),
        (GOOD.replace("granularity: group, group_size: 128}\n  mlp", "granularity: channel, group_size: 128}\n  mlp"),
         "groups.attention.weights", "only meaningful"),
        (GOOD.replace("granularity: group, group_size: 128}\n  mlp", "granularity: group}\n  mlp"), "groups.attention.weights", "needs group_size"),
        ("name: t\ngroups: {}\n", "(top level)", "quantizes nothing"),
        ("name: 'bad name!'\ngroups: {attention: {weights: {bits: 4, granularity: channel}}}\n", "name", "pattern"),
        ("groups: {attention: {weights: {bits: 4, granularity: channel}}}\n", "name", "required"),
    ],
)
def test_schema_errors_name_file_and_field(tmp_path: Path, text: str, field: str, fragment: str) -> None:
    error = error_for(write(tmp_path, text))
    assert error.field == field
    assert fragment in error.message


def test_static_per_token_activations_are_refused(tmp_path: Path) -> None:
    groups = yaml.safe_load(GOOD)["groups"]
    groups["mlp"] = {"weights": {"bits": 8}, "activations": {"granularity": "token", "dynamic": False}}
    error = error_for(write(tmp_path, patched(groups=groups, calibration={"num_samples": 8})))
    assert error.field == "groups.mlp.activations"
    assert "per-token" in error.message


@pytest.mark.parametrize("group", ["embeddings", "lm_head"])
def test_embeddings_and_lm_head_need_explicit_quantize(tmp_path: Path, group: str) -> None:
    groups = yaml.safe_load(GOOD)["groups"]
    groups[group] = {"weights": {"bits": 8}}
    error = error_for(write(tmp_path, patched(groups=groups)))
    assert error.field == f"groups.{group}"
    assert "quantize: true" in error.message


@pytest.mark.parametrize(
    ("override", "field", "fragment"),
    [
        ({"keep": True}, "overrides.0", "`layers` or `match`"),
        ({"layers": [0]}, "overrides.0", "keep: true"),
        ({"layers": []}, "overrides.0.layers", "at least 1"),
        ({"match": "q_proj(", "keep": True}, "overrides.0.match", "not a regular expression"),
        ({"layers": [0], "keep": True, "attention": {"weights": {"bits": 8}}}, "overrides.0", "cannot also"),
    ],
)
def test_override_errors(tmp_path: Path, override: dict, field: str, fragment: str) -> None:
    error = error_for(write(tmp_path, patched(overrides=[override])))
    assert error.field == field
    assert fragment in error.message


@pytest.mark.parametrize(
    ("algorithm", "calibration", "field", "fragment"),
    [
        ({"method": "gptq"}, None, "(top level)", "needs calibration"),
        ({"method": "rtn"}, {"num_samples": 8}, "(top level)", "nothing uses it"),
        ({"method": "rtn", "actorder": "weight"}, None, "algorithm", "only apply to method 'gptq'"),
        ({"method": "gptq", "actorder": "group"}, {"num_samples": 8}, "algorithm.actorder", "g_idx"),
        ({"method": "awq"}, None, "algorithm.method", "awq"),
    ],
)
def test_algorithm_and_calibration_errors(tmp_path: Path, algorithm: dict, calibration: dict | None, field: str, fragment: str) -> None:
    error = error_for(write(tmp_path, patched(algorithm=algorithm, calibration=calibration)))
    assert error.field == field
    assert fragment in error.message


def test_smoothquant_alone_needs_calibration(tmp_path: Path) -> None:
    error = error_for(write(tmp_path, patched(smoothquant={"strength": 0.5})))
    assert "needs calibration" in error.message
    recipe, _, _ = load_recipe(str(write(tmp_path, patched(smoothquant={"strength": 0.5}, calibration={"num_samples": 4}), "ok.yaml")))
    assert recipe.needs_calibration and recipe.calibration.num_samples == 4


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    error = error_for(write(tmp_path, "name: t\ngroups:\n  attention: [unclosed\n"))
    assert error.field.startswith("line ")
    assert "malformed YAML" in error.message


def test_a_list_is_not_a_recipe(tmp_path: Path) -> None:
    assert error_for(write(tmp_path, "- a\n- b\n")).field == "(top level)"


def test_unknown_recipe_name_lists_the_shipped_ones() -> None:
    with pytest.raises(InputError) as caught:
        load_recipe("no-such-recipe")
    assert caught.value.field == "recipe"
    assert "w8a8" in caught.value.message
