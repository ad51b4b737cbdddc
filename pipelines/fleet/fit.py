"""Does the whole chain fit this machine? The planner's memory model, per route, added up against what the host has.

Every route is a vLLM server of its own, all running at once, so the chain fits when the sum fits. Per route the
planner (pipelines/planner) gives the weights (measured from the safetensors headers), the activations of vLLM's
profiling pass for the route's max_num_seqs and the overhead; the KV cache is what vLLM reserves on the CPU,
VLLM_CPU_KVCACHE_SPACE (the route's kv_cache_gib), or the planner's worst case (max_model_len x max_num_seqs) if
that is larger. A route whose one sequence of max_model_len does not fit its own KV space would be refused by vLLM
at start: refused here first. The machine's memory is what it has available now (MemAvailable), since other
processes hold the rest.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from pipelines.errors import InputError
from pipelines.fleet.routes import ResolvedRoute
from pipelines.planner import gpu_spec, plan
from pipelines.planner.gpus import GiB
from pipelines.planner.kv import kv_cache_bytes_for_context, kv_element_bytes
from pipelines.planner.shape import load_config, model_shape
from pipelines.schema import StrictModel


class RouteMemory(StrictModel):
    label: str
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes + self.overhead_bytes


class FitReport(StrictModel):
    routes: list[RouteMemory]
    required_bytes: int
    available_bytes: int
    machine: str


def available_memory_bytes() -> int:
    return int(psutil.virtual_memory().available)


def route_memory(route: ResolvedRoute, machine_bytes: int) -> RouteMemory:
    settings = route.serve
    config = route.model_dir / "config.json"
    machine = gpu_spec(memory_gib=max(machine_bytes, GiB) / GiB)
    row = plan(config, [], machine, settings.max_model_len, settings.max_num_seqs, artifact_dir=route.model_dir).fit_row()
    kv_space = settings.cpu_kv_cache_gib * GiB
    _check_one_sequence(route, config, kv_space)
    return RouteMemory(label=route.label, weights_bytes=row.weights_bytes, kv_bytes=max(kv_space, row.kv_cache_bytes),
                       activation_bytes=row.activation_bytes, overhead_bytes=row.overhead_bytes)


def _check_one_sequence(route: ResolvedRoute, config: Path, kv_space: int) -> None:
    data, source = load_config(config)
    shape = model_shape(data, source)
    _, element = kv_element_bytes(shape, "auto", route.serve.served_dtype())
    one = kv_cache_bytes_for_context(shape, element, route.serve.max_model_len)
    if one > kv_space:
        raise InputError(
            f"{route.describe()}: one sequence of max_model_len {route.serve.max_model_len} needs {one / GiB:.2f} GiB of KV cache, more "
            f"than its KV space ({route.serve.cpu_kv_cache_gib} GiB); vLLM would refuse to start", field=f"{route.field}.max_model_len",
        )


def check_fit(routes: list[ResolvedRoute], *, source: Path | str, available_bytes: int | None = None) -> FitReport:
    """The chain's memory against the machine's available memory; an InputError naming the largest route when it does not fit."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    memory = [route_memory(route, available) for route in routes]
    required = sum(item.total_bytes for item in memory)
    report = FitReport(routes=memory, required_bytes=required, available_bytes=available, machine="this host's available memory (MemAvailable)")
    if required > available:
        largest = max(memory, key=lambda item: item.total_bytes)
        parts = ", ".join(f"{item.label} {item.total_bytes / GiB:.2f}" for item in memory)
        raise InputError(
            f"the chain needs {required / GiB:.2f} GiB ({parts}; the largest, {largest.label}: weights {largest.weights_bytes / GiB:.2f}, KV "
            f"{largest.kv_bytes / GiB:.2f}, activations {largest.activation_bytes / GiB:.2f}, overhead {largest.overhead_bytes / GiB:.2f}) "
            f"but this machine has {available / GiB:.2f} GiB available; it does not fit by the planner", file=source,
            field=next(route.field for route in routes if route.label == largest.label),
        )
    return report
