"""Recipe -> llm-compressor recipe, checked against a concrete model and against what vLLM can serve.

The model is described by a ModelLayout (module names and Linear shapes), built from config.json by
instantiating the architecture on the meta device: no weights are read. Every problem is reported
before any heavy work, as an InputError naming the recipe file and the recipe field.

A recipe may say `group_size: auto` (or `{auto: N}`): the compiler gives each layer the largest power of
two up to the cap (128 by default) that divides its input size, so one recipe applies to a hidden-256
model (group 128 everywhere) and to a hidden-576 one (64 where the input is 576, 128 on down_proj's 1536).
A fixed group size that does not divide a layer is refused with the sizes that would and the line to write.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict

from pipelines.errors import InputError
from pipelines.manifest import read_model_config
from pipelines.recipe import GroupScheme, Override, Recipe, WeightScheme, auto_group_sizes, load_recipe

Kind = Literal["attention", "mlp"]

# Target regexes (compressed-tensors "re:" = re.match on the module name) per layer group.
GROUP_SUFFIX: dict[Kind, str] = {
    "attention": r"self_attn\.(q|k|v|o)_proj$",
    "mlp": r"mlp\.(gate|up|down)_proj$",
}
GROUP_TARGET: dict[Kind, str] = {kind: f"re:.*{suffix}" for kind, suffix in GROUP_SUFFIX.items()}
# vLLM fuses these shards into one Linear, which can carry only one scheme.
FUSED_SHARDS: dict[Kind, tuple[str, ...]] = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
SIXTEEN_BIT = "16-bit"


class LinearInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    in_features: int
    out_features: int
    kind: Kind | None = None
    layer: int | None = None

    @property
    def shard(self) -> str:
        return self.name.rsplit(".", 1)[-1]


class ModelLayout(BaseModel):
    """What the compiler needs to know about a model: its Linear layers, embeddings and lm_head."""

    model_config = ConfigDict(frozen=True)

    architecture: str
    num_layers: int
    linears: list[LinearInfo]
    embeddings: list[str]
    lm_head: str | None
    # The lm_head's shape when known (a quantized lm_head's group size is checked against its input size).
    lm_head_linear: LinearInfo | None = None

    def of_kind(self, kind: Kind) -> list[LinearInfo]:
        return [info for info in self.linears if info.kind == kind]


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


# --------------------------------------------------------------------------------------- layout


def layout_from_model_dir(model_dir: Path) -> ModelLayout:
    return layout_from_config(read_model_config(model_dir), model_dir / "config.json")


def layout_from_config(config: dict[str, Any], source: Path | str = "config.json") -> ModelLayout:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipelines.planner import check_config_bounds

    check_config_bounds(config, str(source))  # a meta model still loops over its layers: bound them first
    model_type = config.get("model_type")
    try:
        hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as error:  # transformers raises its own validation errors for bad field values
        raise InputError(f"cannot build this architecture: {error}", file=source, field="model_type") from None
    lm_head = model.get_output_embeddings()
    names = {module: name for name, module in model.named_modules()}
    return ModelLayout(
        architecture=type(model).__name__,
        num_layers=int(getattr(hf_config, "num_hidden_layers", 0) or 0),
        linears=[
            _linear_info(name, module)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not lm_head
        ],
        embeddings=[name for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)],
        lm_head=names.get(lm_head) if lm_head is not None else None,
        lm_head_linear=_linear_info(names[lm_head], lm_head) if isinstance(lm_head, torch.nn.Linear) and lm_head in names else None,
    )


def _linear_info(name: str, module: Any) -> LinearInfo:
    kind = next((k for k, target in GROUP_TARGET.items() if _matches(target, name)), None)
    layer = _LAYER_INDEX.search(name)
    return LinearInfo(
        name=name,
        in_features=module.in_features,
        out_features=module.out_features,
        kind=kind,
        layer=int(layer.group(1)) if layer else None,
    )


# ---------------------------------------------------------------------------------- compilation


def compile_recipe(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str) -> CompiledRecipe:
    """Check `recipe` against `layout` and vLLM's kernels, then build the llm-compressor recipe."""
    plan = check_recipe(recipe, layout, recipe_file)
    modifiers = _modifiers(recipe, layout, plan)
    return CompiledRecipe(
        recipe=recipe.name,
        recipe_file=str(recipe_file),
        llmcompressor=modifiers,
        yaml=yaml.safe_dump(modifiers, sort_keys=False, width=120),
        layers=_layer_table(recipe, layout, plan),
        needs_calibration=recipe.needs_calibration,
    )


