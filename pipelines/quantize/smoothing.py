"""SmoothQuant mappings derived from the model's own forward, and checked to leave its outputs unchanged.

llm-compressor picks a SmoothQuant mapping (`[[balance layers], smooth layer]`) from a registry keyed by
architecture name. For Gemma 2/3 that mapping smooths `post_attention_layernorm` into gate/up, but on Gemma
that norm normalises the attention output before the residual add; the MLP reads `pre_feedforward_layernorm`.
Applied, it multiplies perplexity by 1e10 without any quantization. So mappings are never trusted by name:

1. derive (`derive_mappings`): one traced forward on a few tokens. The Linear layers of each decoder layer
   are grouped by the input they read (q/k/v; gate/up; Phi-3's fused qkv_proj, gate_up_proj); a group is
   smoothed into the module whose output is exactly that input, bit for bit, and only when that module is
   a norm whose output scales by 1/s when llm-compressor smooths it (`absorbs_scale`, tried on the module).
   SmoothQuant divides the weight vector (and a bias) by s. Gemma's RMSNorm computes x * (1 + weight), where
   weight / s would be wrong; llm-compressor's oneshot swaps such norms, by class name, for x * w' with
   w' = 1 + weight while it calibrates and back after, which stores (1 + weight) / s - 1: right, and the
   trial checks that on the module rather than trusting the class name. A group that reads no such norm (o_proj, down_proj) is
   not smoothed; each is named, with why, in the manifest.
2. check (`check_identity`): SmoothQuant alone, with these mappings, through llm-compressor's own
   oneshot on a float32 copy of the model and a few calibration samples, must leave the logits unchanged
   up to float rounding (an identity in exact arithmetic). It runs oneshot's basic pipeline (one
   calibration pass, then the smoothing): the same transform the quantize run's sequential pipeline applies
   layer by layer, at a third of the cost. A mapping that changes them is refused before
   calibration with one line naming its layers (InputError), never applied.

The quantize step runs both before oneshot (`checked_smoothing`), puts the mappings into the compiled
recipe (`with_mappings`) and records them in the manifest (artifact.SmoothingRecord).
"""

from __future__ import annotations

import copy
import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.artifact import SmoothingRecord
from pipelines.console.output import progress
from pipelines.errors import InputError

# Max |logits_smoothed - logits| / max |logits| over the check's samples, both in float32. Each smoothed
# weight is rounded twice (norm weight / s, Linear weight * s), a relative 6e-8 each; through every layer
# this stays near 1e-6 on the families and SmolLM2 (docs/calibration.md), while a wrong mapping moves
# logits by O(1) or far more. 1e-3 sits orders of magnitude from both.
TOLERANCE = 1e-3
CHECK_SAMPLES = 4
CHECK_MAX_TOKENS = 64
TRACE_TOKENS = 32
# llm-compressor's form: [[balance regexes], smooth regex] (compressed-tensors "re:" = re.match on the name).
Mapping = list[Any]


@dataclass(frozen=True)
class Pair:
    """One smoothing in one decoder layer: the smooth module and the Linear layers that read its output."""

    smooth: str
    balance: tuple[str, ...]


@dataclass
class Derivation:
    """What the trace found: llm-compressor mappings, the pairs they resolve to, and what is not smoothed."""

    mappings: list[Mapping]
    pairs: list[Pair]
    skipped: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (projections, why not) -> layers

    def skipped_lines(self, layers: int) -> list[str]:
        """Each projection group not smoothed: 'mlp.down_proj: no module of the layer outputs what they read (every layer)'."""
        return [f"{group}: {why} ({_layers(at, list(range(layers)))})" for (group, why), at in self.skipped.items()]

    def skipped_summary(self, layers: int) -> list[str]:
        """The same, the groups with one reason on one line: 'self_attn.o_proj, mlp.down_proj (every layer): ...'."""
        by_reason: dict[tuple[str, str], list[str]] = {}
        for (group, why), at in self.skipped.items():
            by_reason.setdefault((why, _layers(at, list(range(layers)))), []).append(group)
        return [f"{'; '.join(groups)} ({at}): {why}" for (why, at), groups in by_reason.items()]


