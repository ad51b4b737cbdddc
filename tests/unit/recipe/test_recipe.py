"""The recipe schema: shipped recipes parse; every bad recipe is one InputError naming file and field."""

from __future__ import annotations

import hashlib
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
        loaded = load_recipe(name)
        recipe, path, text = loaded.recipe, loaded.path, loaded.text
        assert recipe.name == path.stem == name == loaded.name
        assert text == path.read_text() and loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        assert load_recipe(loaded) is loaded  # parsed once: a loaded recipe passes through


def test_shipped_w8a8_says_what_the_design_says() -> None:
    recipe = load_recipe("w8a8").recipe
    attention, mlp = recipe.groups.attention, recipe.groups.mlp
    assert recipe.smoothquant is not None and recipe.algorithm.method == "gptq"
    assert (attention.activations.granularity, attention.activations.dynamic) == ("token", True)
    assert (mlp.activations.granularity, mlp.activations.dynamic) == ("tensor", False)
    assert attention.weights.bits == mlp.weights.bits == 8
    assert not recipe.groups.embeddings.quantize and not recipe.groups.lm_head.quantize


def test_a_good_recipe_loads(tmp_path: Path) -> None:
    recipe = load_recipe(str(write(tmp_path, GOOD))).recipe
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
    recipe = load_recipe(str(write(tmp_path, patched(smoothquant={"strength": 0.5}, calibration={"num_samples": 4}), "ok.yaml"))).recipe
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


# --- group_size auto, base, tags -------------------------------------------------------------------------


def test_group_size_auto_and_its_cap(tmp_path: Path) -> None:
    from pipelines.recipe import AutoGroupSize

    auto = load_recipe(str(write(tmp_path, GOOD.replace("group_size: 128}\n  mlp", "group_size: auto}\n  mlp")))).recipe
    capped = load_recipe(str(write(tmp_path, GOOD.replace("group_size: 128}\n  mlp", "group_size: {auto: 64}}\n  mlp"), "c.yaml"))).recipe
    assert auto.groups.attention.weights.group_size == AutoGroupSize(auto=128)
    assert capped.groups.attention.weights.group_size == AutoGroupSize(auto=64)
    assert capped.groups.mlp.weights.group_size == 128  # a fixed size stays a number


@pytest.mark.parametrize(
    ("in_features", "cap", "chosen"),
    [(256, 128, 128), (768, 128, 128), (576, 128, 64), (1536, 128, 128), (576, 32, 32), (1536, 1024, 512), (96, 128, 32),
     (50, 128, 2), (99, 128, None)],
)
def test_auto_picks_the_largest_power_of_two_up_to_the_cap_that_divides(in_features: int, cap: int, chosen: int | None) -> None:
    from pipelines.recipe import AutoGroupSize, WeightScheme

    weights = WeightScheme(bits=4, granularity="group", group_size=AutoGroupSize(auto=cap))
    assert weights.group_size_for(in_features) == chosen
    assert weights.for_layer(in_features).group_size == (chosen if chosen else AutoGroupSize(auto=cap))
    assert WeightScheme(bits=4, granularity="group", group_size=128).group_size_for(576) == 128  # fixed: as written


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("{auto: 96}", "power of two"),
        ("{auto: 0}", "greater than or equal to 2"),
        ("{auto: x}", "is an integer"),
        ("{auto: 128, max: 3}", "auto"),
        ("big", "`auto`"),
        ("1.5", "`auto`"),
        ("true", "`auto`"),
        ("0", "from 2 to"),
        ("127", "even"),
    ],
)
def test_bad_group_sizes_are_refused(tmp_path: Path, value: str, fragment: str) -> None:
    error = error_for(write(tmp_path, GOOD.replace("group_size: 128}\n  mlp", f"group_size: {value}}}\n  mlp")))
    assert error.field.startswith("groups.attention.weights")
    assert fragment in error.message


def test_auto_needs_granularity_group(tmp_path: Path) -> None:
    text = GOOD.replace("granularity: group, group_size: 128}\n  mlp", "granularity: channel, group_size: auto}\n  mlp")
    assert "only meaningful" in error_for(write(tmp_path, text)).message


def test_shipped_four_bit_recipes_use_auto_group_sizes_capped_at_128() -> None:
    for name in ("w4a16", "gptq"):
        recipe = load_recipe(name).recipe
        for group in (recipe.groups.attention, recipe.groups.mlp):
            assert group.weights.auto_group and group.weights.group_size.auto == 128, name


def test_base_and_tags_make_the_identity(tmp_path: Path) -> None:
    from pipelines.recipe import RecipeIdentity

    recipe = load_recipe(str(write(tmp_path, "base: w4a16\ntags: [int4, mine]\n" + GOOD))).recipe
    assert recipe.identity == RecipeIdentity(name="t", base="w4a16", tags=("int4", "mine"))
    plain = load_recipe(str(write(tmp_path, GOOD, "plain.yaml"))).recipe
    assert plain.identity == RecipeIdentity(name="t")


@pytest.mark.parametrize(
    ("prefix", "field", "fragment"),
    [
        ("base: 'not a name'\n", "base", "pattern"),
        ("tags: [ok, 'bad tag']\n", "tags.1", "pattern"),
        ("tags: [a, a]\n", "tags", "twice"),
        ("tags: a\n", "tags", "list"),
    ],
)
def test_bad_base_and_tags_are_refused(tmp_path: Path, prefix: str, field: str, fragment: str) -> None:
    error = error_for(write(tmp_path, prefix + GOOD))
    assert error.field == field
    assert fragment in error.message


def test_identity_from_a_manifests_recipe_text() -> None:
    from pipelines.recipe import RecipeIdentity, identity_from_text

    assert identity_from_text("base: w4a16\ntags: [int4]\n" + GOOD, "renamed") == RecipeIdentity(name="renamed", base="w4a16", tags=("int4",))
    assert identity_from_text("not: a recipe\n", "x") == RecipeIdentity(name="x")  # an older schema: the name alone
    assert identity_from_text(None, "x") == RecipeIdentity(name="x")
