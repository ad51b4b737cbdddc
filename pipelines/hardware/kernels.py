"""Kernels probed on this host, not assumed: which scheme vLLM can serve here, through which kernel, how fast.

Each recipe scheme (weights, activations) is one probe case, keyed by what decides vLLM's kernel: bits, number
type, granularity, group size, zero points, activation scales. The probe (pipelines/hardware/serve_probe.py) runs
in the serve environment under the servers' own shim, builds each case's Linear the way vLLM builds a checkpoint's
layer, runs it, and times it at a decode-like and a prefill-like row count against the 16-bit Linear of the same
shape at the host's serve dtype. Results are cached per host fingerprint, serve dtype and probe version; a case
not yet probed is probed with the standard set (the schemes of the shipped recipes and ladders) in one run.
A format case is another quantize backend's checkpoint (GPTQ, bitsandbytes): vLLM's own verdict on its
`quantization_config` and the kernel it picks, cached the same way (pipelines/hardware/formats.py asks).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipelines.console.output import progress
from pipelines.hardware.host import HostProfile
from pipelines.hardware.serve_env import PROBE_SCRIPT, cache_dir, run_probe, store_cache
from pipelines.recipe import ActivationScheme, GroupScheme, WeightScheme
from pipelines.schema import FrozenModel

DECODE_ROWS = 4  # a decode step of a few sequences
PREFILL_ROWS = 128  # a prompt being read
PROBE_IN_FEATURES = 1024
PROBE_OUT_FEATURES = 2048
PROBE_BUDGET_S = 0.5  # per case and row count: a kernel slower than this is timed on one call
PROBE_TIMEOUT_S = 600.0
Fact = TypeVar("Fact", bound=BaseModel)
# A scheme whose probed slowdown (geometric mean of the decode and prefill ratios) reaches this is slow here: the
# run estimates its scoring time before scoring it, and the policy can cap that. One Linear's ratio bounds the
# model's from above (attention, sampling and the server's own work are not slowed): on cpu:avx2 int8 W8A8 probes
# 9-11x at decode and 1.4x at prefill (geometric mean 3.8) and serves the demo model as fast as 16-bit end to end,
# while oneDNN's reference kernel probes 127x / 19x (49) and served 93x slower.
SLOW_RATIO = 8.0


class KernelCase(FrozenModel):
    """One scheme as vLLM's kernel selection sees it (group size concrete)."""

    weights: WeightScheme
    activations: ActivationScheme | None = None

    @classmethod
    def of(cls, scheme: GroupScheme) -> KernelCase:
        return cls(weights=scheme.weights, activations=scheme.activations)

    @property
    def key(self) -> str:
        w = self.weights
        block = w.block_shape
        grain = {"channel": "ch", "tensor": "t"}.get(w.granularity) or (f"b{block[0]}x{block[1]}" if block else f"g{w.group_size}")
        weights = f"w{w.bits}{w.type[0]}-{grain}-{'sym' if w.symmetric else 'asym'}"
        a = self.activations
        if a is None:
            return f"{weights}/a16"
        a_grain = f"group{a.group_size}" if a.group_size else a.granularity
        return f"{weights}/a{a.bits}{a.type[0]}-{a_grain}-{'dyn' if a.dynamic else 'static'}-{'sym' if a.symmetric else 'asym'}"

    @property
    def label(self) -> str:
        """Words for a person: "int4 weights group 128, 16-bit activations", "fp8 weights per channel, fp8 activations dynamic per token"."""
        w, a = self.weights, self.activations
        block = w.block_shape
        grain = {"channel": "per channel", "tensor": "per tensor"}.get(w.granularity) or (
            f"per {block[0]}x{block[1]} block" if block else f"group {w.group_size}")
        weights = f"{_number(w.type, w.bits)} weights {grain}{'' if w.symmetric else ' with zero points'}"
        if a is None:
            return f"{weights}, 16-bit activations"
        a_grain = f"token group of {a.group_size}" if a.group_size else a.granularity
        return f"{weights}, {_number(a.type, a.bits)} activations {'dynamic' if a.dynamic else 'static'} per {a_grain}"

    def quantization_config(self) -> dict:
        """A checkpoint's `quantization_config` for this scheme, as llm-compressor writes it (compressed-tensors)."""
        w, a = self.weights, self.activations
        weights: dict[str, Any] = {"num_bits": w.bits, "type": w.type, "strategy": w.granularity, "group_size": w.group_size,
                                   "symmetric": w.symmetric, "dynamic": False}
        if w.block_shape is not None:
            weights["block_structure"] = list(w.block_shape)
        activations = None if a is None else {
            "num_bits": a.bits, "type": a.type, "strategy": a.granularity, "symmetric": a.symmetric, "dynamic": a.dynamic,
            "group_size": a.group_size}
        return {"quant_method": "compressed-tensors", "format": checkpoint_format(w, a), "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
                "ignore": ["lm_head"]}

    def probe_request(self) -> dict:
        block = self.weights.block_shape
        group = self.weights.group_size if isinstance(self.weights.group_size, int) else (block[1] if block else 1)
        in_features = math.lcm(group, 32) * math.ceil(PROBE_IN_FEATURES / math.lcm(group, 32))
        return {"key": self.key, "config": self.quantization_config(), "in_features": in_features,
                "out_features": PROBE_OUT_FEATURES}