@dataclass
class IdentityCheck:
    max_relative_difference: float
    tolerance: float
    samples: int
    seconds: float

    @property
    def passed(self) -> bool:
        return self.max_relative_difference <= self.tolerance  # NaN fails


# ------------------------------------------------------------------------------------------- trace


def decoder_stack(model: Any) -> tuple[str, list[Any]]:
    """The name and layers of the model's decoder stack: the ModuleList as long as config.num_hidden_layers."""
    import torch  # heavy: imported when used

    count = getattr(model.config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return name, list(module)
    raise InputError(f"{type(model).__name__}: no decoder layer stack of {count} layers found to derive SmoothQuant mappings from",
                     field="smoothquant")


@dataclass
class _Call:
    module: Any
    input: Any
    output: Any
    calls: int = 1


def _trace(model: Any, input_ids: Any) -> tuple[str, list[dict[str, _Call]]]:
    """Per decoder layer, every submodule's (first) input and output in one forward, in completion order."""
    import torch  # heavy: imported when used

    stack, layers = decoder_stack(model)
    records: list[dict[str, _Call]] = [{} for _ in layers]
    handles = []

    def recorder(index: int, name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            seen = records[index].get(name)
            if seen is not None:
                seen.calls += 1
                return
            first = next((value for value in [*args, *kwargs.values()] if isinstance(value, torch.Tensor)), None)
            records[index][name] = _Call(module, first, output if isinstance(output, torch.Tensor) else None)
        return hook

    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if name:
                handles.append(module.register_forward_hook(recorder(index, name), with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=input_ids.to(model.device))
    finally:
        for handle in handles:
            handle.remove()
    return stack, records


def _same(a: Any, b: Any) -> bool:
    """Bit for bit the same tensor (the same object, or equal shape, dtype and values)."""
    import torch  # heavy: imported when used

    if a is None or b is None:
        return False
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b)))


def _scale_vector(module: Any, width: int) -> bool:
    """Whether `module` holds a weight vector of one entry per channel (what SmoothQuant divides)."""
    import torch  # heavy: imported when used

    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.nn.Parameter) and weight.ndim == 1 and weight.numel() == width


def absorbs_scale(module: Any, x: Any, config: Any = None) -> bool:
    """Whether smoothing `module` as llm-compressor's oneshot does divides its output by s: tried on a float32
    copy with input `x` and a fixed positive s. oneshot swaps the norm classes it registers as offset norms
    (Gemma's x * (1 + w)) for x * w' with w' = 1 + w while it calibrates (llmcompressor/modeling/offset_norm.py),
    SmoothQuant divides w' (and a bias) by s, and the swap back stores w' / s - 1: correct, (1 + w) / s. An
    offset norm it does not register would get 1 + w / s, and fails here."""
    import torch  # heavy: imported when used

    probe = copy.deepcopy(module).float()
    x = x.detach().float()
    width = probe.weight.numel()
    scales = 0.5 + 1.5 * torch.rand(width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = probe(x)
        smoothed = _as_calibrated(probe, config)
        smoothed.weight.div_(scales)
        if getattr(smoothed, "bias", None) is not None:
            smoothed.bias.div_(scales)
        if smoothed is not probe:
            probe = smoothed.restore(probe)
        after = probe(x)
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor) or before.shape[-1] != width:
        return False
    expected = before / scales
    return bool(torch.allclose(after, expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()) + 1e-30))