def check_recipe(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str) -> dict[str, ModuleScheme]:
    """Every check compile_recipe makes, without building anything: the per-module plan with each
    `group_size: auto` replaced by the layer's own size; an InputError (file, field) if it cannot apply."""
    check_lm_parts(recipe, layout, recipe_file)
    plan = concrete_schemes(resolve_schemes(recipe, layout, recipe_file), recipe_file)
    check_plan(plan, recipe_file)
    return plan


def cannot_apply(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str = "recipe") -> str | None:
    """Why `recipe` cannot apply to `layout` (one line: field and reason), or None when it can."""
    try:
        check_recipe(recipe, layout, recipe_file)
    except InputError as error:
        return f"{error.field}: {error.message}" if error.field else error.message
    return None


def resolve_schemes(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str) -> dict[str, ModuleScheme]:
    """Module name -> scheme for every attention / MLP Linear, after groups and then overrides (as written:
    `group_size: auto` is resolved per layer by concrete_schemes)."""
    plan: dict[str, ModuleScheme] = {}
    for kind in ("attention", "mlp"):
        scheme = getattr(recipe.groups, kind)
        modules = layout.of_kind(kind)
        if scheme is not None and not modules:
            raise InputError(f"matches no module of {layout.architecture} (target {GROUP_TARGET[kind]})", file=recipe_file, field=f"groups.{kind}")
        for info in modules:
            plan[info.name] = ModuleScheme(module=info, scheme=scheme, source=f"groups.{kind}")
    for index, override in enumerate(recipe.overrides):
        field = f"overrides.{index}"
        selected = _select(override, layout, recipe_file, field)
        for kind in ("attention", "mlp"):
            scheme = getattr(override, kind)
            hits = [info for info in selected if info.kind == kind]
            if scheme is not None and not hits:
                raise InputError("selects no module of this group", file=recipe_file, field=f"{field}.{kind}")
            if override.keep or scheme is not None:
                for info in hits:
                    plan[info.name] = ModuleScheme(module=info, scheme=scheme, source=f"{field}.{kind}" if scheme else field)
    return plan


def _select(override: Override, layout: ModelLayout, recipe_file: Path | str, field: str) -> list[LinearInfo]:
    candidates = [info for info in layout.linears if info.kind is not None]
    if override.layers is not None:
        wanted = set()
        for index in override.layers:
            if not -layout.num_layers <= index < layout.num_layers:
                raise InputError(
                    f"layer {index} does not exist (the model has {layout.num_layers} decoder layers)", file=recipe_file, field=f"{field}.layers"
                )
            wanted.add(index % layout.num_layers)
        candidates = [info for info in candidates if info.layer in wanted]
    if override.match is not None:
        pattern = re.compile(override.match)
        for name in [*layout.embeddings, layout.lm_head]:
            if name and pattern.search(name):
                raise InputError(
                    f"matches {name!r}: embeddings and lm_head are quantized only through groups.embeddings / groups.lm_head with `quantize: true`",
                    file=recipe_file,
                    field=f"{field}.match",
                )
        candidates = [info for info in candidates if pattern.search(info.name)]
    if not candidates:
        raise InputError("selects no attention or MLP Linear layer of this model", file=recipe_file, field=field)
    return candidates


