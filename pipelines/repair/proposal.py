"""A proposal as a recipe: the rejected recipe as written, plus overrides that move some units up their ladders.

The overrides are appended after the recipe's own (later overrides win), one per (shards, scheme): `layers`
lists the decoder layers, `match` the shards (`self_attn\\.(q|k|v)_proj$`), and the scheme is the rung's (with its
algorithm: `algorithm: gptq` quantizes those modules with GPTQ, the others keep theirs), or `keep: true` for 16-bit.
A parent that calibrates nothing gets the default `calibration:` when a rung needs data. The proposal is named
`<parent>-repair-<6 hex of its overrides>` (the same moves give the same name, hence the same artifact folder,
reused), says `base:` so that the gate policy judges it by the parent's rules, and keeps the parent's tags.
The file is a recipe like any other: `--recipe FILE`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipelines.files.atomic import write_text_atomic
from pipelines.files.hashing import sha256_json
from pipelines.gate.policy import Policy
from pipelines.recipe import KV_CALIBRATABLE, Calibration, GroupScheme, KvCache, LoadedRecipe, Recipe, parse_recipe
from pipelines.repair.units import Unit

MAX_NAME = 64
SUFFIX = "-repair-"


def overrides_for(moved: dict[str, GroupScheme | None], units: dict[str, Unit]) -> list[dict[str, Any]]:
    """One override per (kind, shards, scheme), in a stable order; layers ascending."""
    groups: dict[tuple[str, str, str], tuple[Unit, GroupScheme | None, list[int]]] = {}
    for name, scheme in moved.items():
        unit = units[name]
        key: tuple[str, str, str] = (unit.kind, unit.suffix_regex, sha256_json(_scheme_dict(scheme)))
        groups.setdefault(key, (unit, scheme, []))[2].append(unit.layer)
    overrides = []
    for key in sorted(groups):
        unit, scheme, layers = groups[key]
        override: dict[str, Any] = {"layers": sorted(layers), "match": unit.suffix_regex}
        if scheme is None:
            override["keep"] = True
        else:
            override[unit.kind] = _scheme_dict(scheme)
        overrides.append(override)
    return overrides


def _scheme_dict(scheme: GroupScheme | None) -> dict[str, Any] | None:
    return None if scheme is None else scheme.model_dump(mode="json", exclude_none=True)


def policy_base(parent: Recipe, policy: Policy) -> str:
    """The `base` that makes the policy judge a proposal by the parent's rules: the parent's name when a
    policy key names it, else the parent's own base (or name). Tags are kept, so a tag key still matches."""
    if policy.recipe_key(parent.identity) == parent.name:
        return parent.name
    return parent.base or parent.name


def proposal_text(parent: LoadedRecipe, overrides: list[dict[str, Any]], policy: Policy) -> str:
    """The parent recipe as written, renamed and re-based, with `overrides` appended."""
    data = yaml.safe_load(parent.text)
    name = f"{parent.name[: MAX_NAME - len(SUFFIX) - 6]}{SUFFIX}{sha256_json(overrides)[:6]}"
    description = (f"{parent.name} with {len(overrides)} override(s) added by `quantize repair`: the modules they select moved up "
                   f"their fallback ladder (docs/repair.md). {parent.recipe.description}").strip()
    head = {"name": name, "description": description, "base": policy_base(parent.recipe, policy)}
    rest = {key: value for key, value in data.items() if key not in ("name", "description", "base", "overrides")}
    if "calibration" not in rest and _need_calibration(overrides):
        rest = _with_calibration(rest)
    data = {**head, **rest, "overrides": [*(data.get("overrides") or []), *overrides]}
    text = _dump(data)
    parse_recipe(text, name)  # overrides only add schemes: a parent's own calibration stays what it was
    return text


def kv_proposal_text(parent: LoadedRecipe, dtype: str, policy: Policy) -> str:
    """The parent recipe with its KV cache moved to `dtype` (`auto`: the serve dtype), named `<parent>-repair-kv-<dtype>`:
    same weights, another KV precision. Calibrated KV scales stay calibrated while the KV cache stays FP8; above it
    the recipe's own calibration is kept only where something else reads it."""
    data = yaml.safe_load(parent.text)
    name = f"{parent.name[: MAX_NAME - len(SUFFIX) - 16]}{SUFFIX}kv-{dtype}"
    description = (f"{parent.name} with its KV cache moved to {dtype} by `quantize repair` (docs/repair.md). "
                   f"{parent.recipe.description}").strip()
    head = {"name": name, "description": description, "base": policy_base(parent.recipe, policy)}
    calibrated = parent.recipe.kv_cache.scales == "calibrated" and dtype in KV_CALIBRATABLE
    kv = KvCache(dtype=dtype, scales="calibrated" if calibrated else "dynamic")
    rest = {key: value for key, value in data.items() if key not in ("name", "description", "base", "kv_cache")}
    rest["kv_cache"] = kv.model_dump()
    if not parent.recipe.model_copy(update={"kv_cache": kv}).needs_calibration:
        rest.pop("calibration", None)  # nothing reads it any more (a recipe refuses calibration it does not use)
    text = _dump({**head, **rest})
    parse_recipe(text, name)
    return text


def _need_calibration(overrides: list[dict[str, Any]]) -> bool:
    """Whether a scheme the overrides give reads calibration data (a GPTQ rung, static activation scales)."""
    return any(GroupScheme.model_validate(override[kind]).needs_calibration
               for override in overrides for kind in ("attention", "mlp") if override.get(kind) is not None)


def _with_calibration(fields: dict[str, Any]) -> dict[str, Any]:
    """A parent that calibrates nothing gets the recipe default `calibration:` (before `groups:`) when a rung needs
    data; a run's --calibration replaces its dataset as for any recipe (docs/calibration.md)."""
    default = Calibration().model_dump(mode="json")
    items = list(fields.items())
    at = next((index for index, (key, _) in enumerate(items) if key == "groups"), len(items))
    return dict([*items[:at], ("calibration", default), *items[at:]])


def _dump(data: dict[str, Any]) -> str:
    # Leaf lists and mappings in flow style: `layers: [0, 2]`, `weights: {bits: 4, ...}`, as the shipped recipes write them.
    return yaml.safe_dump(data, sort_keys=False, width=120, allow_unicode=True, default_flow_style=None)


def write_proposal(text: str, path: Path) -> LoadedRecipe:
    """Write the proposal and load it back as `quantize --recipe FILE` would (validated again)."""
    write_text_atomic(path, text)
    return LoadedRecipe(recipe=parse_recipe(text, path), path=path, text=text)


def build(parent: LoadedRecipe, moved: dict[str, GroupScheme | None], units: dict[str, Unit], policy: Policy) -> Recipe:
    """The proposal's Recipe, in memory (for pricing), from the same text that would be written."""
    text = proposal_text(parent, overrides_for(moved, units), policy)
    return parse_recipe(text, "proposal")
