"""Which CPU cores each route's vLLM computes on, when the chain is served by vLLM's CPU build.

vLLM's CPU worker pins its threads to a fixed set of cores, by default every core this process may use but one
(reserved for its API server and engine loop). Two servers on one host therefore pin to the same cores, and a busy
one starves the other: measured on a 2-core host, a primary restarted beside a fallback serving 2 requests a second
got 4% of core 0 and did not start within 300 s; with the two on separate cores it started in 45 s. So each route
gets its own cores (vLLM's VLLM_CPU_OMP_THREADS_BIND): the cores this process may use, in order, split into one
contiguous share per route, the primary's first and largest. With fewer cores than routes, routes share round-robin
and the plan says which do.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pydantic import Field

from pipelines.schema import StrictModel


class CorePlan(StrictModel):
    """Per route, in chain order, the cores its worker is pinned to (vLLM's list syntax), and why."""

    cores: list[str]
    shared: bool = Field(description="fewer cores than routes: some routes share theirs")
    note: str


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, which a container's cpuset narrows), in order."""
    return sorted(os.sched_getaffinity(0))


def plan_cores(available: Sequence[int], routes: int) -> CorePlan:
    if routes < 1 or not available:
        raise ValueError(f"plan_cores needs at least one route and one core (routes={routes}, cores={list(available)})")
    cores = sorted(set(available))
    if len(cores) < routes:
        shares = [[cores[index % len(cores)]] for index in range(routes)]
        note = (f"{routes} routes on {len(cores)} core(s): routes share cores round-robin, so a busy route slows a restarting one")
        return CorePlan(cores=[_cpu_list(share) for share in shares], shared=True, note=note)
    base, extra = divmod(len(cores), routes)
    shares, start = [], 0
    for index in range(routes):
        size = base + (1 if index < extra else 0)
        shares.append(cores[start:start + size])
        start += size
    return CorePlan(cores=[_cpu_list(share) for share in shares], shared=False, note=f"{len(cores)} cores split between {routes} routes")


def _cpu_list(cores: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the syntax of VLLM_CPU_OMP_THREADS_BIND and of Linux's cpu lists)."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
