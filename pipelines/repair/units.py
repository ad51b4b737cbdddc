"""The modules a repair moves: one unit per Linear as vLLM serves it.

vLLM fuses q/k/v (and gate/up) of a layer into one Linear that carries one scheme, and the compiler refuses
a recipe that gives the shards different schemes. So sensitivity is measured, and overrides are written,
per unit: `layers.3.self_attn.qkv`, `layers.3.self_attn.o`, `layers.3.mlp.gate_up`, `layers.3.mlp.down`.
A checkpoint that already fuses them (Phi-3's qkv_proj, gate_up_proj) gives units of one shard, named the same.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pipelines.hardware.targets import ServeTarget
from pipelines.quantize.compiler import ModuleScheme, check_recipe
from pipelines.quantize.layout import CHECKPOINT_FUSED, FUSED_SHARDS, Kind, LinearInfo, ModelLayout
from pipelines.recipe import GroupScheme, Recipe


class Unit(BaseModel):
    """The Linear shards one vLLM module is made of, and the scheme the recipe gives them (None: 16-bit)."""

    model_config = ConfigDict(frozen=True)

    kind: Kind
    layer: int
    parent: str  # the shards' parent module's own name: self_attn, mlp
    shards: tuple[str, ...]  # q_proj, k_proj, v_proj
    modules: tuple[LinearInfo, ...]
    scheme: GroupScheme | None

    @property
    def name(self) -> str:
        names = [shard.removesuffix("_proj") for shard in self.shards]
        short = "".join(names) if all(len(name) == 1 for name in names) else "_".join(names)  # qkv, gate_up
        return f"layers.{self.layer}.{self.parent}.{short}"

    @property
    def in_features(self) -> int:
        return self.modules[0].in_features

    @property
    def suffix_regex(self) -> str:
        r"""What an override's `match` searches for these shards in any layer: `self_attn\.(q|k|v)_proj$`."""
        names = [shard.removesuffix("_proj") for shard in self.shards]
        shards = names[0] if len(names) == 1 else f"({'|'.join(names)})"
        return rf"{re.escape(self.parent)}\.{shards}_proj$"

    @property
    def parameters(self) -> int:
        return sum(info.in_features * info.out_features for info in self.modules)


def units_of(plan: dict[str, ModuleScheme]) -> list[Unit]:
    """Units from the compiler's per-module plan (schemes concrete), in layer order, then q/k/v, o, gate/up, down
    (fused ones first, whether vLLM fuses the shards or the checkpoint already did)."""
    grouped: dict[tuple, list[ModuleScheme]] = {}
    for entry in plan.values():
        info = entry.module
        if info.kind is None or info.layer is None:
            continue
        parent = info.name.rsplit(".", 2)[-2]
        fused = info.shard in FUSED_SHARDS[info.kind]
        key = (info.layer, info.kind, parent, "fused" if fused else info.shard)
        grouped.setdefault(key, []).append(entry)
    units = [
        Unit(kind=kind, layer=layer, parent=parent, shards=tuple(e.module.shard for e in entries),
             modules=tuple(e.module for e in entries), scheme=entries[0].scheme)
        for (layer, kind, parent, _), entries in grouped.items()
    ]
    order = {name: index for index, name in enumerate(plan)}
    return sorted(units, key=lambda unit: (unit.layer, unit.kind != "attention", not _fused(unit), order[unit.modules[0].name]))


def _fused(unit: Unit) -> bool:
    """q/k/v or gate/up: shards vLLM fuses, or the one module a checkpoint fused them into (Phi-3)."""
    return unit.shards[0] in FUSED_SHARDS[unit.kind] or unit.shards == (CHECKPOINT_FUSED[unit.kind],)


def recipe_units(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str, target: ServeTarget) -> list[Unit]:
    """The recipe's units on this model (the compiler's checks first: an InputError if it cannot apply)."""
    return units_of(check_recipe(recipe, layout, recipe_file, target))


def quantized_units(units: list[Unit]) -> list[Unit]:
    """The units a repair can move: those the recipe quantizes."""
    return [unit for unit in units if unit.scheme is not None]


# What a simulation is asked (kept here, free of torch, so the command line imports it cheaply).
Assignment = dict[str, GroupScheme | None]  # unit name -> scheme (None: 16-bit); units not named stay 16-bit


class RefPath(BaseModel):
    """One reference path: the prompt's token ids and the 16-bit model's greedy continuation."""

    model_config = ConfigDict(frozen=True)

    eval_set: str
    doc_id: int
    prompt_ids: list[int]
    generated_ids: list[int]
