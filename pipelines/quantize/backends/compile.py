"""The recipe's per-module plan (pipelines.quantize.compiler: resolved, `auto` group sizes made concrete, checked
against vLLM's kernels on the target) compiled into a subprocess backend's own configuration.

Each backend takes what its format can hold and refuses, in one line naming the recipe field, the first thing it
cannot express: GPTQModel writes integer weight-only GPTQ (one base scheme, other modules through its `dynamic`
per-module overrides, kept modules excluded); bitsandbytes quantizes every Linear alike, data-free, to LLM.int8 or NF4.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from pipelines.errors import InputError
from pipelines.hardware.targets import GPTQ_TYPES, ServeTarget
from pipelines.quantize.backends.serving import check_backend_served
from pipelines.quantize.backends.specs import DEFAULT, BackendPlan
from pipelines.quantize.compiler import CompiledRecipe, ModuleScheme, compile_recipe
from pipelines.quantize.layout import CHECKPOINT_FUSED, FUSED_SHARDS, LinearInfo, ModelLayout
from pipelines.recipe import LoadedRecipe, Recipe, WeightScheme

# bitsandbytes' 4-bit block (absmax per 64 weights); NF4 is its 4-bit grid (normal-float levels, not uniform integers).
BNB_4BIT_BLOCK = 64


def compile_checked(loaded: LoadedRecipe, layout: ModelLayout, target: ServeTarget) -> tuple[CompiledRecipe, BackendPlan | None]:
    """Every check `quantize` makes before heavy work, in its order (what `quantize recipe validate` reports too): vLLM's
    verdict on the backend's format, the recipe against the model and vLLM's kernels, then the backend's compilation
    (None for llm-compressor, which runs the compiled recipe itself)."""
    check_backend_served(loaded, layout, target)
    compiled = compile_recipe(loaded.recipe, layout, loaded.path, target)
    if loaded.recipe.backend == DEFAULT.name:
        return compiled, None
    return compiled, compile_for_backend(loaded.recipe, compiled.plan, loaded.path)


def compile_for_backend(recipe: Recipe, plan: dict[str, ModuleScheme], recipe_file: Path | str) -> BackendPlan:
    """`recipe` (already checked into `plan`) as its backend's configuration; an InputError naming the field it cannot take."""
    _refuse_recipe_level(recipe, recipe_file)
    if not _quantized(plan):
        raise _refuse(recipe, recipe_file, "overrides", "they keep every Linear 16-bit: nothing is left for it to quantize")
    if recipe.backend == "gptqmodel":
        return _gptqmodel(recipe, plan, recipe_file)
    if recipe.backend == "bitsandbytes":
        return _bitsandbytes(recipe, plan, recipe_file)
    raise ValueError(f"{recipe.backend} is not a subprocess backend")


def _refuse(recipe: Recipe, recipe_file: Path | str, field: str, why: str) -> InputError:
    return InputError(f"backend {recipe.backend} cannot express this: {why}", file=recipe_file, field=field)


def _refuse_recipe_level(recipe: Recipe, recipe_file: Path | str) -> None:
    if recipe.smoothquant is not None:
        raise _refuse(recipe, recipe_file, "smoothquant", "it has no SmoothQuant step (use backend llm-compressor)")
    if recipe.kv_cache.dtype != "auto":
        raise _refuse(recipe, recipe_file, "kv_cache", "it writes no KV cache scheme (use backend llm-compressor)")
    for part in ("embeddings", "lm_head"):
        if getattr(recipe.groups, part).quantize:
            raise _refuse(recipe, recipe_file, f"groups.{part}.quantize", f"it keeps {part} in 16-bit")


def _quantized(plan: dict[str, ModuleScheme]) -> list[ModuleScheme]:
    return [entry for entry in plan.values() if entry.scheme is not None]


def _method(recipe: Recipe, entry: ModuleScheme) -> str:
    assert entry.scheme is not None
    return entry.scheme.algorithm or recipe.algorithm.method


def _method_field(recipe: Recipe, entry: ModuleScheme, wanted: str) -> str:
    """The field that chose an entry's other algorithm: the recipe's own, or the group's `algorithm:`."""
    return "algorithm.method" if recipe.algorithm.method != wanted else f"{entry.source}.algorithm"


def _weight_only_int(recipe: Recipe, entry: ModuleScheme, recipe_file: Path | str) -> WeightScheme:
    """The entry's weights, refused unless integer and weight-only (what both subprocess backends write)."""
    assert entry.scheme is not None
    if entry.scheme.activations is not None:
        raise _refuse(recipe, recipe_file, f"{entry.source}.activations", "it quantizes weights only (activations stay 16-bit)")
    weights = entry.scheme.weights
    if weights.type != "int":
        raise _refuse(recipe, recipe_file, f"{entry.source}.weights.type", "it writes integer weights only")
    return weights


# ---------------------------------------------------------------------------------- GPTQModel