def checkpoint_format(weights: WeightScheme, activations: ActivationScheme | None) -> str:
    """The compressed-tensors format llm-compressor writes (measured): FP8 W8A8 float-quantized, FP8 weight-only
    naive-quantized (both one float8_e4m3fn per weight), int weights with quantized activations int-quantized, int
    weight-only pack-quantized."""
    if weights.type == "float":
        return "naive-quantized" if activations is None else "float-quantized"
    return "pack-quantized" if activations is None else "int-quantized"


def _number(kind: str, bits: int) -> str:
    return f"fp{bits}" if kind == "float" else f"int{bits}"


class KvCase(FrozenModel):
    """One KV cache precision as vLLM's CPU attention backend sees it: the dtype and the head size."""

    kv_cache_dtype: str
    head_size: int

    @property
    def key(self) -> str:
        return f"kv-{self.kv_cache_dtype}-h{self.head_size}"

    @property
    def label(self) -> str:
        return f"a KV cache of dtype {self.kv_cache_dtype} with {self.head_size}-wide heads"

    def probe_request(self) -> dict:
        return {"key": self.key, "kv_cache_dtype": self.kv_cache_dtype, "head_size": self.head_size}


class FormatCase(FrozenModel):
    """A checkpoint another quantize backend writes (GPTQ, bitsandbytes), as vLLM meets it: the config.json
    `quantization_config` of method `method` and one Linear's shape. vLLM's verdict on it is probed here (its config
    classes, then the layer it builds), not assumed."""

    method: str = Field(min_length=1)
    config: dict[str, Any]
    in_features: int = Field(gt=0)
    out_features: int = Field(gt=0)

    @model_validator(mode="after")
    def _one_method(self) -> FormatCase:
        written = self.config.get("quant_method")
        if written is not None and written != self.method:
            raise ValueError(f"the config's quant_method is {written!r}, not {self.method!r}")
        return self

    @property
    def key(self) -> str:
        """Stable across runs and processes: the method and a hash of the config and the shape."""
        text = json.dumps([self.method, self.config, self.in_features, self.out_features], sort_keys=True, default=str)
        return f"format-{self.method}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"

    @property
    def label(self) -> str:
        return f"a {self.method} checkpoint's {self.in_features} -> {self.out_features} Linear"

    def probe_request(self) -> dict:
        return {"key": self.key, "method": self.method, "config": {"quant_method": self.method, **self.config},
                "in_features": self.in_features, "out_features": self.out_features}


class KernelFact(BaseModel):
    """What the probe found for one case on one host."""

    model_config = ConfigDict(extra="ignore")

    key: str
    scheme: str | None = None  # vLLM's compressed-tensors scheme class (a format case: its linear method class)
    kernel: str | None = None  # the linear kernel vLLM chose for it
    error: str | None = None  # why no kernel could serve it (None: served)
    quant_ms: dict[str, float] = {}
    base_ms: dict[str, float] = {}

    @property
    def served(self) -> bool:
        return self.error is None

    def ratio(self, rows: int) -> float | None:
        """Time of this scheme's Linear over the 16-bit one at `rows` rows (None: not served or not timed)."""
        quant, base = self.quant_ms.get(str(rows)), self.base_ms.get(str(rows))
        return quant / base if self.served and quant and base else None

    @property
    def decode_ratio(self) -> float | None:
        return self.ratio(DECODE_ROWS)

    @property
    def prefill_ratio(self) -> float | None:
        return self.ratio(PREFILL_ROWS)

    @property
    def slowdown(self) -> float | None:
        """The geometric mean of the decode and prefill ratios (None: not served or not timed)."""
        ratios = [r for r in (self.decode_ratio, self.prefill_ratio) if r is not None]
        return math.prod(ratios) ** (1 / len(ratios)) if ratios else None


