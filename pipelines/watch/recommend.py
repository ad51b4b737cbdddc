"""Tuning from measurement: what production's windows say about max_model_len, the KV space and max_num_seqs.

Each recommendation cites the window it came from (its figures) and carries the planner's check that it fits: the KV cache
vLLM would allocate for the proposed arguments (pipelines/planner/kv.py vllm_kv_cache: blocks of the space, blocks per
max-length request) must hold max_num_seqs requests of max_model_len tokens. The rules:

- KV idle: the KV cache peaked under KV_IDLE of its capacity in every window, with no preemption and no queue -> room for a
  longer max_model_len in the same space (the longest that still holds max_num_seqs full requests, up to the model's own
  limit), or a smaller KV space (the smallest that still holds them);
- KV pressure: a window with preemptions, or with a queue while the KV cache was nearly full (KV_FULL) -> more KV space
  (the smallest that holds max_num_seqs full requests with the queue served too), or a lower max_num_seqs (what the
  current space holds at full length);
- queue with idle KV: requests waited while the batch was full (running reached max_num_seqs) and the KV cache stayed under
  KV_IDLE -> a higher max_num_seqs (double, if the space holds that many full requests).

Nothing is copied from anywhere: every number is the window's or the planner's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import Field

from pipelines.bounds import GiB
from pipelines.deploy.spec import ServedSpec
from pipelines.errors import InputError
from pipelines.planner.kv import CPU_BLOCK_SIZE, CUDA_BLOCK_SIZE, kv_element_bytes, vllm_kv_cache
from pipelines.planner.shape import ModelShape, load_config, model_shape
from pipelines.schema import StrictModel
from pipelines.serve.serving import MAX_CPU_KV_CACHE_GIB
from pipelines.serve.vllm_series import CACHE_INFO
from pipelines.watch.figures import Figures
from pipelines.watch.series import KvCacheInfo

KV_IDLE = 0.5
KV_FULL = 0.9


class Evidence(StrictModel):
    window: int
    start: float
    end: float
    figures: dict[str, float | None]


class PlannerCheck(StrictModel):
    fits: bool
    detail: str


class Recommendation(StrictModel):
    kind: str
    text: str
    arguments: dict[str, float | int] = Field(description="the vLLM arguments (or VLLM_CPU_KVCACHE_SPACE) to change")
    evidence: Evidence
    planner: PlannerCheck


class _Kv:
    """The planner's view of the deployed model's KV cache, for asking what other arguments would allocate."""

    def __init__(self, spec: ServedSpec):
        data, source = load_config(Path(spec.folder) / "config.json")
        self.shape: ModelShape = model_shape(data, source)
        self.on_cpu = spec.target.split(":")[0] == "cpu"
        self.block_size = CPU_BLOCK_SIZE if self.on_cpu else CUDA_BLOCK_SIZE
        self.element = kv_element_bytes(self.shape, "auto", spec.args.dtype)[1]

    def concurrency(self, space_gib: int, max_model_len: int) -> float:
        """Max-length requests the KV cache holds at once, as vLLM computes it."""
        cache = vllm_kv_cache(self.shape, self.element, space_gib * GiB, block_size=self.block_size, max_model_len=max_model_len)
        return cache.max_concurrency

    def smallest_space(self, seqs: int, max_model_len: int) -> int | None:
        return next((gib for gib in range(1, MAX_CPU_KV_CACHE_GIB + 1) if self.concurrency(gib, max_model_len) >= seqs), None)

    def longest_len(self, space_gib: int, seqs: int, current: int) -> int:
        limit = self.shape.max_position or current
        best, length = current, current
        while length < limit:
            length = min(limit, length * 2)
            if self.concurrency(space_gib, length) < seqs:
                break
            best = length
        return best


def recommendations(spec: ServedSpec, windows: list[tuple[int, float, float, Figures]],
                    served: KvCacheInfo | None = None) -> tuple[list[Recommendation], list[str]]:
    """Recommendations from the windows (index, start, end, figures) and the server's own KV cache (`served`: its
    vllm:cache_config_info), and notes on what could not be recommended."""
    busy = [w for w in windows if w[3].requests > 0 or (w[3].running_max or 0) > 0]
    if not busy:
        return [], ["no window served a request: nothing to tune from"]
    if not spec.args.cpu_kv_cache_gib:
        return [], ["recommendations are planned for a CPU target's KV space (VLLM_CPU_KVCACHE_SPACE); on a GPU re-plan with "
                    "`quantize plan` from the figures above"]
    try:
        kv = _Kv(spec)
    except InputError as error:
        return [], [f"the planner cannot read the model's config.json: {error.one_line()}"]
    found = _kv_pressure(spec, kv, busy, served) or _queue_with_idle_kv(spec, kv, busy) or _kv_idle(spec, kv, busy)
    return found, []


def _evidence(window: tuple[int, float, float, Figures], *keys: str) -> Evidence:
    index, start, end, figures = window
    return Evidence(window=index, start=start, end=end, figures={key: getattr(figures, key) for key in keys})


_KV_KEYS = ("kv_cache_usage", "preemptions", "waiting_p95", "running_max", "requests")


def _kv_pressure(spec: ServedSpec, kv: _Kv, windows: list[tuple[int, float, float, Figures]], served: KvCacheInfo | None) -> list[Recommendation]:
    pressed = [w for w in windows if w[3].preemptions > 0 or ((w[3].waiting_p95 or 0) > 0 and (w[3].kv_cache_usage or 0) >= KV_FULL)]
    if not pressed:
        return []
    worst = max(pressed, key=lambda w: (w[3].preemptions, w[3].kv_cache_usage or 0))
    args, figures = spec.args, worst[3]
    seqs, length, space = args.max_num_seqs, args.max_model_len, args.cpu_kv_cache_gib or 1
    planned = kv.concurrency(space, length)
    held, measured = _held(served, length, planned)
    why = (f"window {worst[0]}: {figures.preemptions:g} preemption(s), KV cache peaked at {_pct(figures.kv_cache_usage)}, "
           f"p95 of {figures.waiting_p95 or 0:g} waiting; the server's KV cache holds {held:.1f} requests of {length} tokens ({measured})")
    found = []
    enough = kv.smallest_space(seqs, length)
    if enough is not None and (enough > space or held < min(planned, seqs)):
        found.append(Recommendation(
            kind="more_kv_space", arguments={"VLLM_CPU_KVCACHE_SPACE": enough},
            text=f"{why}: serve with a KV space of {enough} GiB (VLLM_CPU_KVCACHE_SPACE; the spec says {space}) so {seqs} sequences of "
                 f"{length} tokens fit",
            evidence=_evidence(worst, *_KV_KEYS),
            planner=PlannerCheck(fits=True, detail=f"{enough} GiB holds {kv.concurrency(enough, length):.1f} requests of {length} tokens "
                                                   f"(max_num_seqs {seqs})")))
    lower = max(1, math.floor(held))
    if lower < seqs:
        found.append(Recommendation(
            kind="lower_max_num_seqs", arguments={"max_num_seqs": lower},
            text=f"{why}: or lower --max-num-seqs from {seqs} to {lower}, what that KV cache holds at {length} tokens each",
            evidence=_evidence(worst, *_KV_KEYS),
            planner=PlannerCheck(fits=held >= lower, detail=f"{held:.1f} requests of {length} tokens fit ({measured})")))
    if not found:
        found.append(Recommendation(
            kind="kv_pressure", arguments={},
            text=f"{why}; it holds max_num_seqs {seqs} at full length, so the pressure comes from prefills and decodes in flight: "
                 "watch longer before changing the arguments",
            evidence=_evidence(worst, *_KV_KEYS), planner=PlannerCheck(fits=True, detail=f"{held:.1f} >= {seqs}")))
    return found


def _held(served: KvCacheInfo | None, length: int, planned: float) -> tuple[float, str]:
    """Max-length requests the running server's KV cache holds: measured (vllm:cache_config_info) when it says, else planned."""
    if served is not None and served.num_blocks and served.block_size:
        per_request = math.ceil(length / served.block_size)
        return served.num_blocks / per_request, f"measured: {CACHE_INFO}, {served.num_blocks} blocks of {served.block_size} tokens"
    return planned, f"planned: the server does not export {CACHE_INFO}"