def _as_calibrated(module: Any, config: Any) -> Any:
    """The module SmoothQuant sees inside oneshot: llm-compressor's calibration form of a registered offset norm."""
    from compressed_tensors.registry import standardize_lookup_name  # heavy: imported when used
    from llmcompressor.modeling.offset_norm import NormCalibrationModule  # heavy: imported when used

    name = standardize_lookup_name(type(module).__name__)
    if name in NormCalibrationModule.registered_names() or name in NormCalibrationModule.registered_aliases():
        return NormCalibrationModule.load_from_registry(type(module).__name__, original=module, config=config)
    return module


def derive_mappings(model: Any, input_ids: Any) -> Derivation:
    """SmoothQuant mappings from one traced forward of `model` on `input_ids` (a [1, n] tensor of a few tokens)."""
    import torch  # heavy: imported when used

    stack, records = _trace(model, input_ids)
    pairs: list[Pair] = []
    relative: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    skipped: dict[tuple[str, str], list[int]] = {}
    for index, calls in enumerate(records):
        names = list(calls)
        linears = [n for n in names if isinstance(calls[n].module, torch.nn.Linear) and calls[n].input is not None]
        groups: list[list[str]] = []
        for name in linears:
            group = next((g for g in groups if _same(calls[g[0]].input, calls[name].input)), None)
            if group is None:
                groups.append([name])
            else:
                group.append(name)
        for group in groups:
            found, why = _smooth_module(calls, names, group, model.config)
            if found is None:
                skipped.setdefault((", ".join(group), why), []).append(index)
                continue
            balance = tuple(sorted(group))
            relative.setdefault((found, balance), []).append(index)
            pairs.append(Pair(f"{stack}.{index}.{found}", tuple(f"{stack}.{index}.{b}" for b in balance)))
    every = list(range(len(records)))
    mappings = [_mapping(stack, smooth, balance, at, every) for (smooth, balance), at in relative.items()]
    derivation = Derivation(mappings, pairs, skipped)
    if set(resolve(model, mappings)) != set(pairs):  # a regex reached more or less than the trace found: name each layer
        derivation.mappings = [_mapping(stack, smooth, balance, [i], every) for (smooth, balance), at in relative.items() for i in at]
        if set(resolve(model, derivation.mappings)) != set(pairs):
            raise AssertionError("SmoothQuant mappings resolve to other layers than traced")
    return derivation


def _smooth_module(calls: dict[str, _Call], names: list[str], group: list[str], config: Any) -> tuple[str | None, str]:
    """The module of this layer whose output the group reads, if it can absorb a smoothing scale; else why not."""
    read = calls[group[0]].input
    width = int(read.shape[-1])
    producers = [n for n in names if n not in group and _same(calls[n].output, read)]
    if not producers:
        return None, "no module of the layer outputs what they read"
    vectors = [n for n in producers if _scale_vector(calls[n].module, width)]
    if not vectors:
        return None, f"{producers[-1]} outputs what they read but holds no per-channel weight"
    name = vectors[-1]
    if calls[name].calls > 1:
        return None, f"{name} outputs what they read but runs more than once per forward"
    if calls[name].input is None or not absorbs_scale(calls[name].module, calls[name].input, config):
        return None, f"{name} outputs what they read, but dividing its weight by s (as llm-compressor smooths) does not divide its output by s"
    return name, ""


def _mapping(stack: str, smooth: str, balance: tuple[str, ...], at: list[int], every: list[int]) -> Mapping:
    prefix = r"re:.*\." if at == every else f"re:{re.escape(stack)}\\.({'|'.join(map(str, at))})\\."
    return [[f"{prefix}{re.escape(name)}$" for name in balance], f"{prefix}{re.escape(smooth)}$"]


def _layers(at: list[int], every: list[int]) -> str:
    return "every layer" if at == every else f"layers {', '.join(map(str, at))}"


def resolve(model: Any, mappings: list[Mapping]) -> list[Pair]:
    """The (smooth, balance) module names llm-compressor's SmoothQuantModifier resolves `mappings` to."""
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier  # heavy: imported when used

    modifier = SmoothQuantModifier(mappings=mappings, ignore=[])
    names = {module: name for name, module in model.named_modules()}
    return [Pair(m.smooth_name, tuple(sorted(names[b] for b in m.balance_layers))) for m in modifier._resolve_mappings(model)]


