"""A model as the compiler sees it: its Linear layers by group (attention, MLP), embeddings and lm_head, built from
config.json by instantiating the architecture on the meta device (no weights are read). An architecture the groups cannot
cover (an encoder-decoder, a multimodal model, routed experts, weights in the decoder layers no group names, no `layers`
list) is refused here, naming it and what is missing. The planner and the repair read the same layout."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipelines.artifact import read_model_config
from pipelines.bounds import check_config_bounds
from pipelines.errors import InputError

Kind = Literal["attention", "mlp"]
KINDS: tuple[Kind, ...] = ("attention", "mlp")

# Target regexes (compressed-tensors "re:" = re.match on the module name) per layer group: Llama-style
# shards, and the fused modules Phi-3's checkpoint already holds (qkv_proj, gate_up_proj). A compiled recipe
# names only the shards its model has (_targets): a Llama's recipe reads `self_attn\.(q|k|v|o)_proj$`, as before.
GROUP_SUFFIX: dict[Kind, str] = {
    "attention": r"self_attn\.(q|k|v|o|qkv)_proj$",
    "mlp": r"mlp\.(gate|up|down|gate_up)_proj$",
}


GROUP_TARGET: dict[Kind, str] = {kind: f"re:.*{suffix}" for kind, suffix in GROUP_SUFFIX.items()}
# vLLM fuses these shards into one Linear, which can carry only one scheme (a checkpoint's own qkv_proj or
# gate_up_proj is one Linear already).
FUSED_SHARDS: dict[Kind, tuple[str, ...]] = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
CHECKPOINT_FUSED: dict[Kind, str] = {"attention": "qkv_proj", "mlp": "gate_up_proj"}  # the same, one module already
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


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
    head_dim: int | None = Field(default=None, description="the attention head size (an FP8 KV cache on CPU needs a multiple of 32)")

    def of_kind(self, kind: Kind) -> list[LinearInfo]:
        return [info for info in self.linears if info.kind == kind]


def layout_from_model_dir(model_dir: Path) -> ModelLayout:
    return layout_from_config(read_model_config(model_dir), model_dir / "config.json")


def layout_from_config(config: dict[str, Any], source: Path | str = "config.json") -> ModelLayout:
    """The model's Linear layers, from config.json on the meta device. An architecture the groups cannot cover
    is refused here, in one line naming it and what is missing: before any weights are read."""
    import torch  # heavy: imported when used
    import transformers  # heavy: imported when used
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: imported when used

    check_config_bounds(config, str(source))  # a meta model still loops over its layers: bound them first
    arch = architecture_name(config)
    refusal = quantize_refusal(config)
    if refusal is not None:
        raise InputError(f"{arch} is {refusal[1]}", file=source, field=refusal[0])
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InputError("missing: transformers builds a model by its model_type", file=source, field="model_type")
    try:
        hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    except Exception as error:  # transformers raises its own validation errors for bad field values
        raise InputError(f"{arch}: transformers {transformers.__version__} cannot read this config: {_first_line(error)}",
                         file=source, field="model_type") from None
    if getattr(hf_config, "is_encoder_decoder", False):  # said by the model's own config class, not config.json
        raise InputError(f"{arch} is an encoder-decoder model: the product quantizes decoder-only causal language models",
                         file=source, field="model_type")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as error:
        raise InputError(f"{arch}: transformers {transformers.__version__} cannot build it as a causal language model: "
                         f"{_first_line(error)}", file=source, field="model_type") from None
    lm_head = model.get_output_embeddings()
    names = {module: name for name, module in model.named_modules()}
    layout = ModelLayout(
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
        head_dim=_head_dim(hf_config),
    )
    _check_architecture(model, layout, arch, source)
    return layout


def _head_dim(hf_config: Any) -> int | None:
    """The attention head size as the model computes it: `head_dim` when the config says so, else hidden / heads."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    explicit = getattr(text, "head_dim", None)
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def architecture_name(config: dict[str, Any]) -> str:
    """How config.json names its architecture, for messages: `Gemma3ForCausalLM (gemma3_text)`."""
    architectures = config.get("architectures")
    first = architectures[0] if isinstance(architectures, list) and architectures and isinstance(architectures[0], str) else None
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    if first and model_type:
        return f"{first[:80]} ({model_type[:80]})"
    if first or model_type:
        return (first or f"model_type {model_type!r}")[:100]
    return "a config.json without model_type"