def check_lm_parts(recipe: Recipe, layout: ModelLayout, recipe_file: Path | str) -> None:
    if recipe.groups.embeddings.quantize:
        raise InputError("vLLM does not load quantized input embeddings; leave them 16-bit", file=recipe_file, field="groups.embeddings.quantize")
    lm_head = recipe.groups.lm_head
    if lm_head.quantize:
        if layout.lm_head is None:
            raise InputError("this model has no separate lm_head", file=recipe_file, field="groups.lm_head")
        problem = _weight_only_problem(lm_head.weights)
        if problem:
            raise InputError(problem[1], file=recipe_file, field=f"groups.lm_head.weights.{problem[0]}")
        lm_head_weights(recipe, layout, recipe_file)


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
    return entry.scheme.weights


def concrete_schemes(plan: dict[str, ModuleScheme], recipe_file: Path | str) -> dict[str, ModuleScheme]:
    """Each `group_size: auto` replaced by the module's own size: the largest power of two up to the cap
    that divides its input size. A layer no such size divides is refused (per channel would serve it)."""
    concrete: dict[str, ModuleScheme] = {}
    for name, entry in plan.items():
        scheme = entry.scheme
        if scheme is not None and scheme.weights.auto_group:
            info = entry.module
            weights = scheme.weights.for_layer(info.in_features)
            if weights.auto_group:
                raise InputError(
                    f"group_size auto finds no even group size up to {scheme.weights.group_size.auto} that divides the input "
                    f"size {info.in_features} of {info.name}; quantize it per channel (granularity: channel) or keep it 16-bit",
                    file=recipe_file, field=f"{entry.source}.weights.group_size",
                )
            entry = entry.model_copy(update={"scheme": scheme.model_copy(update={"weights": weights})})
        concrete[name] = entry
    return concrete


def check_plan(plan: dict[str, ModuleScheme], recipe_file: Path | str) -> None:
    """vLLM kernels, group sizes and fused shards, for every module as resolved (group sizes concrete)."""
    for entry in plan.values():
        if entry.scheme is None:
            continue
        problem = vllm_problem(entry.scheme)
        if problem:
            raise InputError(problem[1], file=recipe_file, field=f"{entry.source}.{problem[0]}")
    _check_group_sizes([entry for entry in plan.values() if entry.scheme is not None], recipe_file)
    for entry in plan.values():
        if entry.scheme is not None:
            _check_shapes(entry, recipe_file)
    _check_fused(plan, recipe_file)


def _check_group_sizes(entries: list[ModuleScheme], recipe_file: Path | str) -> None:
    """A fixed group size must divide the input size of every layer it reaches. The refusal names the
    sizes that would divide every layer the same recipe field reaches, and the line to write instead."""
    for entry in entries:
        weights, info = entry.scheme.weights, entry.module
        if weights.granularity != "group" or info.in_features % weights.group_size == 0:
            continue
        field = f"{entry.source}.weights.group_size"
        inputs = sorted({e.module.in_features for e in entries if e.source == entry.source and e.scheme.weights.granularity == "group"})
        floor = 32 if weights.group_size >= 32 else 2
        sizes = [size for size in auto_group_sizes(math.gcd(*inputs), weights.group_size) if size >= floor][:3]
        if sizes:
            advice = f"{', '.join(map(str, sizes))} would; write `group_size: {sizes[0]}` or `group_size: auto`"
        else:
            advice = "no even size up to it would; write `granularity: channel` (one scale per output row)"
        raise InputError(
            f"group_size {weights.group_size} does not divide the input size {info.in_features} of {info.name}; {advice}",
            file=recipe_file,
            field=field,
        )


def _check_shapes(entry: ModuleScheme, recipe_file: Path | str) -> None:
    info = entry.module
    if entry.scheme.activations is None and (info.in_features % 32 or info.out_features % 32):
        raise InputError(
            f"vLLM's CPU 4-bit kernel needs layer sizes that are multiples of 32; {info.name} is "
            f"{info.in_features} -> {info.out_features}",
            file=recipe_file,
            field=f"{entry.source}.weights",
        )