def library_mappings(model: Any) -> list[Mapping]:
    """The mapping llm-compressor would pick for this model by its architecture name."""
    from llmcompressor.modifiers.transform.smoothquant.dynamic_mappings import get_layer_mappings_from_model  # heavy: imported when used

    return [[list(balance), smooth] for balance, smooth in get_layer_mappings_from_model(model)]


def library_differs(model: Any, derivation: Derivation) -> str | None:
    """llm-compressor's own mapping for this model, described, when it reaches other layers than the trace's."""
    library = library_mappings(model)
    try:
        if set(resolve(model, library)) == set(derivation.pairs):
            return None
        return "; ".join(describe(model, library)) or "none"
    except (RuntimeError, ValueError) as error:  # its regexes do not resolve on this model
        return f"does not resolve: {error.__cause__ or error}"


def describe(model: Any, mappings: list[Mapping]) -> list[str]:
    """Each mapping as the layers it reaches: 'post_attention_layernorm -> mlp.gate_proj, mlp.up_proj (every layer)'."""
    stack, layers = decoder_stack(model)
    every = list(range(len(layers)))
    lines = []
    for mapping in mappings:
        by_pair: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        for pair in resolve(model, [mapping]):
            index, smooth = _relative(stack, pair.smooth)
            by_pair.setdefault((smooth, tuple(_relative(stack, b)[1] for b in pair.balance)), []).append(index)
        lines += [f"{smooth} -> {', '.join(balance)} ({_layers(at, every)})" for (smooth, balance), at in by_pair.items()]
    return lines


def _relative(stack: str, name: str) -> tuple[int, str]:
    match = re.fullmatch(rf"{re.escape(stack)}\.(\d+)\.(.+)", name)
    return (int(match.group(1)), match.group(2)) if match else (-1, name)


# ------------------------------------------------------------------------------------------- check


def check_identity(model: Any, mappings: list[Mapping], dataset: Any, *, strength: float = 0.8, max_seq_length: int = CHECK_MAX_TOKENS,
                   tolerance: float = TOLERANCE) -> IdentityCheck:
    """SmoothQuant alone with `mappings` (llm-compressor's oneshot, its own SmoothQuantModifier) on a float32
    copy of `model`, calibrated on `dataset` (input_ids / attention_mask rows); the largest change of the
    logits on those rows relative to their largest magnitude. `model` itself is not changed."""
    import torch  # heavy: imported when used
    from llmcompressor import oneshot  # heavy: imported when used

    started = time.perf_counter()
    rows = [torch.tensor([ids], device=model.device) for ids in dataset["input_ids"]]
    worst = 0.0
    if mappings:
        probe = torch.nn.Module.float(copy.deepcopy(model)).eval()  # transformers' own .float() refuses some models
        with _kept_rng(), torch.no_grad():
            before = [probe(input_ids=ids).logits for ids in rows]
        recipe = {"smooth_stage": {"smooth_modifiers": {"SmoothQuantModifier": {"smoothing_strength": strength, "mappings": mappings}}}}
        with _kept_rng():
            oneshot(model=probe, recipe=yaml.safe_dump(recipe), dataset=dataset, num_calibration_samples=len(rows),
                    shuffle_calibration_samples=False, max_seq_length=max_seq_length, pipeline="basic")
            with torch.no_grad():
                after = [probe(input_ids=ids).logits for ids in rows]
        del probe
        for a, b in zip(before, after, strict=True):
            scale = float(a.abs().max()) or 1.0
            worst = max(worst, float((b - a).abs().max()) / scale) if torch.isfinite(b).all() else float("inf")
    return IdentityCheck(worst, tolerance, len(rows), time.perf_counter() - started)