def _case(weights: dict, activations: dict | None = None) -> KernelCase:
    return KernelCase(weights=WeightScheme(**weights), activations=ActivationScheme(**activations) if activations else None)


# The schemes of the shipped recipes and ladders (recipes/, recipes/ladders/): probed together in one run.
STANDARD_CASES: tuple[KernelCase, ...] = (
    *(_case({"bits": 8, "granularity": "channel"}, {"granularity": g, "dynamic": d, "symmetric": s})
      for g, d in (("token", True), ("tensor", False)) for s in (True, False)),
    *(_case({"bits": 4, "granularity": "channel", "symmetric": s}) for s in (True, False)),
    *(_case({"bits": 4, "granularity": "group", "group_size": g, "symmetric": s}) for g in (128, 64, 32) for s in (True, False)),
    _case({"bits": 8, "granularity": "channel"}),
    *(_case({"bits": 4, **weights}, {"granularity": "token", "dynamic": True})
      for weights in ({"granularity": "channel"}, {"granularity": "group", "group_size": 128})),
    # FP8: fp8, fp8-block, fp8-w8a16
    _case({"bits": 8, "type": "float", "granularity": "channel"}, {"type": "float", "granularity": "token", "dynamic": True}),
    _case({"bits": 8, "type": "float", "granularity": "block"}, {"type": "float", "granularity": "group", "group_size": 128, "dynamic": True}),
    _case({"bits": 8, "type": "float", "granularity": "channel"}),
)
# The KV caches of the shipped recipes at the head size of the demo model and SmolLM2.
STANDARD_KV_CASES: tuple[KvCase, ...] = (KvCase(kv_cache_dtype="fp8", head_size=64),)
Case = KernelCase | KvCase | FormatCase


def probe_version() -> str:
    return hashlib.sha256(PROBE_SCRIPT.read_bytes()).hexdigest()[:12]


def _cache_path(profile: HostProfile, dtype: str) -> Path:
    return cache_dir() / f"kernels-{profile.fingerprint}-{dtype}-{probe_version()}.json"


def kernel_facts(profile: HostProfile, cases: Iterable[Case] = (), dtype: str | None = None) -> dict[str, KernelFact]:
    """The probe's facts for `cases` and the standard set on this host at `dtype` (default: the host's serve
    dtype); only cases never probed here are probed, all in one run of the serve environment. A KV case's fact
    names the attention kernel ISA vLLM picks (`kernel`) or why it refuses (`error`); a format case's, vLLM's linear
    method class (`scheme`) and kernel, or its refusal."""
    dtype = dtype or profile.serve_dtype
    path = _cache_path(profile, dtype)
    known = dict(_cached(path))
    wanted = {case.key: case for case in (*STANDARD_CASES, *STANDARD_KV_CASES, *cases)}
    missing = [case for key, case in wanted.items() if key not in known]
    if missing:

        progress(f"probing vLLM's kernels on {profile.host_class} ({len(missing)} scheme(s), once per host; "
                 f"about {10 + len(missing)} s)")
        result = run_probe({"dtype": dtype, "rows": [DECODE_ROWS, PREFILL_ROWS], "budget_s": PROBE_BUDGET_S,
                            "cases": [case.probe_request() for case in missing if isinstance(case, KernelCase)],
                            "kv_cases": [case.probe_request() for case in missing if isinstance(case, KvCase)],
                            "format_cases": [case.probe_request() for case in missing if isinstance(case, FormatCase)]},
                           timeout_s=PROBE_TIMEOUT_S)
        for key, found in (*result["cases"].items(), *result.get("format_cases", {}).items()):
            known[key] = KernelFact.model_validate({**found, "key": key})
        kv_found = result.get("kv_cases", {})
        for case in (case for case in missing if isinstance(case, KvCase)):
            found = kv_found.get(case.key)  # none on a CUDA host: the written rules decide there
            known[case.key] = KernelFact(key=case.key, scheme="CPUAttentionBackend" if found else "not probed",
                                         kernel=found.get("isa") if found else None, error=found.get("error") if found else None)
        store_cache(path, json.dumps({key: fact.model_dump() for key, fact in known.items()}, indent=1))
        _cached.cache_clear()
    return known


@lru_cache(maxsize=8)
def _cached(path: Path) -> dict[str, KernelFact]:
    return read_facts(path, KernelFact)


def read_facts(path: Path, model: type[Fact]) -> dict[str, Fact]:
    """A cache file of probe facts by key ({} when it is missing or damaged: the facts are probed again)."""
    try:
        return {key: model.model_validate(value) for key, value in json.loads(path.read_text()).items()}
    except (OSError, ValueError, ValidationError, AttributeError):
        return {}