def _check_fused(plan: dict[str, ModuleScheme], recipe_file: Path | str) -> None:
    by_layer: dict[tuple[Kind, int | None, str], list[ModuleScheme]] = {}
    for entry in plan.values():
        info = entry.module
        if info.shard in FUSED_SHARDS[info.kind]:
            prefix = info.name.rsplit(".", 1)[0]
            by_layer.setdefault((info.kind, info.layer, prefix), []).append(entry)
    for (kind, layer, prefix), entries in by_layer.items():
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


def vllm_problem(scheme: GroupScheme) -> tuple[str, str] | None:
    """(sub-field, why) when vLLM 0.32 (CPU build) has no kernel for this scheme, else None."""
    weights, activations = scheme.weights, scheme.activations
    if activations is None:
        problem = _weight_only_problem(weights)
        return (f"weights.{problem[0]}", problem[1]) if problem else None
    if weights.bits != 8:
        return "weights.bits", "quantized activations need 8-bit weights (vLLM serves int8 W8A8, not W4A8 on CPU)"
    if weights.granularity == "group":
        return "weights.granularity", "W8A8 weights must be per channel or per tensor in vLLM"
    if not weights.symmetric:
        return "weights.symmetric", "vLLM's W8A8 kernels need symmetric weights"
    if activations.dynamic and activations.granularity == "tensor":
        return "activations.granularity", "vLLM serves dynamic activation scales per token and static ones per tensor, not dynamic per tensor"
    return None


def _weight_only_problem(weights: WeightScheme) -> tuple[str, str] | None:
    if weights.bits != 4:
        return (
            "bits",
            f"vLLM CPU serves weight-only quantization at 4 bits only (CPUWNA16: uint4); {weights.bits}-bit weights "
            "are refused at load time. Use 4 bits, or 8-bit weights with 8-bit activations",
        )
    if weights.granularity == "tensor":
        return "granularity", "weight-only layers need granularity 'channel' or 'group' in vLLM (pack-quantized format)"
    return None


# ------------------------------------------------------------------------ llm-compressor recipe


def _modifiers(recipe: Recipe, layout: ModelLayout, plan: dict[str, ModuleScheme]) -> dict[str, Any]:
    config_groups = _config_groups(recipe, layout, plan)
    ignore = [layout.lm_head] if layout.lm_head and not recipe.groups.lm_head.quantize else []
    kept = [entry.module for entry in plan.values() if entry.scheme is None]
    for kind in ("attention", "mlp"):
        ignore += _targets([info for info in kept if info.kind == kind], kind, layout)
    quantizer: dict[str, Any] = {}
    if recipe.algorithm.method == "gptq":
        name = "GPTQModifier"
        quantizer = {
            "block_size": recipe.algorithm.block_size,
            "dampening_frac": recipe.algorithm.dampening_frac,
            # explicit null: GPTQModifier would otherwise default to 'static' ordering
            "actorder": "weight" if recipe.algorithm.actorder else None,
        }
    else:
        name = "QuantizationModifier"
    quantizer.update({"ignore": ignore, "config_groups": config_groups})
    _verify_targets(config_groups, ignore, plan, layout)
    modifiers: dict[str, Any] = {}
    if recipe.smoothquant is not None:
        modifiers["SmoothQuantModifier"] = {"smoothing_strength": recipe.smoothquant.strength}
    modifiers[name] = quantizer
    return {"quant_stage": {"quant_modifiers": modifiers}}


