"""Recipe -> llm-compressor recipe, checked against a concrete model and against what vLLM can serve on
the serve target (pipelines.hardware.targets: the CPU build or a GPU's compute capability).

What scheme a recipe gives a module (its group's, then each override that selects it) is `scheme_for`,
the one answer the planner also counts bytes by.

The model is described by a ModelLayout (pipelines.quantize.layout: module names and Linear shapes from config.json,
no weights read). Every problem is reported before any heavy work, as an InputError naming the recipe file and the
recipe field.

A recipe may say `group_size: auto` (or `{auto: N}`): the compiler gives each layer the largest power of
two up to the cap (128 by default) that divides its input size, so one recipe applies to a hidden-256
model (group 128 everywhere) and to a hidden-576 one (64 where the input is 576, 128 on down_proj's 1536).
A fixed group size that does not divide a layer is refused with the sizes that would and the line to write.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field

from pipelines.errors import InputError
from pipelines.hardware.targets import Layer, ServeTarget, installed_target, kv_cache_problem, serve_problem
from pipelines.quantize.layout import FUSED_SHARDS, GROUP_SUFFIX, GROUP_TARGET, KINDS, Kind, LinearInfo, ModelLayout, _matches, layout_from_model_dir
from pipelines.recipe import Algorithm, AutoGroupSize, GroupScheme, KvCache, Method, Override, Recipe, WeightScheme, auto_group_sizes, load_recipe

SIXTEEN_BIT = "16-bit"


class ModuleScheme(BaseModel):
    """The scheme one module ends up with, and the recipe field it came from."""

    model_config = ConfigDict(frozen=True)

    module: LinearInfo
    scheme: GroupScheme | None
    source: str


class CompiledRecipe(BaseModel):
    recipe: str
    recipe_file: str
    llmcompressor: dict[str, Any]
    yaml: str
    layers: dict[str, str]
    needs_calibration: bool
    kv_cache: KvCache = KvCache()
    # the checked per-module plan the llm-compressor recipe was built from (what other backends compile from)
    plan: dict[str, ModuleScheme] = Field(default={}, exclude=True, repr=False)


# ---------------------------------------------------------------------------------- compilation


def compile_recipe(
    recipe: Recipe, layout: ModelLayout, recipe_file: Path | str, target: ServeTarget | None = None,
) -> CompiledRecipe:
    """Check `recipe` against `layout` and what vLLM serves on `target` (default: the installed serve
    environment's), then build the llm-compressor recipe."""
    plan = check_recipe(recipe, layout, recipe_file, target)
    modifiers = _modifiers(recipe, layout, plan)
    return CompiledRecipe(
        recipe=recipe.name,
        recipe_file=str(recipe_file),
        llmcompressor=modifiers,
        yaml=yaml.safe_dump(modifiers, sort_keys=False, width=120),
        layers=_layer_table(recipe, layout, plan),
        needs_calibration=recipe.needs_calibration,
        kv_cache=recipe.kv_cache,
        plan=plan,
    )


def check_recipe(
    recipe: Recipe, layout: ModelLayout, recipe_file: Path | str, target: ServeTarget | None = None,
) -> dict[str, ModuleScheme]:
    """Every check compile_recipe makes, without building anything: the per-module plan with each
    `group_size: auto` replaced by the layer's own size; an InputError (file, field) if it cannot apply."""
    target = target or installed_target()
    check_lm_parts(recipe, layout, recipe_file, target)
    plan = concrete_schemes(resolve_schemes(recipe, layout, recipe_file), recipe_file)
    check_plan(plan, recipe_file, target)
    check_kv_cache(recipe, layout, recipe_file, target)
    return plan


def check_kv_cache(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str, target: ServeTarget) -> None:
    """The recipe's KV cache precision against what vLLM's attention stores on `target` for this model's head size."""
    problem = kv_cache_problem(recipe.kv_cache, target, layout.head_dim)
    if problem:
        raise InputError(problem.why, file=recipe_file, field=_field("kv_cache", problem.field))


def cannot_apply(
    recipe: Recipe, layout: ModelLayout, recipe_file: Path | str = "recipe", target: ServeTarget | None = None,
) -> str | None:
    """Why `recipe` cannot apply to `layout` on `target` (one line: field and reason), or None when it can."""
    try:
        check_recipe(recipe, layout, recipe_file, target)
    except InputError as error:
        return f"{error.field}: {error.message}" if error.field else error.message
    return None


class Module(Protocol):
    """What a recipe's groups and overrides select a Linear by (LinearInfo here, the planner's own Linears)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> Kind | None: ...
    @property
    def layer(self) -> int | None: ...


def selects(override: Override, module: Module, num_layers: int) -> bool:
    """Whether `override` reaches `module`: an attention / MLP Linear in one of its layers (negative indices
    count from the end) whose name its `match` regex is found in; both conditions ANDed when given."""
    if module.kind is None:
        return False
    if override.layers is not None and (num_layers < 1 or module.layer not in {i % num_layers for i in override.layers}):
        return False
    return override.match is None or re.search(override.match, module.name) is not None


def scheme_source(recipe: Recipe, module: Module, num_layers: int) -> tuple[GroupScheme | None, str]:
    """The scheme `recipe` gives `module` and the recipe field it comes from: its group's, then each
    override that selects it, in order (a later one wins; `keep` means 16-bit). `group_size: auto` as written."""
    if module.kind is None:
        return None, "groups"
    scheme: GroupScheme | None = getattr(recipe.groups, module.kind)
    source = f"groups.{module.kind}"
    for index, override in enumerate(recipe.overrides):
        if not selects(override, module, num_layers):
            continue
        if override.keep:
            scheme, source = None, f"overrides.{index}"
        elif getattr(override, module.kind) is not None:
            scheme, source = getattr(override, module.kind), f"overrides.{index}.{module.kind}"
    return (scheme.with_method(recipe.algorithm.method) if scheme is not None else None), source


def scheme_for(recipe: Recipe, module: Module, num_layers: int) -> GroupScheme | None:
    """The recipe's semantics in one place: the scheme `recipe` gives `module` (None: 16-bit). The compiler
    and the planner both ask this."""
    return scheme_source(recipe, module, num_layers)[0]


def resolve_schemes(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str) -> dict[str, ModuleScheme]:
    """Module name -> scheme for every attention / MLP Linear, after groups and then overrides (as written:
    `group_size: auto` is resolved per layer by concrete_schemes)."""
    _check_selections(recipe, layout, recipe_file)
    plan: dict[str, ModuleScheme] = {}
    for kind in KINDS:
        for info in layout.of_kind(kind):
            scheme, source = scheme_source(recipe, info, layout.num_layers)
            plan[info.name] = ModuleScheme(module=info, scheme=scheme, source=source)
    return plan


def _check_selections(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str) -> None:
    """Every group with a scheme and every override must reach some module of this model."""
    for kind in KINDS:
        if getattr(recipe.groups, kind) is not None and not layout.of_kind(kind):
            raise InputError(f"matches no module of {layout.architecture} (target {GROUP_TARGET[kind]})", file=recipe_file, field=f"groups.{kind}")
    for index, override in enumerate(recipe.overrides):
        field = f"overrides.{index}"
        selected = _select(override, layout, recipe_file, field)
        for kind in KINDS:
            if getattr(override, kind) is not None and not any(info.kind == kind for info in selected):
                raise InputError("selects no module of this group", file=recipe_file, field=f"{field}.{kind}")


def _select(override: Override, layout: ModelLayout, recipe_file: Path | str, field: str) -> list[LinearInfo]:
    for index in override.layers or []:
        if not -layout.num_layers <= index < layout.num_layers:
            raise InputError(
                f"layer {index} does not exist (the model has {layout.num_layers} decoder layers)", file=recipe_file, field=f"{field}.layers"
            )
    if override.match is not None:
        pattern = re.compile(override.match)
        for name in [*layout.embeddings, layout.lm_head]:
            if name and pattern.search(name):
                raise InputError(
                    f"matches {name!r}: embeddings and lm_head are quantized only through groups.embeddings / groups.lm_head with `quantize: true`",
                    file=recipe_file,
                    field=f"{field}.match",
                )
    candidates = [info for info in layout.linears if selects(override, info, layout.num_layers)]
    if not candidates:
        raise InputError("selects no attention or MLP Linear layer of this model", file=recipe_file, field=field)
    return candidates


def check_lm_parts(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str, target: ServeTarget) -> None:
    if recipe.groups.embeddings.quantize:
        raise InputError("vLLM does not load quantized input embeddings; leave them 16-bit", file=recipe_file, field="groups.embeddings.quantize")
    lm_head = recipe.groups.lm_head
    if lm_head.quantize and lm_head.weights is not None:
        if layout.lm_head is None:
            raise InputError("this model has no separate lm_head", file=recipe_file, field="groups.lm_head")
        _check_lm_head_served(lm_head.weights, recipe_file, target)  # as written (bits, granularity) ...
        concrete = lm_head_weights(recipe, layout, recipe_file)
        if concrete is not None:
            _check_lm_head_served(concrete, recipe_file, target)  # ... then with `auto` made concrete


def _check_lm_head_served(weights: WeightScheme, recipe_file: Path | str, target: ServeTarget) -> None:
    problem = serve_problem(GroupScheme(weights=weights), target)
    if problem:
        raise InputError(problem.why, file=recipe_file, field=_field("groups.lm_head", problem.field))


def lm_head_weights(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str) -> WeightScheme | None:
    """The quantized lm_head's weight scheme with its group size resolved (None: lm_head stays 16-bit)."""
    group = recipe.groups.lm_head
    if not group.quantize or group.weights is None:
        return None
    if layout.lm_head_linear is None:
        if group.weights.auto_group:
            raise InputError("group_size auto needs the lm_head's input size, which this model layout does not give",
                             file=recipe_file, field="groups.lm_head.weights.group_size")
        return group.weights
    entry = ModuleScheme(module=layout.lm_head_linear, scheme=GroupScheme(weights=group.weights), source="groups.lm_head")
    (entry,) = concrete_schemes({entry.module.name: entry}, recipe_file).values()
    _check_group_sizes([entry], recipe_file)
    return _weights(entry)


def _weights(entry: ModuleScheme) -> WeightScheme:
    """The weight scheme of an entry that is quantized (the callers' lists hold only those)."""
    assert entry.scheme is not None
    return entry.scheme.weights


def concrete_schemes(plan: dict[str, ModuleScheme], recipe_file: Path | str) -> dict[str, ModuleScheme]:
    """Each `group_size: auto` replaced by the module's own size: the largest power of two up to the cap
    that divides its input size. A layer no such size divides is refused (per channel would serve it)."""
    concrete: dict[str, ModuleScheme] = {}
    for name, entry in plan.items():
        scheme = entry.scheme
        if scheme is not None and isinstance(cap := scheme.weights.group_size, AutoGroupSize):
            info = entry.module
            weights = scheme.weights.for_layer(info.in_features)
            if weights.auto_group:
                raise InputError(
                    f"group_size auto finds no even group size up to {cap.auto} that divides the input "
                    f"size {info.in_features} of {info.name}; quantize it per channel (granularity: channel) or keep it 16-bit",
                    file=recipe_file, field=f"{entry.source}.weights.group_size",
                )
            entry = entry.model_copy(update={"scheme": scheme.model_copy(update={"weights": weights})})
        concrete[name] = entry
    return concrete


def check_plan(plan: dict[str, ModuleScheme], recipe_file: Path | str, target: ServeTarget) -> None:
    """vLLM kernels on `target`, group sizes and fused shards, for every module as resolved (group sizes
    concrete): first each scheme, then that every group size divides its layers, then each layer's shape as
    vLLM serves it (fused shards as one layer)."""
    quantized = [entry for entry in plan.values() if entry.scheme is not None]
    for entry in quantized:
        _check_served(entry, recipe_file, target)
    _check_group_sizes(quantized, recipe_file)
    for entry, layer in served_layers(quantized):
        _check_served(entry, recipe_file, target, layer)
    _check_fused(plan, recipe_file)


def served_layers(entries: list[ModuleScheme]) -> list[tuple[ModuleScheme, Layer]]:
    """Each Linear as vLLM serves it, whose shape its kernels judge: q/k/v (gate/up) of one layer fused into
    one, their output sizes summed (vLLM's output_size_per_partition), when they share a scheme (else each
    alone: _check_fused refuses the split); every other module as it is."""
    fused: dict[tuple[Kind, str], list[ModuleScheme]] = {}
    layers: list[tuple[ModuleScheme, Layer]] = []
    for entry in entries:
        info = entry.module
        if info.kind is not None and info.shard in FUSED_SHARDS[info.kind]:
            fused.setdefault((info.kind, info.name.rsplit(".", 1)[0]), []).append(entry)
        else:
            layers.append((entry, Layer(info.name, info.in_features, info.out_features)))
    for (_kind, prefix), shards in fused.items():
        if len({entry.scheme for entry in shards}) == 1:
            name = f"{prefix}.{'+'.join(entry.module.shard for entry in shards)}"
            layers.append((shards[0], Layer(name, shards[0].module.in_features, sum(e.module.out_features for e in shards))))
        else:
            layers += [(e, Layer(e.module.name, e.module.in_features, e.module.out_features)) for e in shards]
    order = {id(entry): index for index, entry in enumerate(entries)}
    return sorted(layers, key=lambda pair: order[id(pair[0])])


def _check_served(entry: ModuleScheme, recipe_file: Path | str, target: ServeTarget, layer: Layer | None = None) -> None:
    problem = serve_problem(entry.scheme, target, layer) if entry.scheme is not None else None
    if problem:
        raise InputError(problem.why, file=recipe_file, field=_field(entry.source, problem.field))


def _field(source: str, sub_field: str) -> str:
    return f"{source}.{sub_field}" if sub_field else source


def _check_group_sizes(entries: list[ModuleScheme], recipe_file: Path | str) -> None:
    """A fixed group size must divide the input size of every layer it reaches. The refusal names the
    sizes that would divide every layer the same recipe field reaches, and the line to write instead."""
    for entry in entries:
        weights, info = _weights(entry), entry.module
        size = weights.group_size  # concrete here: `auto` was resolved or refused
        if weights.granularity != "group" or not isinstance(size, int) or info.in_features % size == 0:
            continue
        field = f"{entry.source}.weights.group_size"
        inputs = sorted({e.module.in_features for e in entries if e.source == entry.source and _weights(e).granularity == "group"})
        floor = 32 if size >= 32 else 2
        sizes = [fit for fit in auto_group_sizes(math.gcd(*inputs), size) if fit >= floor][:3]
        if sizes:
            advice = f"{', '.join(map(str, sizes))} would; write `group_size: {sizes[0]}` or `group_size: auto`"
        else:
            advice = "no even size up to it would; write `granularity: channel` (one scale per output row)"
        raise InputError(
            f"group_size {size} does not divide the input size {info.in_features} of {info.name}; {advice}",
            file=recipe_file,
            field=field,
        )


def _check_fused(plan: dict[str, ModuleScheme], recipe_file: Path | str) -> None:
    by_layer: dict[tuple[Kind, int | None, str], list[ModuleScheme]] = {}
    for entry in plan.values():
        info = entry.module
        if info.kind is not None and info.shard in FUSED_SHARDS[info.kind]:
            prefix = info.name.rsplit(".", 1)[0]
            by_layer.setdefault((info.kind, info.layer, prefix), []).append(entry)
    for (kind, _layer, prefix), entries in by_layer.items():
        if len({entry.scheme for entry in entries}) > 1:
            sources = ", ".join(f"{e.module.shard} from {e.source}" for e in entries)
            raise InputError(
                f"vLLM fuses {'/'.join(FUSED_SHARDS[kind])} of {prefix} into one layer with one scheme, "
                f"but they get different schemes ({sources})",
                file=recipe_file,
                field=max(entries, key=_override_rank).source,  # the latest override made the split
            )


def _override_rank(entry: ModuleScheme) -> int:
    parts = entry.source.split(".")
    return int(parts[1]) if parts[0] == "overrides" else -1


# ------------------------------------------------------------------------ llm-compressor recipe


# llm-compressor's kv_cache_scheme for calibrated FP8 KV scales: one static per-tensor scale for each attention layer's
# K and V (what vLLM's compressed-tensors KV method loads: float, 8 bits, tensor or attn_head, symmetric).
KV_CACHE_SCHEME: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# The llm-compressor modifier that applies each weight algorithm; a recipe mixing them runs one of each in the same
# stage, each over its own modules' config groups (GPTQModifier calibrates only the modules its targets match).
MODIFIER_OF: dict[Method, str] = {"rtn": "QuantizationModifier", "gptq": "GPTQModifier"}
# GPTQ's settings for groups that ask for it in a recipe whose own algorithm is round-to-nearest (the shipped gptq
# recipe's: actorder 'weight' changes only the calibration order, so the checkpoint keeps plain contiguous groups).
GPTQ_DEFAULTS = Algorithm(method="gptq", actorder="weight")


def _modifiers(recipe: Recipe, layout: ModelLayout, plan: dict[str, ModuleScheme]) -> dict[str, Any]:
    by_method = _config_groups(recipe, layout, plan)
    ignore = [layout.lm_head] if layout.lm_head and not recipe.groups.lm_head.quantize else []
    kept = [entry.module for entry in plan.values() if entry.scheme is None]
    for kind in ("attention", "mlp"):
        ignore += _targets([info for info in kept if info.kind == kind], kind, layout)
    _verify_targets(by_method, ignore, plan, layout)
    modifiers: dict[str, Any] = {}
    if recipe.smoothquant is not None:
        # Never llm-compressor's mapping by architecture name: quantize traces the loaded model and checks the
        # mappings before calibration (pipelines.quantize.smoothing); the manifest's compiled_recipe holds them.
        modifiers["SmoothQuantModifier"] = {
            "smoothing_strength": recipe.smoothquant.strength,
            "mappings": "derived at quantize time from the model's forward, checked before calibration (docs/calibration.md)",
        }
    for method, config_groups in by_method.items():
        modifiers[MODIFIER_OF[method]] = {**_algorithm_args(recipe, method), "ignore": list(ignore), "config_groups": config_groups}
    if recipe.kv_cache.scales == "calibrated":
        # One modifier calibrates the KV scales: the round-to-nearest one when there is one (it runs first), else GPTQ's;
        # a recipe that quantizes no weights gets a QuantizationModifier of its own.
        holder = modifiers.setdefault(MODIFIER_OF["rtn"] if "rtn" in by_method or not by_method else MODIFIER_OF["gptq"], {})
        holder["kv_cache_scheme"] = KV_CACHE_SCHEME
    return {"quant_stage": {"quant_modifiers": modifiers}} if modifiers else {}


def gptq_settings(recipe: Recipe) -> Algorithm:
    """GPTQ's block size, dampening and column order for the groups of `recipe` that GPTQ quantizes."""
    return recipe.algorithm if recipe.algorithm.method == "gptq" else GPTQ_DEFAULTS


def _algorithm_args(recipe: Recipe, method: Method) -> dict[str, Any]:
    if method != "gptq":
        return {}
    algorithm = gptq_settings(recipe)
    return {
        "block_size": algorithm.block_size,
        "dampening_frac": algorithm.dampening_frac,
        # explicit null: GPTQModifier would otherwise default to 'static' ordering
        "actorder": "weight" if algorithm.actorder else None,
    }


def _config_groups(recipe: Recipe, layout: ModelLayout, plan: dict[str, ModuleScheme]) -> dict[Method, dict[str, Any]]:
    """Per weight algorithm, its config groups: one per (kind, scheme), named attention, mlp, attention_1, ...
    A quantized lm_head goes with the recipe's own algorithm."""
    partitions: dict[tuple[Kind, GroupScheme], list[LinearInfo]] = {}
    for entry in plan.values():
        if entry.scheme is not None and entry.module.kind is not None:
            partitions.setdefault((entry.module.kind, entry.scheme), []).append(entry.module)
    by_method: dict[Method, dict[str, Any]] = {}
    names: list[str] = []
    for (kind, scheme), modules in partitions.items():
        name = kind if kind not in names else f"{kind}_{sum(key.startswith(kind) for key in names)}"
        names.append(name)
        groups = by_method.setdefault(scheme.algorithm or recipe.algorithm.method, {})
        groups[name] = {"targets": _targets(modules, kind, layout), **_scheme_args(scheme)}
    lm_head = lm_head_weights(recipe, layout, "recipe")
    if lm_head is not None:
        by_method.setdefault(recipe.algorithm.method, {})["lm_head"] = {"targets": [layout.lm_head], "weights": _weight_args(lm_head)}
    return dict(sorted(by_method.items(), key=lambda item: item[0] != "rtn"))  # round-to-nearest first, as written


def _shard_suffix(kind: Kind, shards: set[str]) -> str:
    r"""GROUP_SUFFIX narrowed to some shards, in its own order: `mlp\.(gate|up)_proj$`."""
    head, alternatives = GROUP_SUFFIX[kind].split("(")
    short = [name for name in alternatives.split(")")[0].split("|") if f"{name}_proj" in shards]
    return f"{head}{short[0]}_proj$" if len(short) == 1 else f"{head}({'|'.join(short)})_proj$"


def _targets(modules: list[LinearInfo], kind: Kind, layout: ModelLayout) -> list[str]:
    """The shortest readable target list for these modules: the group regex, a shard regex (every
    layer's gate/up), a layer regex, both, or names."""
    if not modules:
        return []
    names = {info.name for info in modules}
    everything = layout.of_kind(kind)
    group_suffix = _shard_suffix(kind, {info.shard for info in everything})  # the shards this model has
    if names == {info.name for info in everything}:
        return [f"re:.*{group_suffix}"]
    shards = {info.shard for info in modules}
    suffix = _shard_suffix(kind, shards)
    if names == {info.name for info in everything if info.shard in shards}:
        return [f"re:.*{suffix}"]
    layers = sorted({info.layer for info in modules if info.layer is not None})
    in_layers = [info for info in everything if info.layer in layers]
    layer_regex = rf"re:.*\.layers\.({'|'.join(map(str, layers))})\."
    if names == {info.name for info in in_layers}:
        return [layer_regex + group_suffix]
    if names == {info.name for info in in_layers if info.shard in shards}:
        return [layer_regex + suffix]
    return sorted(names)


def _scheme_args(scheme: GroupScheme) -> dict[str, Any]:
    args: dict[str, Any] = {"weights": _weight_args(scheme.weights)}
    activations = scheme.activations
    if activations is not None:
        args["input_activations"] = {
            "num_bits": activations.bits,
            "type": activations.type,
            "symmetric": activations.symmetric,
            "strategy": activations.granularity,
            "dynamic": activations.dynamic,
            **({"group_size": activations.group_size} if activations.group_size is not None else {}),
        }
    return args


def _weight_args(weights: WeightScheme) -> dict[str, Any]:
    args: dict[str, Any] = {
        "num_bits": weights.bits,
        "type": weights.type,
        "symmetric": weights.symmetric,
        "strategy": weights.granularity,
    }
    if weights.group_size is not None:
        args["group_size"] = weights.group_size
    if weights.block_shape is not None:
        args["block_structure"] = list(weights.block_shape)
    return args


def _verify_targets(by_method: dict[Method, dict[str, Any]], ignore: list[str], plan: dict[str, ModuleScheme], layout: ModelLayout) -> None:
    """Every module must be claimed by exactly one config group of all the modifiers', the one of its scheme
    (a guard on _targets)."""
    groups = {name: (method, group) for method, method_groups in by_method.items() for name, group in method_groups.items()}
    for info in layout.linears:
        entry = plan.get(info.name)
        claimed = [name for name, (_, group) in groups.items() if any(_matches(t, info.name) for t in group["targets"])]
        ignored = any(_matches(t, info.name) for t in ignore)
        quantized = bool(claimed) and not ignored
        expected = entry is not None and entry.scheme is not None
        if quantized != expected or len(claimed) > 1:
            raise AssertionError(f"compiled targets claim {info.name} wrongly: groups {claimed}, ignored {ignored}")
        if quantized and entry is not None and entry.scheme is not None:
            method, group = groups[claimed[0]]
            if method != entry.scheme.algorithm or group["weights"] != _weight_args(entry.scheme.weights):
                raise AssertionError(f"compiled group {claimed[0]} ({method}) does not carry {info.name}'s scheme")


# ------------------------------------------------------------------------------- layer summary


def kv_summary(kv: KvCache) -> str:
    """e.g. 'auto (the serve dtype)', 'fp8, scales dynamic', 'fp8, scales calibrated'."""
    return "auto (the serve dtype)" if kv.dtype == "auto" else f"{kv.dtype}, scales {kv.scales}"


def scheme_summary(scheme: GroupScheme | WeightScheme | None) -> str:
    """e.g. 'w8 channel sym / a8 token dynamic', 'w4 group128 sym / a16', 'w4 group64 sym / a16, gptq' (GPTQ weights;
    round-to-nearest is not named), '16-bit'."""
    if scheme is None:
        return SIXTEEN_BIT
    if isinstance(scheme, GroupScheme) and scheme.algorithm == "gptq":
        return f"{scheme_summary(scheme.model_copy(update={'algorithm': None}))}, gptq"
    weights = scheme if isinstance(scheme, WeightScheme) else scheme.weights
    activations = None if isinstance(scheme, WeightScheme) else scheme.activations
    granularity: str
    if weights.block_shape is not None:
        granularity = f"block{weights.block_shape[0]}x{weights.block_shape[1]}"
    elif weights.granularity != "group":
        granularity = weights.granularity
    elif isinstance(weights.group_size, AutoGroupSize):
        granularity = f"group auto (up to {weights.group_size.auto})"
    else:
        granularity = f"group{weights.group_size}"
    left = f"{_number(weights.type, weights.bits)} {granularity} {'sym' if weights.symmetric else 'asym'}"
    if activations is None:
        return f"{left} / a16"
    mode = "dynamic" if activations.dynamic else "static"
    sym = "" if activations.symmetric else " asym"
    grain = f"group{activations.group_size}" if activations.group_size else activations.granularity
    return f"{left} / {_number(activations.type, activations.bits, 'a')} {grain} {mode}{sym}"


def _number(kind: str, bits: int, letter: str = "w") -> str:
    """'w8' for int weights (as always), 'w-fp8' for float ones; 'a8' / 'a-fp8' for activations."""
    return f"{letter}{bits}" if kind == "int" else f"{letter}-fp{bits}"


def _layer_table(recipe: Recipe, layout: ModelLayout, plan: dict[str, ModuleScheme]) -> dict[str, str]:
    table = dict.fromkeys(layout.embeddings, SIXTEEN_BIT)
    for info in layout.linears:
        entry = plan.get(info.name)
        table[info.name] = scheme_summary(entry.scheme if entry else None)
    if layout.lm_head:
        table[layout.lm_head] = scheme_summary(lm_head_weights(recipe, layout, "recipe"))
    return table


def compile_file(recipe_name_or_path: str, model_dir: Path, target: ServeTarget | None = None) -> CompiledRecipe:
    """load_recipe + layout_from_model_dir + compile_recipe (for `target`, default the installed one)."""
    loaded = load_recipe(recipe_name_or_path)
    return compile_recipe(loaded.recipe, layout_from_model_dir(model_dir), loaded.path, target)

