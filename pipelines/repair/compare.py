"""The found artifact against simply choosing another recipe: every shipped recipe on the repaired model.

Per shipped recipe (recipes/*.yaml): whether it applies to the model (the compiler's checks on its layout and the
serve target), the planner's predicted weight bytes, and, when the registry holds a run of that recipe as shipped
(same recipe hash) on the same model (same source hash) scored on the same eval sets (same names and hashes), that
run's verdict and measured bytes. A recipe never gated there says so: its verdict is not guessed.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from pipelines.artifact import read_manifest
from pipelines.errors import QuantGateError
from pipelines.hardware.targets import ServeTarget
from pipelines.planner import ModelShape
from pipelines.quantize.compiler import cannot_apply
from pipelines.quantize.layout import ModelLayout
from pipelines.recipe import load_recipe, shipped_recipes
from pipelines.registry.store import Registry, registry_exists
from pipelines.repair.pricing import recipe_bytes


class ShippedRecipe(BaseModel):
    recipe: str
    cannot_apply: str | None = Field(default=None, description="why it does not apply to this model (None: it does)")
    predicted_bytes: int | None = None
    verdict: str | None = Field(default=None, description="the registry's verdict of its latest run here (None: never gated here)")
    measured_bytes: int | None = None
    registry_version: int | None = None


class Registered(BaseModel):
    """A registry version, reduced to what the comparison matches on and shows."""

    recipe: str
    recipe_hash: str
    source_hash: str
    eval_sets: list[tuple[str, str]]
    version: int
    verdict: str | None
    artifact_path: str


def shipped_comparison(shape: ModelShape, layout: ModelLayout, target: ServeTarget, registered: list[Registered],
                       source_hash: str | None, eval_sets: list[tuple[str, str]]) -> list[ShippedRecipe]:
    """One row per shipped recipe (see the module docstring); `registered`: the model's registry versions."""
    rows = []
    for name in shipped_recipes():
        try:
            loaded = load_recipe(name)
        except QuantGateError as error:
            rows.append(ShippedRecipe(recipe=name, cannot_apply=error.one_line()))
            continue
        why = cannot_apply(loaded.recipe, layout, loaded.path, target)
        if why is not None:
            rows.append(ShippedRecipe(recipe=name, cannot_apply=why))
            continue
        runs = [v for v in registered if v.recipe == name and v.recipe_hash == loaded.sha256 and sorted(v.eval_sets) == sorted(eval_sets)
                and (source_hash is None or v.source_hash == source_hash)]
        latest = max(runs, key=lambda v: v.version, default=None)
        rows.append(ShippedRecipe(
            recipe=name, predicted_bytes=recipe_bytes(shape, loaded.recipe),
            verdict=latest.verdict if latest else None, registry_version=latest.version if latest else None,
            measured_bytes=measured_bytes(Path(latest.artifact_path)) if latest else None,
        ))
    return rows


def registered_versions(registry_path: Path | None, model: str) -> list[Registered]:
    """The model's versions in the registry (none when there is no registry or no such model)."""
    if not registry_exists(registry_path):
        return []

    try:
        versions = Registry(registry_path).list(model)
    except QuantGateError:
        return []
    return [Registered(recipe=v.recipe_name, recipe_hash=v.recipe_hash, source_hash=v.source_hash, version=v.version, verdict=v.verdict,
                       eval_sets=[(ref.name, ref.hash) for ref in v.eval_sets], artifact_path=v.artifact_path) for v in versions]


def measured_bytes(artifact_dir: Path) -> int | None:
    """The weight bytes an artifact's manifest measured (None: no readable manifest)."""

    manifest = read_manifest(artifact_dir)
    return manifest.weight_bytes.after if manifest is not None else None
