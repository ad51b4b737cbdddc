"""The load test inside a gate run (pipelines.runs.runner): which servers it reuses, when it runs, what it changes.

Servers: while the load test is wanted, the runner serves through a ServerPool: a server the quality gate
starts (the baseline when its scores are not cached, the candidate likewise) is kept up after its scoring
instead of being stopped, so the load test reuses it; a model whose scores were cached has no server yet, and
the pool starts it once for the load test (`loadtest-<role>-server.log`, stage `loadtest_<role>_serve_start_s`).
Every server stops when the pool's block ends, however it ends (an error, Ctrl-C): a failed load test leaves
nothing running. In the cold case this keeps the baseline server up (idle) while the candidate is scored:
memory for one more server, a start saved.

When: after the quality gate, only for a candidate it promoted (a rejected one cannot be promoted by speed)
and when neither `--no-loadtest` nor the policy's `performance.enabled: false` turns it off. Its failed
checks reject the candidate only when the policy's performance block is enforced (pipelines.loadtest.verdict); an
enforced check the comparison could not decide is an error (exit 2), its report kept in the failed run's folder.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

from pipelines.files.atomic import write_json_atomic
from pipelines.hardware.targets import installed_target
from pipelines.loadtest import bench
from pipelines.loadtest.results import PerformanceReport, Role
from pipelines.loadtest.stage import LOADTEST_DIR, StageInputs, run_loadtest
from pipelines.loadtest.verdict import apply_to_gate, inconclusive_error
from pipelines.serve.serving import RunningServer, ServeSettings, vllm_server

INCONCLUSIVE_JSON = "performance-inconclusive.json"  # an enforced, undecided load test's report, kept beside error.txt


class ServerPool:
    """Servers kept up until the pool's block ends; serves as the load test's ServerSource."""

    def __init__(self, stack: ExitStack, staging: Path, serve: ServeSettings, models: dict[Role, Path], stages: dict[str, float],
                 start: Callable[..., AbstractContextManager[RunningServer]] = vllm_server):
        self._stack, self._staging, self._serve, self._models, self._stages = stack, staging, serve, models, stages
        self._start = start  # pipelines.serve.serving.vllm_server (the runner hands over its own reference)
        self._servers: dict[Role, tuple[RunningServer, str]] = {}
        # The tool's process, started now: vLLM's import (10-40 s) overlaps the servers' start and the scoring.
        self.driver = stack.enter_context(bench.BenchDriver(staging / LOADTEST_DIR))

    @contextmanager
    def serve(self, model_dir: Path, *, log_path: Path, settings: ServeSettings, served_name: str) -> Iterator[RunningServer]:
        """vllm_server's signature; the server outlives this block (the pool stops it), for the load test to reuse."""
        server = self._stack.enter_context(self._start(model_dir, log_path=log_path, settings=settings, served_name=served_name))
        if served_name in ("baseline", "candidate"):
            self._servers[served_name] = (server, "quality gate")  # type: ignore[index]
        yield server

    def __call__(self, role: Role) -> tuple[RunningServer, str]:
        if role not in self._servers:
            server = self._stack.enter_context(self._start(
                self._models[role], log_path=self._staging / f"loadtest-{role}-server.log", settings=self._serve, served_name=role,
            ))
            self._stages[f"loadtest_{role}_serve_start_s"] = round(server.startup_s, 2)
            self._servers[role] = (server, "load test")
        return self._servers[role]


@contextmanager
def server_pool(wanted: bool, staging: Path, serve: ServeSettings, baseline_dir: Path, artifact_dir: Path,
                stages: dict[str, float], start: Callable[..., AbstractContextManager[RunningServer]] = vllm_server,
                ) -> Iterator[ServerPool | None]:
    """A pool when the load test may run (None otherwise: servers stop after their scoring, as without it)."""
    if not wanted:
        yield None
        return
    with ExitStack() as stack:
        yield ServerPool(stack, staging, serve, {"baseline": baseline_dir, "candidate": artifact_dir}, stages, start)


def stage_inputs(job, prompts: dict, identity, plan: dict | None, staging: Path) -> StageInputs:
    """What the stage needs from a gate run (`job`: pipelines.runs.runner.GateJob)."""

    fit = job.settings.policy.fit_for(identity)
    return StageInputs(
        eval_sets=job.settings.eval_sets, prompts=prompts, baseline_dir=job.baseline_dir, artifact_dir=job.artifact_dir,
        serve=job.settings.serve, policy=job.settings.policy.performance_for(identity),
        fit_concurrency=fit.concurrency if fit is not None else None, plan=plan, target=str(installed_target()),
        run_dir=staging, title=f"{job.recipe_name} against 16-bit",
    )


def after_quality_gate(gate, pool: ServerPool | None, inputs: Callable[[], StageInputs], stages: dict[str, float]):
    """(gate, performance): the load test's checks added to a promoted gate; (gate, None) when it does not run."""
    if pool is None or gate.verdict != "promoted":
        return gate, None

    started, before = time.monotonic(), set(stages)
    stage = inputs()
    try:
        report: PerformanceReport = run_loadtest(stage, pool, pool.driver)
    finally:  # its own time, without the server starts the pool recorded as stages of their own
        starts = sum(seconds for name, seconds in stages.items() if name not in before)
        stages["loadtest_s"] = round(time.monotonic() - started - starts, 2)
    undecided = inconclusive_error(report)
    if undecided is not None:  # the evidence stays in the failed run's folder
        write_json_atomic(stage.run_dir / LOADTEST_DIR / INCONCLUSIVE_JSON, report.model_dump(mode="json"))
        raise undecided
    return apply_to_gate(gate, report.reasons, report.warnings), report
