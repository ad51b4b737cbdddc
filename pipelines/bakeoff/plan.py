"""The bake-off's rows, planned and checked before any row runs: every problem here is bad input (exit 2).

    plan = plan_bakeoff(["gptq", "w4a16"], ["llm-compressor", "gptqmodel"], model_dir, settings)

Rows are each recipe x each backend, recipes first: `gptq` on llm-compressor, `gptq` on gptqmodel, `w4a16` on ... A recipe
that itself names a backend outside the list runs once, on its own backend. A recipe on another backend than its own is
pipelines.recipe.with_backend's rename (NAME-BACKEND, base NAME: the same policy applies). A rename that the recipe schema
refuses is that row's refusal, not the end of the plan. Every row shares one GateSettings (the same sets, policy and
cached baseline) with the registry off: a bake-off compares; the user promotes the winner with `quantize --recipe`.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast, get_args

from pydantic import BaseModel, ConfigDict

from pipelines.artifact import check_model_dir
from pipelines.errors import InputError
from pipelines.files.safepath import safe_component
from pipelines.gate.policy import check_attainable
from pipelines.recipe import Backend, LoadedRecipe, load_recipe, with_backend
from pipelines.runs.runner import GateSettings

BACKENDS: tuple[str, ...] = get_args(Backend)
MAX_RECIPES = 32


class PlannedRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: str  # as --recipes names it
    backend: str
    loaded: LoadedRecipe | None  # None: refused while planning (`refusal` says why)
    refusal: str | None = None

    @property
    def label(self) -> str:
        return f"{self.recipe} on {self.backend}"


class BakeoffPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path
    settings: GateSettings
    recipes: list[str]
    backends: list[str]
    rows: list[PlannedRow]


def parse_backends(names: list[str] | None) -> list[str]:
    """--backends, in the order given without repeats (None: every backend); an unknown name is an InputError naming it."""
    if names is None:
        return list(BACKENDS)
    unknown = [name for name in names if name not in BACKENDS]
    if unknown:
        raise InputError(f"unknown backend {unknown[0]!r}; the backends are: {', '.join(BACKENDS)}", field="--backends")
    if not names:
        raise InputError(f"name at least one backend ({', '.join(BACKENDS)})", field="--backends")
    return list(dict.fromkeys(names))


def plan_bakeoff(recipes: list[str], backends: list[str], model_dir: Path, settings: GateSettings) -> BakeoffPlan:
    """Every row, after the model folder, each recipe and the policy (for each row's recipe) are checked."""
    if not recipes:
        raise InputError("name at least one recipe (for example gptq,w4a16)", field="--recipes")
    check_model_dir(model_dir)  # config.json and safetensors headers, weights unread
    safe_component(model_dir.name, "--model", file=model_dir)  # it names the bake-off's folder
    loaded = {name: load_recipe(name) for name in dict.fromkeys(recipes)}
    settings = settings.model_copy(update={"registry_path": None})
    rows = [row for name, recipe in loaded.items() for row in _rows(name, recipe, backends)]
    for row in rows:  # a policy the selected sets cannot meet for a row's recipe fails now, not after quantizing
        if row.loaded is not None:
            check_attainable(settings.policy, settings.eval_sets, row.loaded.recipe.identity, file=settings.policy_path)
    return BakeoffPlan(model_dir=model_dir, settings=settings, recipes=list(loaded), backends=backends, rows=_distinct(rows))


def _rows(name: str, recipe: LoadedRecipe, backends: list[str]) -> list[PlannedRow]:
    own = recipe.recipe.backend
    if "backend" in recipe.recipe.model_fields_set and own not in backends:
        return [PlannedRow(recipe=name, backend=own, loaded=recipe)]
    return [_on(name, recipe, backend) for backend in backends]


def _on(name: str, recipe: LoadedRecipe, backend: str) -> PlannedRow:
    try:
        return PlannedRow(recipe=name, backend=backend, loaded=with_backend(recipe, cast(Backend, backend)))
    except InputError as error:
        return PlannedRow(recipe=name, backend=backend, loaded=None, refusal=error.one_line())


def _distinct(rows: list[PlannedRow]) -> list[PlannedRow]:
    """One row per (recipe run, backend): `gptq` and `recipes/gptq.yaml` are the same row. Two different recipes that would
    run under one name are refused: a row, its run and its recipes/NAME.yaml are told apart by that name alone."""
    kept: dict[tuple[str, str], PlannedRow] = {}
    for row in rows:
        first = kept.setdefault((row.loaded.name if row.loaded is not None else row.recipe, row.backend), row)
        if first.loaded is not None and row.loaded is not None and first.loaded.recipe != row.loaded.recipe:
            raise InputError(f"{first.recipe} and {row.recipe} are different recipes that would both run as {row.loaded.name!r}: "
                             "give one another `name:`", field="--recipes")
    return list(kept.values())
