"""The shape probe: the model's own Linear shapes timed through vLLM's kernels against 16-bit, cached per host.

Each (vLLM Linear, scheme) pair of the model is one case: the serve environment (pipelines/hardware/serve_probe.py)
builds its copies (pipelines/hardware/shapes.py says how many) quantized and in 16 bits, and times them alternately at
every decode batch size (1, 2, 4, ... up to the serving max_num_seqs) and at one prefill chunk of PREFILL_ROWS tokens,
with as many threads as vLLM's worker computes with here. Results are cached beside the serve environment per host
fingerprint, vLLM version, serve dtype, thread count and probe version, keyed by the case (shape, scheme, copies and
row counts): a model probed once is answered from the cache.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pipelines.console.output import progress
from pipelines.hardware.host import HostProfile
from pipelines.hardware.kernels import KernelCase, probe_version, read_facts
from pipelines.hardware.serve_env import cache_dir, run_probe, store_cache
from pipelines.hardware.shapes import VllmLinear
from pipelines.schema import FrozenModel

# vLLM's CPU server batches up to 2048 tokens a step by default (max_num_batched_tokens, vllm/engine/arg_utils.py);
# 256 rows already make every Linear compute-bound here and keep the probe short, and the serving default
# max_model_len of this product is 512: a chunk of 256 is what a few concurrent prompts fill.
PREFILL_ROWS = 256
MAX_DECODE_ROWS = 256  # the largest decode batch probed (max_num_seqs above it is probed at this)
TIMING_TARGET_S = 60.0  # the timing of one probe run, split over its cases and row counts
ROW_BUDGET_S = (0.15, 1.0)  # per case and row count, at least / at most
SHAPE_PROBE_TIMEOUT_S = 600.0
FRESH_ROWS = 8  # row counts never seen, timed on their first call per case
SHAPES_VERSION = "1"  # the rules that size a case (copies, rows): a change re-probes


def decode_rows(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, and max_num_seqs itself (at most MAX_DECODE_ROWS)."""
    top = max(1, min(max_num_seqs, MAX_DECODE_ROWS))
    rows = [1 << power for power in range(top.bit_length()) if 1 << power < top]
    return [*rows, top]


class ShapeCase(FrozenModel):
    """One vLLM Linear under one scheme as the probe builds it."""

    linear: VllmLinear
    case: KernelCase | None = Field(description="None: a Linear kept in 16 bits (only its 16-bit copies are timed)")
    copies_quant: int = Field(gt=0)
    copies_base: int = Field(gt=0)
    rows: tuple[int, ...]

    @property
    def key(self) -> str:
        scheme = self.case.key if self.case is not None else "16-bit"
        return (f"{self.linear.shape.replace(' ', '')}/{scheme}/n{self.copies_quant}-{self.copies_base}/"
                f"r{'-'.join(str(r) for r in self.rows)}")

    def probe_request(self) -> dict:
        config = None
        if self.case is not None:
            config = self.case.quantization_config()
        return {"key": self.key, "config": config, "in_features": self.linear.in_features, "out_features": self.linear.out_features,
                "bias": self.linear.bias, "copies": {"quant": self.copies_quant, "base": self.copies_base}}


class ShapeFact(BaseModel):
    """What the probe measured for one case: ms per call by row count, quantized and 16-bit."""

    model_config = ConfigDict(extra="ignore")

    key: str
    scheme: str | None = None
    kernel: str | None = None
    error: str | None = None
    quant_ms: dict[str, float] = {}
    base_ms: dict[str, float] = {}
    rounds: dict[str, int] = {}
    fresh_ms: dict[str, float] = {}  # the first call at a row count never seen, per format (quant, base)
    seconds: float = 0.0


def _cache_path(profile: HostProfile, dtype: str, threads: int) -> Path:
    version = hashlib.sha256(f"{probe_version()}-{SHAPES_VERSION}".encode()).hexdigest()[:12]
    vllm = "".join(c if c.isalnum() or c in ".-" else "_" for c in profile.vllm_version) or "unknown"
    return cache_dir() / f"shapes-{profile.fingerprint}-vllm{vllm}-{dtype}-t{threads}-{version}.json"


def shape_facts(profile: HostProfile, cases: list[ShapeCase], *, dtype: str, threads: int,
                probe_missing: bool = True) -> tuple[dict[str, ShapeFact], float]:
    """The facts of `cases` on this host, and the seconds this call spent probing (0: all from the cache). Cases never
    probed here are probed in one run of the serve environment (`probe_missing=False`: left out, for a caller that may
    only read the cache)."""
    path = _cache_path(profile, dtype, threads)
    known = read_facts(path, ShapeFact)
    missing = list({case.key: case for case in cases if case.key not in known}.values())
    if not missing or not probe_missing:
        return known, 0.0
    rows = sorted({row for case in missing for row in case.rows})
    budget = min(max(TIMING_TARGET_S / (len(missing) * len(rows)), ROW_BUDGET_S[0]), ROW_BUDGET_S[1])
    progress(f"probing the model's Linear shapes on {profile.host_class}: {len(missing)} case(s) x {len(rows)} row counts "
             f"(about {round(20 + len(missing) * len(rows) * budget * 1.5)} s, once per host)")
    started = time.perf_counter()
    result = run_probe({"dtype": dtype, "threads": threads, "shape_rows": rows, "shape_budget_s": budget,
                        "fresh_rows": FRESH_ROWS, "shape_cases": [case.probe_request() for case in missing]}, timeout_s=SHAPE_PROBE_TIMEOUT_S)
    seconds = time.perf_counter() - started
    for key, found in result.get("shape_cases", {}).items():
        known[key] = ShapeFact.model_validate({**found, "key": key})
    store_cache(path, json.dumps({key: fact.model_dump() for key, fact in known.items()}, indent=1))
    return known, seconds