def _queue_with_idle_kv(spec: ServedSpec, kv: _Kv, windows: list[tuple[int, float, float, Figures]]) -> list[Recommendation]:
    args = spec.args
    queued = [w for w in windows if (w[3].waiting_p95 or 0) > 0 and (w[3].kv_cache_usage or 0) < KV_IDLE
              and (w[3].running_max or 0) >= args.max_num_seqs]
    if not queued:
        return []
    window = max(queued, key=lambda w: w[3].waiting_p95 or 0)
    space, length, more = args.cpu_kv_cache_gib or 1, args.max_model_len, args.max_num_seqs * 2
    held = kv.concurrency(space, length)
    figures = window[3]
    return [Recommendation(
        kind="higher_max_num_seqs", arguments={"max_num_seqs": more},
        text=f"window {window[0]}: p95 of {figures.waiting_p95:g} requests waited while {figures.running_max:g} ran (max_num_seqs "
             f"{args.max_num_seqs}) and the KV cache peaked at {_pct(figures.kv_cache_usage)}: raise --max-num-seqs to {more}",
        evidence=_evidence(window, *_KV_KEYS),
        planner=PlannerCheck(fits=held >= more, detail=f"{space} GiB holds {held:.1f} requests of {length} tokens"
                                                       + ("" if held >= more else f": not {more}; give it more KV space first")))]