def _gptqmodel_scheme(recipe: Recipe, entry: ModuleScheme, recipe_file: Path | str) -> tuple[int, int, bool]:
    """(bits, group_size, sym) of one module; GPTQ's per-channel scale is group_size -1."""
    weights = _weight_only_int(recipe, entry, recipe_file)
    if _method(recipe, entry) != "gptq":
        raise _refuse(recipe, recipe_file, _method_field(recipe, entry, "gptq"),
                      "GPTQModel runs GPTQ; round-to-nearest needs backend llm-compressor")
    if (weights.bits, weights.symmetric) not in GPTQ_TYPES:  # the kernel rules pass asymmetric int4 (compressed-tensors has zero points)
        raise _refuse(recipe, recipe_file, f"{entry.source}.weights.{'bits' if weights.symmetric else 'symmetric'}",
                      "vLLM serves GPTQ checkpoints with symmetric 4- or 8-bit weights only (AutoGPTQConfig); asymmetric weights need "
                      "backend llm-compressor")
    if weights.granularity not in ("group", "channel"):
        raise _refuse(recipe, recipe_file, f"{entry.source}.weights.granularity", "GPTQ scales weights per group or per channel")
    group = weights.group_size_for(entry.module.in_features) if weights.granularity == "group" else -1
    assert group is not None  # the plan's group sizes are concrete and checked
    return weights.bits, group, weights.symmetric


def _module_pattern(info: LinearInfo) -> str:
    """A `dynamic` regex for one module under both names it goes by: GPTQModel matches the checkpoint's module
    (`...self_attn.q_proj`), vLLM the Linear it fuses the shards into (`...self_attn.qkv_proj`, gptq_utils
    get_dynamic_override on its layer prefix). Fused shards share one scheme (the compiler checked), so either matches."""
    if info.kind is not None and info.shard in FUSED_SHARDS[info.kind]:
        prefix = info.name.rsplit(".", 1)[0]
        return rf"^{re.escape(prefix)}\.(?:{info.shard}|{CHECKPOINT_FUSED[info.kind]})$"
    return f"^{re.escape(info.name)}$"


def _gptqmodel(recipe: Recipe, plan: dict[str, ModuleScheme], recipe_file: Path | str) -> BackendPlan:
    schemes = {name: _gptqmodel_scheme(recipe, entry, recipe_file) for name, entry in plan.items() if entry.scheme is not None}
    (bits, group, sym), _ = Counter(schemes.values()).most_common(1)[0]
    # GPTQModel's per-module overrides: `+:regex` gives a module other settings, `-:regex` leaves it unquantized.
    dynamic: dict[str, dict[str, int | bool]] = {
        f"+:{_module_pattern(plan[name].module)}": {"bits": scheme[0], "group_size": scheme[1], "sym": scheme[2]}
        for name, scheme in schemes.items() if scheme != (bits, group, sym)
    }
    dynamic.update({f"-:{_module_pattern(entry.module)}": {} for entry in plan.values() if entry.scheme is None})
    algorithm = recipe.algorithm
    if algorithm.dampening_frac <= 0:
        raise _refuse(recipe, recipe_file, "algorithm.dampening_frac", "GPTQModel needs a dampening fraction above 0")
    config = {
        "bits": bits, "group_size": group, "sym": sym, "desc_act": False,
        # 'weight' (and its alias 'static', as in compressed-tensors) orders columns by activation size within fixed groups,
        # no g_idx: GPTQModel's act_group_aware
        "act_group_aware": algorithm.actorder is not None, "damp_percent": algorithm.dampening_frac,
        "dynamic": dynamic or None, "offload_to_disk": False,
    }
    notes = [f"algorithm.block_size {algorithm.block_size}: GPTQModel sets its own lazy-batch width (the same result up to rounding)",
             "modules reached by under 0.5% of the calibration tokens (MoE experts) fall back to round-to-nearest (GPTQModel's default)"]
    return BackendPlan(backend="gptqmodel", config=config, notes=notes)


# ---------------------------------------------------------------------------------- bitsandbytes


def _bitsandbytes(recipe: Recipe, plan: dict[str, ModuleScheme], recipe_file: Path | str) -> BackendPlan:
    quantized = _quantized(plan)
    for entry in quantized:
        _weight_only_int(recipe, entry, recipe_file)
        if _method(recipe, entry) != "rtn":
            raise _refuse(recipe, recipe_file, _method_field(recipe, entry, "rtn"), "bitsandbytes is data-free (round-to-nearest): no GPTQ")
    distinct = {entry.scheme.weights.model_dump_json() for entry in quantized if entry.scheme is not None}
    if len(distinct) > 1:
        raise _refuse(recipe, recipe_file, "overrides", "it quantizes every Linear alike (one scheme; modules can only be kept 16-bit)")
    first = quantized[0]
    assert first.scheme is not None
    weights = first.scheme.weights
    skip = [*sorted(name for name, entry in plan.items() if entry.scheme is None), "lm_head"]
    if weights.bits == 8 and weights.granularity == "channel" and weights.symmetric:
        return BackendPlan(backend="bitsandbytes", config={"load_in_8bit": True, "skip_modules": skip},
                           notes=["LLM.int8: int8 weights, one absmax scale per output channel"])
    size = weights.group_size_for(first.module.in_features)
    if weights.bits == 4 and weights.granularity == "group" and size == BNB_4BIT_BLOCK and weights.symmetric:
        return BackendPlan(backend="bitsandbytes", notes=["NF4: bitsandbytes' 4-bit grid (normal-float levels), absmax per 64 weights"],
                           config={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16",
                                   "skip_modules": skip})
    raise _refuse(recipe, recipe_file, f"{first.source}.weights",
                  f"bitsandbytes writes 8-bit per channel symmetric (LLM.int8) or 4-bit symmetric in groups of {BNB_4BIT_BLOCK} (NF4)")