def quantize_refusal(config: dict[str, Any]) -> tuple[str, str] | None:
    """Why no recipe can quantize this architecture, read from config.json alone: (the field that shows it,
    the reason), or None. The compiler covers the attention and MLP Linears of a text-only decoder."""
    if config.get("is_encoder_decoder") is True:
        return "is_encoder_decoder", "an encoder-decoder model: the product quantizes decoder-only causal language models"
    for key in ("vision_config", "audio_config"):
        if isinstance(config.get(key), dict):
            return key, (f"a multimodal model ({key}): the compiler covers a text-only decoder's Linears; give the text "
                         "model alone (its own config.json and weights)")
    text = {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        experts = text.get(key)
        if isinstance(experts, int) and not isinstance(experts, bool) and experts > 0:
            return key, (f"a mixture-of-experts model ({experts} experts per layer): the compiler's groups cover dense "
                         "attention and MLP Linears, not routed experts")
    return None


def _first_line(error: Exception) -> str:
    """An exception's first sentence, with its type where that says more (KeyError: 'bogus')."""
    lines = str(error).strip().splitlines()
    text = lines[0].split(". ")[0] if lines else ""
    return (text if isinstance(error, ValueError | TypeError) and text else f"{type(error).__name__}: {text}".rstrip(": "))[:200]


def _check_architecture(model: Any, layout: ModelLayout, name: str, source: Path | str) -> None:
    """What the groups need of a model: a decoder layer list named `layers`, num_hidden_layers long, every
    weight matrix in it a Linear one group covers, and no covered Linear outside it. Else an InputError
    naming the architecture and what is missing."""
    import torch  # heavy: imported when used

    count = layout.num_layers
    stacks = [(path, module) for path, module in model.named_modules()
              if count > 0 and isinstance(module, torch.nn.ModuleList) and len(module) == count]
    stacks.sort(key=lambda stack: re.search(r"(^|\.)layers$", stack[0]) is None)  # a list named `layers` first
    path, region = stacks[0] if stacks else ("", model)
    skip = {model.get_output_embeddings(), *(m for m in model.modules() if isinstance(m, torch.nn.Embedding))}
    uncovered = [
        f"{sub_name} ({type(module).__name__})"
        for sub_name, module in region.named_modules(prefix=path)
        if module not in skip and any(p.dim() >= 2 for p in module.parameters(recurse=False))
        and not (isinstance(module, torch.nn.Linear) and any(_matches(target, sub_name) for target in GROUP_TARGET.values()))
    ]
    covers = "the groups cover Linears named self_attn.(q|k|v|o|qkv)_proj and mlp.(gate|up|down|gate_up)_proj"
    if uncovered:
        shown = ", ".join(uncovered[:4]) + (f" and {len(uncovered) - 4} more" if len(uncovered) > 4 else "")
        raise InputError(f"{name}: {len(uncovered)} weight matrices of its decoder layers match no group ({shown}); {covers}",
                         file=source, field="model_type")
    if not stacks:
        raise InputError(f"{name}: no decoder layer list (a ModuleList of its num_hidden_layers = {count} layers)",
                         file=source, field="num_hidden_layers")
    if not re.search(r"(^|\.)layers$", path):
        raise InputError(f"{name}: its decoder layers are {path}.N, not a list named `layers`: recipes select layers by "
                         "Llama-style names (model.layers.N.self_attn / mlp)", file=source, field="model_type")
    outside = [info.name for info in layout.linears if info.kind is not None and not info.name.startswith(f"{path}.")]
    if outside:
        raise InputError(f"{name}: Linears outside its decoder layers {path} match a group ({', '.join(outside[:3])}); "
                         "only decoder layers are quantized", file=source, field="model_type")
    if not layout.of_kind("attention") and not layout.of_kind("mlp"):
        raise InputError(f"{name}: no Linear of its decoder layers matches a group; {covers}", file=source, field="model_type")


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


def _matches(target: str, name: str) -> bool:
    """compressed-tensors' rule: 're:' targets are re.match'ed, others compared with the module name."""
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name
