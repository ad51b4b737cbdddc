"""The semantic canary as the routes' health check, beside /health (docs/fleet.md "The canary").

/health says a server's engine runs; it says nothing of what it answers ("200 OK but garbage": weights swapped, a runtime
that changed the kernels, a corrupted KV cache). Each version route's signed promotion bundle holds a golden set
(pipelines/canary/golden.py: prompts, the promoted model's greedy answers and log-probabilities, the recorded tolerance);
every `rules.canary_every_s` the supervisor asks a route's own server (not through nginx: the route, not the chain) the
golden prompts (pipelines/canary/probe.py). A route that answers but disagrees beyond the tolerance is unhealthy: the
supervisor takes it out of the chain (nginx `down`, reloaded), its breaker is open in the traffic and an event names the
disagreeing prompts; it comes back when a later probe agrees. A probe that gets no answer decides nothing here (a dead
or hung server is the passive breaker's and the restart rules' business).

Probes run in one background thread, one route at a time, so the watch loop (restarts, nginx, the state file) never waits
for one. A base route (a 16-bit model) has no golden set of its own and is not probed.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from pipelines.canary.golden import GoldenSet, load_golden
from pipelines.canary.probe import CanaryResult, probe_canary
from pipelines.fleet.routes import ResolvedRoute
from pipelines.schema import StrictModel
from pipelines.serve.serving import LOOPBACK

MIN_PROBE_TIMEOUT_S = 30.0  # a probe shares the route with its traffic: a golden answer may wait behind a full batch


def load_goldens(routes: list[ResolvedRoute], every_s: float) -> list[GoldenSet | None]:
    """Each route's golden set (None: a base route, a bundle from before canaries, or canaries off); a malformed one is an
    InputError naming the file and field, raised before anything starts."""
    if not every_s:
        return [None] * len(routes)
    return [load_golden(route.bundle) if route.bundle is not None else None for route in routes]


class Probed(StrictModel):
    """A finished probe: which route, on which port (a restarted route's old probe is not its verdict), and the result."""

    index: int
    port: int
    result: CanaryResult


class CanaryChecks:
    """When each route is due, and the one probe in flight."""

    def __init__(self, goldens: list[GoldenSet | None], every_s: float, model: str):
        self.goldens = goldens
        self.every_s = every_s
        self.model = model
        self.due_at = [0.0] * len(goldens)  # the first probe as soon as the deployment serves
        self.pool: ThreadPoolExecutor | None = None
        self.pending: tuple[int, int, Future[CanaryResult]] | None = None

    def due(self, index: int, now: float) -> bool:
        return bool(self.every_s) and self.goldens[index] is not None and self.pending is None and now >= self.due_at[index]

    def start(self, index: int, port: int, api_key: str | None, timeout_s: float) -> None:
        golden = self.goldens[index]
        assert golden is not None  # due()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="canary")
        self.due_at[index] = time.monotonic() + self.every_s
        future = self.pool.submit(probe_canary, f"http://{LOOPBACK}:{port}", model=self.model, golden=golden, api_key=api_key,
                                  timeout_s=max(MIN_PROBE_TIMEOUT_S, timeout_s))
        self.pending = (index, port, future)

    def finished(self) -> Probed | None:
        """The probe in flight once it has ended; None while it runs (or none runs)."""
        if self.pending is None or not self.pending[2].done():
            return None
        index, port, future = self.pending
        self.pending = None
        return Probed(index=index, port=port, result=future.result())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
