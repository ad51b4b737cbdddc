"""The bake-off's rows: each recipe x each backend, a recipe on its own backend once, every bad input before any row."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.bakeoff.plan import BACKENDS, parse_backends, plan_bakeoff
from pipelines.errors import InputError
from pipelines.paths import RECIPES_DIR


def test_rows_are_each_recipe_on_each_backend_renamed_off_its_own(bake) -> None:
    plan = bake.plan(["gptq", "w4a16"])
    assert [row.label for row in plan.rows] == [f"{recipe} on {backend}" for recipe in ("gptq", "w4a16") for backend in BACKENDS]
    names = [row.loaded.name for row in plan.rows if row.loaded is not None]
    assert names == ["gptq", "gptq-gptqmodel", "gptq-bitsandbytes", "w4a16", "w4a16-gptqmodel", "w4a16-bitsandbytes"]
    renamed = plan.rows[1].loaded
    assert renamed is not None and renamed.recipe.backend == "gptqmodel" and renamed.recipe.base == "gptq"
    assert renamed.recipe.groups == plan.rows[0].loaded.recipe.groups  # the same layer-wise intent


def test_every_row_shares_one_settings_with_the_registry_off(bake) -> None:
    assert bake.settings.registry_path is not None  # the workspace's settings name a registry...
    plan = bake.plan(["gptq"], ["llm-compressor", "gptqmodel"])
    assert plan.settings.registry_path is None  # ...a bake-off never writes it
    assert plan.settings.eval_sets == bake.settings.eval_sets and plan.settings.cache_dir == bake.settings.cache_dir


def test_a_recipe_naming_a_backend_outside_the_list_runs_once_on_its_own(bake, tmp_path: Path) -> None:
    text = (RECIPES_DIR / "gptq.yaml").read_text().replace("name: gptq", "name: gptq-own") + "backend: gptqmodel\n"
    (tmp_path / "own.yaml").write_text(text)
    plan = bake.plan([str(tmp_path / "own.yaml"), "w4a16"], ["llm-compressor"])
    assert [(row.loaded.name if row.loaded else None, row.backend) for row in plan.rows] == [("gptq-own", "gptqmodel"), ("w4a16", "llm-compressor")]


def test_the_same_recipe_named_twice_is_one_row_per_backend(bake) -> None:
    plan = bake.plan(["gptq", str(RECIPES_DIR / "gptq.yaml"), "gptq"], ["llm-compressor"])
    assert len(plan.rows) == 1


def test_two_different_recipes_under_one_name_are_refused_not_one_dropped(bake, tmp_path: Path) -> None:
    text = (RECIPES_DIR / "gptq.yaml").read_text().replace("name: gptq", "name: same")
    (tmp_path / "a.yaml").write_text(text)
    (tmp_path / "b.yaml").write_text(text.replace("bits: 4", "bits: 8"))
    with pytest.raises(InputError) as raised:
        bake.plan([str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")], ["llm-compressor"])
    assert raised.value.field == "--recipes" and "'same'" in raised.value.message and "b.yaml" in raised.value.message
    (tmp_path / "c.yaml").write_text("# the same recipe, written with a comment\n" + text)
    assert len(bake.plan([str(tmp_path / "a.yaml"), str(tmp_path / "c.yaml")], ["llm-compressor"]).rows) == 1


def test_an_unknown_backend_names_the_option_and_the_choices() -> None:
    with pytest.raises(InputError) as raised:
        parse_backends(["gptqmodel", "autogptq"])
    assert raised.value.field == "--backends" and "'autogptq'" in raised.value.message and "bitsandbytes" in raised.value.message
    assert parse_backends(None) == list(BACKENDS)
    assert parse_backends(["gptqmodel", "gptqmodel", "llm-compressor"]) == ["gptqmodel", "llm-compressor"]
    with pytest.raises(InputError, match="at least one backend"):
        parse_backends([])


def test_an_unknown_recipe_or_a_bad_model_folder_fails_the_plan(bake, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such recipe"):
        bake.plan(["gptq", "no-such-recipe"])
    with pytest.raises(InputError, match="does not exist"):
        plan_bakeoff(["gptq"], ["llm-compressor"], tmp_path / "missing", bake.settings)
    with pytest.raises(InputError, match="at least one recipe"):
        bake.plan([])
