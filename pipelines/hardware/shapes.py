"""The model's own Linear shapes as vLLM runs them, the scheme each one gets, and how many copies reproduce its working set.

vLLM does not run a checkpoint's Linears one by one: every supported family (Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3, Phi-3) loads q/k/v into one QKV Linear (QKVParallelLinear: out = (heads + 2 x kv_heads) x head_dim) and
gate/up into one (MergedColumnParallelLinear: out = 2 x intermediate); o_proj and down_proj stay separate. Phi-3's
checkpoint holds qkv_proj and gate_up_proj already. So a decoder layer is four Linears, and a fused Linear carries
one scheme (vLLM refuses shards with different ones).

The checkpoint's Linears come from the caller (the planner's `decoder_linears`, which reads every family's config.json:
this package sits below the planner and reads no config itself), with the scheme of each: a recipe's (the compiler's
`scheme_for`, through the planner's `linear_schemes`) or an artifact's (its config.json `config_groups`, matched here
as compressed-tensors matches them).

The working set: a decode step reads every weight once, so where the model's weights exceed the last-level cache they
come from memory and where they fit they stay in cache. The probe times `n` copies of each shape, each call on the next
copy: the copies' bytes are the model's own Linear bytes in that format, capped at twice the last-level cache (or one
copy, when a copy is larger) and at MEMORY_CAP_BYTES; so they exceed the cache exactly where the model does.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

from pydantic import Field

from pipelines.errors import InputError
from pipelines.hardware.kernels import KernelCase
from pipelines.hardware.speed import group_case, read_quantization_config
from pipelines.recipe import AutoGroupSize, GroupScheme
from pipelines.schema import FrozenModel

# vLLM's fused Linears: the checkpoint shard -> the Linear vLLM loads it into (a Phi-3 checkpoint's fused ones map to themselves).
FUSED_INTO: dict[str, str] = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
LLC_MULTIPLE = 2  # copies past the last-level cache: twice its size (an LRU-like cache then misses every call)
MEMORY_CAP_BYTES = 1 << 30  # per format and shape: the probe's copies never hold more
MAX_COPIES = 4096  # tiny shapes in a large cache: the build time stays bounded
UNKNOWN_LLC_BYTES = 32 << 20  # assumed when the kernel reports no cache (said in the prediction)
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


class CheckpointLinear(Protocol):
    """One Linear of the checkpoint (the planner's `decoder_linears` gives these for every family)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def layer(self) -> int: ...
    @property
    def out(self) -> int: ...
    @property
    def inp(self) -> int: ...
    @property
    def bias(self) -> bool: ...


class VllmLinear(FrozenModel):
    """One Linear as vLLM builds it: fused shards summed on the output side."""

    name: str = Field(description="qkv_proj, o_proj, gate_up_proj, down_proj (or the family's own)")
    shards: tuple[str, ...] = Field(description="the checkpoint Linears it holds, e.g. q_proj, k_proj, v_proj")
    kind: str = Field(description="attention or mlp")
    in_features: int = Field(gt=0)
    out_features: int = Field(gt=0)
    bias: bool = False

    @property
    def shape(self) -> str:
        return f"{self.in_features}x{self.out_features}{' +bias' if self.bias else ''}"


class ShapeUse(FrozenModel):
    """A vLLM Linear under one scheme, and in how many decoder layers the model holds it so."""

    linear: VllmLinear
    case: KernelCase | None = Field(description="None: kept in 16 bits")
    layers: int = Field(gt=0)


def vllm_linears(linears: Iterable[CheckpointLinear], cases: Mapping[str, KernelCase | None]) -> list[ShapeUse]:
    """The distinct (vLLM Linear, scheme) pairs of the model with their layer counts, in the order met. `cases` maps
    each checkpoint Linear's name to its scheme (absent or None: 16-bit)."""
    fused: dict[tuple[int, str], list[CheckpointLinear]] = {}
    for linear in linears:
        shard = linear.name.rsplit(".", 1)[-1]
        fused.setdefault((linear.layer, FUSED_INTO.get(shard, shard)), []).append(linear)
    counts: Counter[tuple[VllmLinear, KernelCase | None]] = Counter()
    for (_, name), shards in fused.items():
        counts[_fused(name, shards, cases)] += 1
    return [ShapeUse(linear=linear, case=case, layers=layers) for (linear, case), layers in counts.items()]


def _fused(name: str, shards: list[CheckpointLinear], cases: Mapping[str, KernelCase | None]) -> tuple[VllmLinear, KernelCase | None]:
    schemes = {cases.get(shard.name) for shard in shards}
    if len(schemes) > 1:
        raise InputError(f"{', '.join(shard.name for shard in shards)} have different schemes; vLLM loads them into one {name} "
                         "Linear, which carries one scheme", field="config_groups")
    if len({shard.inp for shard in shards}) > 1:
        raise InputError(f"{', '.join(shard.name for shard in shards)} read inputs of different sizes; vLLM fuses them into {name}",
                         field="model_type")
    linear = VllmLinear(name=name, shards=tuple(shard.name.rsplit(".", 1)[-1] for shard in shards), kind=shards[0].kind,
                        in_features=shards[0].inp, out_features=sum(shard.out for shard in shards),
                        bias=any(shard.bias for shard in shards))
    return linear, schemes.pop()


def recipe_cases(linears: Iterable[CheckpointLinear], schemes: Mapping[str, GroupScheme | None]) -> dict[str, KernelCase | None]:
    """Each checkpoint Linear's kernel case from a recipe's schemes by name (the planner's `linear_schemes`), with
    `group_size: auto` made the layer's own size."""
    cases: dict[str, KernelCase | None] = {}
    for linear in linears:
        scheme = schemes.get(linear.name)
        if scheme is None:
            cases[linear.name] = None
            continue
        weights = scheme.weights.for_layer(linear.inp)
        if isinstance(weights.group_size, AutoGroupSize):
            raise InputError(f"group_size auto finds no power of two up to {weights.group_size.auto} dividing {linear.name}'s "
                             f"{linear.inp} inputs: the recipe does not apply to this model", field="group_size")
        cases[linear.name] = KernelCase(weights=weights, activations=scheme.activations)
    return cases


def artifact_linear_cases(config_path: Path, names: Iterable[str]) -> dict[str, KernelCase | None]:
    """Each named Linear's kernel case in a compressed-tensors artifact (its config.json `quantization_config`): the
    first config group whose targets match it, unless `ignore` names it (None: kept in 16 bits)."""
    config = read_quantization_config(config_path)
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise InputError("has no compressed-tensors config_groups: not an artifact the probe can time", file=config_path,
                         field="quantization_config")
    ignore = [target for target in config.get("ignore") or [] if isinstance(target, str)]
    cases: dict[str, KernelCase | None] = {}
    for name in names:
        group = next((g for g in groups.values() if isinstance(g, dict) and _targets(g.get("targets"), name)), None)
        case = group_case(group) if group is not None and not _targets(ignore, name) else None
        if group is not None and case is None and not _targets(ignore, name):
            raise InputError(f"{name}: its config group's scheme has no name in the product's vocabulary", file=config_path,
                             field="quantization_config.config_groups")
        cases[name] = case
    return cases


def _targets(targets: object, name: str) -> bool:
    """compressed-tensors' matching: `re:` targets re.match the module name, `Linear` names the class (every
    Linear here), others compare with the name."""
    if not isinstance(targets, list):
        return False
    return any(isinstance(t, str) and (re.match(t[3:], name) is not None if t.startswith("re:") else t in ("Linear", name))
               for t in targets)


# ------------------------------------------------------------------------------------ the working set


def nominal_bytes(linear: VllmLinear, case: KernelCase | None, dtype_bytes: int) -> int:
    """A Linear's weight bytes in a format: its weights' bits (scales left out), the serve dtype's when 16-bit."""
    elements = linear.in_features * linear.out_features
    return elements * dtype_bytes if case is None else math.ceil(elements * case.weights.bits / 8)


def working_set(uses: list[ShapeUse], dtype_bytes: int) -> tuple[int, int]:
    """(16-bit, quantized) bytes of all the model's Linear weights: what one decode step reads."""
    base = sum(use.layers * nominal_bytes(use.linear, None, dtype_bytes) for use in uses)
    return base, sum(use.layers * nominal_bytes(use.linear, use.case, dtype_bytes) for use in uses)


def copies_for(model_bytes: int, copy_bytes: int, llc_bytes: int) -> int:
    """Copies of one Linear whose bytes match the model's working set: the model's bytes where they fit the cache,
    else at least LLC_MULTIPLE x the cache (one copy when a copy is larger), never above MEMORY_CAP_BYTES or MAX_COPIES."""
    target = min(model_bytes, max(LLC_MULTIPLE * llc_bytes, copy_bytes), MEMORY_CAP_BYTES)
    return max(1, min(MAX_COPIES, math.ceil(target / copy_bytes)))