def _kv_idle(spec: ServedSpec, kv: _Kv, windows: list[tuple[int, float, float, Figures]]) -> list[Recommendation]:
    if any(w[3].preemptions > 0 or (w[3].waiting_max or 0) > 0 or (w[3].kv_cache_usage or 0) >= KV_IDLE for w in windows):
        return []
    peak = max(windows, key=lambda w: w[3].kv_cache_usage or 0)
    args = spec.args
    space, length, seqs = args.cpu_kv_cache_gib or 1, args.max_model_len, args.max_num_seqs
    why = f"window {peak[0]}: the KV cache peaked at {_pct(peak[3].kv_cache_usage)} with no preemption and no queue"
    found = []
    longer = kv.longest_len(space, seqs, length)
    if longer > length:
        found.append(Recommendation(
            kind="longer_max_model_len", arguments={"max_model_len": longer},
            text=f"{why}: room for --max-model-len {longer} (now {length}) in the same {space} GiB at max_num_seqs {seqs}",
            evidence=_evidence(peak, *_KV_KEYS),
            planner=PlannerCheck(fits=True, detail=f"{space} GiB holds {kv.concurrency(space, longer):.1f} requests of {longer} tokens "
                                                   f"(model limit {kv.shape.max_position})")))
    smaller = kv.smallest_space(seqs, length)
    if smaller is not None and smaller < space:
        found.append(Recommendation(
            kind="smaller_kv_space", arguments={"VLLM_CPU_KVCACHE_SPACE": smaller},
            text=f"{why}: or a smaller KV space, {smaller} GiB (now {space}), still holding {seqs} sequences of {length} tokens",
            evidence=_evidence(peak, *_KV_KEYS),
            planner=PlannerCheck(fits=True, detail=f"{smaller} GiB holds {kv.concurrency(smaller, length):.1f} requests of {length} tokens")))
    if not found:
        found.append(Recommendation(
            kind="kv_headroom", arguments={},
            text=f"{why}; {space} GiB is already the smallest KV space on this target and {length} tokens the model's longest "
                 f"context that {seqs} sequences fit: the deployment has headroom for more traffic",
            evidence=_evidence(peak, *_KV_KEYS),
            planner=PlannerCheck(fits=True, detail=f"{space} GiB holds {kv.concurrency(space, length):.1f} requests of {length} tokens")))
    return found


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def as_json(found: list[Recommendation]) -> list[dict[str, Any]]:
    return [item.model_dump(mode="json") for item in found]