def _config_groups(recipe: Recipe, layout: ModelLayout, plan: dict[str, ModuleScheme]) -> dict[str, Any]:
    partitions: dict[tuple[str, GroupScheme], list[LinearInfo]] = {}
    for entry in plan.values():
        if entry.scheme is not None:
            partitions.setdefault((entry.module.kind, entry.scheme), []).append(entry.module)
    groups: dict[str, Any] = {}
    for (kind, scheme), modules in partitions.items():
        name = kind if kind not in groups else f"{kind}_{sum(key.startswith(kind) for key in groups)}"
        groups[name] = {"targets": _targets(modules, kind, layout), **_scheme_args(scheme)}
    if recipe.groups.lm_head.quantize:
        groups["lm_head"] = {"targets": [layout.lm_head], "weights": _weight_args(lm_head_weights(recipe, layout, "recipe"))}
    return groups


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
    if names == {info.name for info in everything}:
        return [GROUP_TARGET[kind]]
    shards = {info.shard for info in modules}
    suffix = _shard_suffix(kind, shards)
    if names == {info.name for info in everything if info.shard in shards}:
        return [f"re:.*{suffix}"]
    layers = sorted({info.layer for info in modules if info.layer is not None})
    in_layers = [info for info in everything if info.layer in layers]
    layer_regex = rf"re:.*\.layers\.({'|'.join(map(str, layers))})\."
    if names == {info.name for info in in_layers}:
        return [layer_regex + GROUP_SUFFIX[kind]]
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
    return args


def _matches(target: str, name: str) -> bool:
    """compressed-tensors' rule: 're:' targets are re.match'ed, others compared with the module name."""
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def _verify_targets(groups: dict[str, Any], ignore: list[str], plan: dict[str, ModuleScheme], layout: ModelLayout) -> None:
    """Every module must be claimed by exactly the config group of its scheme (a guard on _targets)."""
    for info in layout.linears:
        entry = plan.get(info.name)
        claimed = [name for name, group in groups.items() if any(_matches(t, info.name) for t in group["targets"])]
        ignored = any(_matches(t, info.name) for t in ignore)
        quantized = bool(claimed) and not ignored
        expected = entry is not None and entry.scheme is not None
        if quantized != expected or len(claimed) > 1:
            raise AssertionError(f"compiled targets claim {info.name} wrongly: groups {claimed}, ignored {ignored}")


# ------------------------------------------------------------------------------- layer summary


def scheme_summary(scheme: GroupScheme | WeightScheme | None) -> str:
    """e.g. 'w8 channel sym / a8 token dynamic', 'w4 group128 sym / a16', '16-bit'."""
    if scheme is None:
        return SIXTEEN_BIT
    weights = scheme if isinstance(scheme, WeightScheme) else scheme.weights
    activations = None if isinstance(scheme, WeightScheme) else scheme.activations
    if weights.granularity != "group":
        granularity = weights.granularity
    elif weights.auto_group:
        granularity = f"group auto (up to {weights.group_size.auto})"
    else:
        granularity = f"group{weights.group_size}"
    left = f"w{weights.bits} {granularity} {'sym' if weights.symmetric else 'asym'}"
    if activations is None:
        return f"{left} / a16"
    mode = "dynamic" if activations.dynamic else "static"
    sym = "" if activations.symmetric else " asym"
    return f"{left} / a{activations.bits} {activations.granularity} {mode}{sym}"


def _layer_table(recipe: Recipe, layout: ModelLayout, plan: dict[str, ModuleScheme]) -> dict[str, str]:
    table = {name: SIXTEEN_BIT for name in layout.embeddings}
    for info in layout.linears:
        entry = plan.get(info.name)
        table[info.name] = scheme_summary(entry.scheme if entry else None)
    if layout.lm_head:
        table[layout.lm_head] = scheme_summary(lm_head_weights(recipe, layout, "recipe"))
    return table


def compile_file(recipe_name_or_path: str, model_dir: Path) -> CompiledRecipe:
    """load_recipe + layout_from_model_dir + compile_recipe."""
    recipe, path, _ = load_recipe(recipe_name_or_path)
    return compile_recipe(recipe, layout_from_model_dir(model_dir), path)