def refuse_failing(model: Any, mappings: list[Mapping], dataset: Any, check: IdentityCheck, *, strength: float, max_seq_length: int,
                   source: Path | str | None = None) -> None:
    """Raise the one-line InputError that names the layers of each mapping that fails on its own."""
    failing = []
    for mapping in mappings:
        alone = check_identity(model, [mapping], dataset, strength=strength, max_seq_length=max_seq_length, tolerance=check.tolerance)
        if not alone.passed:
            failing += [f"{line} changes logits by {alone.max_relative_difference:.3g}" for line in describe(model, [mapping])]
    what = "; ".join(failing) or f"the mappings together change logits by {check.max_relative_difference:.3g}"
    raise InputError(
        f"SmoothQuant is not an identity on this model: {what} (relative, float32, tolerance {check.tolerance:g}, "
        f"{check.samples} calibration samples); refused before calibration",
        file=source, field="smoothquant",
    )


@contextmanager
def _kept_rng() -> Iterator[None]:
    """The check must not move the random state the quantization that follows is seeded with."""
    import numpy  # heavy: imported when used
    import torch  # heavy: imported when used

    states = random.getstate(), numpy.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


# ----------------------------------------------------------------------------------- quantize step


def checked_smoothing(model: Any, dataset: Any, *, strength: float, max_seq_length: int, source: Path | str | None = None) -> SmoothingRecord:
    """Derive the mappings from `model`'s forward, check them on the first rows of `dataset` (the calibration
    samples), and return what the manifest records; an InputError before calibration when they fail."""
    import torch  # heavy: imported when used
    from datasets import Dataset  # heavy: imported when used

    started = time.perf_counter()
    head = dataset[:CHECK_SAMPLES]
    rows = Dataset.from_dict({key: [ids[:CHECK_MAX_TOKENS] for ids in head[key]] for key in ("input_ids", "attention_mask")})
    derivation = derive_mappings(model, torch.tensor([rows[0]["input_ids"][:TRACE_TOKENS]]))
    layers = describe(model, derivation.mappings)
    progress(f"SmoothQuant mappings, traced (the projections read exactly that norm's output): {'; '.join(layers) or 'none'}")
    for line in derivation.skipped_summary(len(decoder_stack(model)[1])):
        progress(f"SmoothQuant does not smooth {line}")
    library = library_differs(model, derivation)
    if library is not None:
        progress(f"SmoothQuant: llm-compressor's mapping for {type(model).__name__} ({library}) is not the traced one; "
                 "the traced one is used")
    check = check_identity(model, derivation.mappings, rows, strength=strength, max_seq_length=min(max_seq_length, CHECK_MAX_TOKENS))
    if not check.passed:
        refuse_failing(model, derivation.mappings, rows, check, strength=strength, max_seq_length=min(max_seq_length, CHECK_MAX_TOKENS),
                       source=source)
    progress(f"SmoothQuant alone changes logits by {check.max_relative_difference:.2g} (relative, float32, "
             f"{check.samples} calibration samples; tolerance {check.tolerance:g}) in {time.perf_counter() - started:.1f} s")
    return SmoothingRecord(
        mappings=derivation.mappings,
        layers=layers,
        skipped=derivation.skipped_lines(len(decoder_stack(model)[1])),
        max_relative_difference=check.max_relative_difference,
        tolerance=check.tolerance,
        check_samples=check.samples,
        check_s=round(time.perf_counter() - started, 3),
    )


def with_mappings(llmcompressor: dict[str, Any], mappings: Any) -> str:
    """The compiled recipe's YAML with every SmoothQuantModifier given `mappings` (the compiler leaves a note there)."""
    recipe = copy.deepcopy(llmcompressor)
    for stage in recipe.values():
        for modifiers in stage.values():
            if "SmoothQuantModifier" in modifiers:
                modifiers["SmoothQuantModifier"]["mappings"] = [[list(balance), smooth] for balance, smooth in mappings]
    return yaml.safe_dump(recipe, sort_keys=False, width=120)
