"""The 16-bit model in transformers, with any set of units fake-quantized: the repair's simulator. It runs on the
first GPU when torch sees one (float32 there too, TF32 left off: the same arithmetic as on a CPU), else on the CPU.

What it measures, per assignment of schemes to units (pipelines.repair.fakequant does the quantizing):
- `kl`: the gate's yardstick, teacher-forced. On each reference path (the baseline's greedy continuation of
  a prompt, as the gate's KL uses it) the next-token distribution of the fake-quantized model is compared
  with the 16-bit model's at every generated position: full-vocabulary KL(16-bit || quantized) in nats,
  averaged over an item's positions, then over items (the gate's averaging; the gate's own value is a top-20
  lower bound of this one). Runs in float32, so that the only difference between the two is quantization.
- GPTQ schemes: the unit's weights GPTQ-quantized with the Hessian of its inputs on the calibration texts
  (`calibrate` accumulates it; pipelines.repair.fakequant.gptq_quantize_weight), not their RTN twin.
- `proxy`: per unit and scheme, the relative output error ||x W_q^T - x W^T||^2 / ||x W^T||^2 of its shards on
  the calibration texts, all schemes of all units in one forward pass of the 16-bit model (hooks).

A unit in decoder layer L changes nothing before L: the reference pass keeps every layer's input, and a
single unit's KL replays the decoder from layer L only (about half the work on average).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from pipelines.bounds import GiB
from pipelines.quantize.calibration import calibration_dataset
from pipelines.quantize.smoothing import checked_smoothing, with_mappings
from pipelines.recipe import Algorithm, GroupScheme
from pipelines.repair.fakequant import StaticInputScale, fake_quantize_input, fake_quantize_weight, gptq_quantize_weight
from pipelines.repair.units import Assignment, RefPath, Unit

# Fake-quantized weights are kept for reuse (every proposal quantizes most units as the last one did) up to this size.
WEIGHT_CACHE_BYTES = 2 * GiB
class KL(BaseModel):
    mean: float
    items: list[float]


class Simulator:
    def __init__(self, model_dir: Path, units: list[Unit], gptq: Algorithm | None = None):
        from transformers import AutoModelForCausalLM  # heavy: imported when used

        self.device = compute_device()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(self.device)
        self.units = {unit.name: unit for unit in units}
        self.linears = {info.name: self.model.get_submodule(info.name) for unit in units for info in unit.modules}
        self.unit_of = {info.name: unit.name for unit in units for info in unit.modules}
        self.static: dict[tuple[str, GroupScheme], StaticInputScale] = {}
        self.gptq = gptq or Algorithm(method="gptq")
        self.hessians: dict[str, torch.Tensor] = {}  # unit -> normalized Hessian of the input its shards share
        self.gptq_s: dict[str, float] = {}  # unit -> seconds of GPTQ solves, summed over its shards and schemes
        self.calibration_s = 0.0  # the calibration forward passes (static scales, Hessians)
        self._capture_originals()
        self._reference: dict[str, Any] = {}

    def _capture_originals(self) -> None:
        # The checkpoint's own dtype: scales come out as llm-compressor stores them (bf16 for a bf16 model).
        dtype = getattr(self.model.config, "dtype", None) or torch.bfloat16
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.originals = {name: module.weight.detach().clone() for name, module in self.linears.items()}
        self.stored_dtype = dtype
        self._quantized: dict[tuple[str, object, object], torch.Tensor] = {}  # (module, weights, algorithm) -> its weight, dequantized
        self._quantized_bytes = 0
        self.hessians.clear()  # smoothing changed the inputs they were taken from

    def smooth(self, strength: float, texts: list[str], tokenizer, max_seq_length: int) -> None:
        """SmoothQuant first, as the quantize step does (llm-compressor's SmoothQuantModifier on the same data):
        it changes the weights the schemes then quantize, not what the model computes."""
        from llmcompressor import oneshot  # heavy: imported when used


        dataset = calibration_dataset(tokenizer, texts, max_seq_length)
        # The mappings the quantize step uses: traced from this model's forward and checked, never the library's by name.
        record = checked_smoothing(self.model, dataset, strength=strength, max_seq_length=max_seq_length)
        recipe = with_mappings({"smooth_stage": {"smooth_modifiers": {"SmoothQuantModifier": {"smoothing_strength": strength}}}}, record.mappings)
        oneshot(model=self.model, recipe=recipe, dataset=dataset, num_calibration_samples=len(dataset),
                shuffle_calibration_samples=False, max_seq_length=max_seq_length)
        self._capture_originals()

    # ------------------------------------------------------------------------------ assignments

    def _weight(self, name: str, scheme: GroupScheme | None) -> torch.Tensor:
        original = self.originals[name]
        if scheme is None:
            return original
        key = (name, scheme.weights, scheme.algorithm)
        cached = self._quantized.get(key)
        if cached is None:
            cached = self._quantize(name, original.to(self.stored_dtype), scheme)
            if self._quantized_bytes + cached.nbytes <= WEIGHT_CACHE_BYTES:  # kept in the checkpoint's dtype
                self._quantized[key] = cached
                self._quantized_bytes += cached.nbytes
        return cached.to(original.dtype)

    def _quantize(self, name: str, weight: torch.Tensor, scheme: GroupScheme) -> torch.Tensor:
        if scheme.algorithm != "gptq":
            return fake_quantize_weight(weight, scheme.weights)
        unit = self.unit_of[name]
        assert unit in self.hessians, f"GPTQ on {unit} needs its Hessian: calibrate first"
        started = time.perf_counter()
        quantized = gptq_quantize_weight(weight, self.hessians[unit], scheme.weights, self.gptq)
        self.gptq_s[unit] = self.gptq_s.get(unit, 0.0) + time.perf_counter() - started
        return quantized

    def prepare(self, assignment: Assignment) -> None:
        """Quantize each named unit's shards at its scheme now (kept in the weight cache for what follows)."""
        for unit_name, scheme in assignment.items():
            for info in self.units[unit_name].modules:
                self._weight(info.name, scheme)

    @contextmanager
    def applied(self, assignment: Assignment) -> Iterator[None]:
        """The model with each named unit's shards fake-quantized (weights swapped, activation hooks added)."""
        hooks = []
        try:
            for unit_name, scheme in assignment.items():
                for info in self.units[unit_name].modules:
                    module = self.linears[info.name]
                    module.weight.data = self._weight(info.name, scheme)
                    if scheme is not None and scheme.activations is not None:
                        hooks.append(module.register_forward_pre_hook(self._input_hook(info.name, scheme)))
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for unit_name in assignment:
                for info in self.units[unit_name].modules:
                    self.linears[info.name].weight.data = self.originals[info.name]

    def _input_hook(self, name: str, scheme: GroupScheme):
        static, activations = self.static.get((name, scheme)), scheme.activations
        assert activations is not None

        def hook(module, args):
            return (fake_quantize_input(args[0], activations, static), *args[1:])

        return hook

    # ---------------------------------------------------------------------- static activation scales

    @torch.no_grad()
    def calibrate(self, encoded: list[list[int]], schemes: dict[str, list[GroupScheme]], advance: Callable[[], None] = lambda: None) -> None:
        """One pass over the calibration samples, one at a time (as llm-compressor feeds them): static input scales for
        every (module, static scheme) of the units named, and the input Hessian of every unit with a GPTQ scheme."""
        wanted = {(info.name, s): StaticInputScale(s.activations) for unit, options in schemes.items() for s in options
                  for info in self.units[unit].modules
                  if s.activations is not None and not s.activations.dynamic and (info.name, s) not in self.static}
        gptq_units = [unit for unit, options in schemes.items() if unit not in self.hessians and any(s.algorithm == "gptq" for s in options)]
        if not wanted and not gptq_units:
            return
        by_module: dict[str, list[StaticInputScale]] = {}
        for (name, _), scale in wanted.items():
            by_module.setdefault(name, []).append(scale)
        started = time.perf_counter()
        hooks = [self.linears[name].register_forward_pre_hook(_observer_hook(scales)) for name, scales in by_module.items()]
        sums = {unit: _HessianSum(self.linears[self.units[unit].modules[0].name]) for unit in gptq_units}
        hooks += [sum_.module.register_forward_pre_hook(sum_.hook) for sum_ in sums.values()]
        try:
            for ids in encoded:
                self.model(input_ids=torch.tensor([ids], device=self.device))
                advance()
        finally:
            for hook in hooks:
                hook.remove()
        self.static.update(wanted)
        self.hessians.update({unit: sum_.normalized() for unit, sum_ in sums.items()})
        self.calibration_s += time.perf_counter() - started

    # ----------------------------------------------------------------------------------- the proxy

    @torch.no_grad()
    def proxy(self, encoded: list[list[int]], schemes: dict[str, list[GroupScheme]]) -> dict[str, dict[GroupScheme, float]]:
        """Relative output error per unit and scheme on the calibration texts (one batched 16-bit forward)."""
        ids, mask = _batch(encoded, self.device)
        keep = mask.reshape(-1).bool()
        sums: dict[str, dict[GroupScheme, list[float]]] = {u: {s: [0.0, 0.0] for s in schemes[u]} for u in schemes}
        hooks = []
        for unit_name in schemes:
            for info in self.units[unit_name].modules:
                hooks.append(self.linears[info.name].register_forward_hook(self._error_hook(info.name, sums[unit_name], keep)))
        try:
            self.model(input_ids=ids, attention_mask=mask)
        finally:
            for hook in hooks:
                hook.remove()
        return {unit: {s: (num / den if den else 0.0) for s, (num, den) in per.items()} for unit, per in sums.items()}

    def _error_hook(self, name: str, sums: dict[GroupScheme, list[float]], keep: torch.Tensor):
        def hook(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1])[keep]
            exact = x @ self.originals[name].T
            norm = float(exact.pow(2).sum())
            for scheme, total in sums.items():
                inputs = x if scheme.activations is None else fake_quantize_input(x, scheme.activations, self.static.get((name, scheme)))
                total[0] += float((inputs @ self._weight(name, scheme).T - exact).pow(2).sum())
                total[1] += norm

        return hook

    # -------------------------------------------------------------------------------------- KL

    @torch.no_grad()
    def set_reference(self, paths: list[RefPath]) -> None:
        """The 16-bit model's log-probabilities at every generated position, and each decoder layer's input."""
        sequences = [p.prompt_ids + p.generated_ids[:-1] for p in paths]
        ids, mask = _batch(sequences, self.device)
        rows, cols, items = [], [], []
        for index, path in enumerate(paths):
            for j in range(len(path.generated_ids)):
                rows.append(index)
                cols.append(len(path.prompt_ids) - 1 + j)
                items.append(index)
        layers = self._decoder_layers()
        captured: list[tuple[torch.Tensor, dict]] = []
        hooks = [layer.register_forward_pre_hook(lambda m, a, k: captured.append((a[0], k)), with_kwargs=True) for layer in layers] if layers else []
        try:
            hidden = self.model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        finally:
            for hook in hooks:
                hook.remove()
        self._reference = {
            "rows": torch.tensor(rows, device=self.device), "cols": torch.tensor(cols, device=self.device),
            "items": torch.tensor(items, device=self.device), "n_items": len(paths),
            "ids": ids, "mask": mask, "layer_inputs": captured,
        }
        self._reference["logp"] = self._logp(hidden)

    def _decoder_layers(self) -> list[torch.nn.Module] | None:
        body = getattr(self.model, "model", None)
        layers = getattr(body, "layers", None)
        return list(layers) if layers is not None and hasattr(body, "norm") else None

    def _logp(self, hidden: torch.Tensor) -> torch.Tensor:
        ref = self._reference
        picked = hidden[ref["rows"], ref["cols"]]
        return torch.log_softmax(self.model.lm_head(picked).float(), dim=-1)

    @torch.no_grad()
    def kl(self, assignment: Assignment) -> KL:
        """Mean per-token KL(16-bit || assignment) on the reference paths (see the module docstring)."""
        ref = self._reference
        assert ref, "set_reference first"
        with self.applied(assignment):
            hidden = self._hidden_from(min((self.units[u].layer for u in assignment), default=0))
            logq = self._logp(hidden)
        per_position = kl_per_position(ref["logp"], logq)
        totals = torch.zeros(ref["n_items"], device=self.device).index_add_(0, ref["items"], per_position)
        counts = torch.zeros(ref["n_items"], device=self.device).index_add_(0, ref["items"], torch.ones_like(per_position))
        items = (totals / counts.clamp(min=1))[counts > 0]
        return KL(mean=float(items.mean()), items=[round(float(v), 8) for v in items])

    def _hidden_from(self, layer: int) -> torch.Tensor:
        ref = self._reference
        layers = self._decoder_layers()
        if layers is None or not ref["layer_inputs"]:
            return self.model.model(input_ids=ref["ids"], attention_mask=ref["mask"], use_cache=False).last_hidden_state
        hidden, kwargs = ref["layer_inputs"][layer]
        for module in layers[layer:]:
            out = module(hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return self.model.model.norm(hidden)


class _HessianSum:
    """GPTQModifier's Hessian accumulation (llm-compressor's own accumulate_hessian) on one module's inputs."""

    def __init__(self, module: torch.nn.Module):
        from llmcompressor.modifiers.gptq.helpers import make_empty_hessian  # heavy: imported when used

        self.module = module
        self.hessian = make_empty_hessian(module)
        self.samples = torch.zeros(())

    def hook(self, module, args) -> None:
        from llmcompressor.modifiers.gptq.helpers import accumulate_hessian  # heavy: imported when used

        self.hessian, self.samples = accumulate_hessian(args[0], module, self.hessian, self.samples)

    def normalized(self) -> torch.Tensor:
        return self.hessian / self.samples.clamp(min=1)


def _observer_hook(scales: list[StaticInputScale]):
    def hook(module, args):
        for scale in scales:
            scale.observe(args[0])

    return hook


def kl_per_position(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary KL(p || q) in nats at each position, from log-probabilities (last dimension the vocabulary)."""
    return (logp.exp() * (logp - logq)).sum(-1).clamp(min=0)


def compute_device() -> torch.device:
    """The first GPU when torch sees one, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _batch(sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their attention mask (positions are those of the unpadded sequences), on `device`."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def greedy_paths(model_dir: Path, prompts: list[tuple[str, int, list[int]]], max_new_tokens: int) -> list[RefPath]:
    """Reference paths made here when the baseline cache has none: the 16-bit model's greedy continuation of
    each prompt (at most `max_new_tokens`, as the gate's KL takes them), in the model's own dtype."""
    from transformers import AutoModelForCausalLM  # heavy: imported when used

    device = compute_device()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval().to(device)
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    paths = []
    for eval_set, doc_id, prompt_ids in prompts:
        ids, generated = list(prompt_ids), []
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].argmax())
            generated.append(token)
            ids.append(token)
            if token in stops:
                break
        paths.append(RefPath(eval_set=eval_set, doc_id=doc_id, prompt_ids=list(prompt_ids), generated_ids=generated))
    return paths
