"""The Ray executor's driver: the job's plan (pipelines.jobs.job) run as a task graph on a cluster.

Before any work, each a one-line exit 2: the cluster answers (`--ray-address`), some node can run every task
that will run (pipelines.jobs.ray.resources: which candidate needs what), the artifacts root is shared by
every node (pipelines.jobs.ray.probe), each registry can be written. Candidates the ledger has decided are
skipped as a local run skips them.

Then one baseline task per (model, eval sets, policy, serve settings) and each candidate as a task that
depends on it (pipelines.jobs.ray.graph), each in a worker process of its own (`max_calls=1`: vLLM does not
reliably free memory in-process). A worker that dies (killed, node lost) is run again by Ray up to the job's
`max_retries`; a candidate's own error comes back as its result and is recorded once. The driver is the
only writer of the ledger and the registry: as each result arrives it verifies the artifact on the shared
store, registers the run and records the ledger entry (a killed driver leaves a ledger the rerun resumes
from).
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipelines.artifact import verify_artifact
from pipelines.console.output import progress
from pipelines.errors import InputError, QuantGateError
from pipelines.hardware.targets import ServeTarget, installed_target
from pipelines.jobs.job import (
    Candidate,
    CandidateResult,
    JobSummary,
    Ledger,
    PlannedJob,
    cached_result,
    candidate_label,
    decision_line,
    summarize,
)
from pipelines.jobs.ray.cluster import alive_nodes, connected, probe_shared_store
from pipelines.jobs.ray.graph import BaselineGroup, baseline_groups, submit_graph
from pipelines.jobs.ray.resources import TaskResources, check_some_node_fits, task_resources
from pipelines.jobs.ray.tracker import Tracker
from pipelines.jobs.ray.worker import TaskStatus, baseline_task, candidate_task
from pipelines.registry.store import Registry
from pipelines.runs.runner import register_run
from pipelines.settings import current as current_settings

POLL_S = 1.0
PROGRESS_EVERY_S = 60.0


def run_on_ray(planned: PlannedJob, *, address: str | None) -> JobSummary:
    job, job_path, candidates, ledger = planned
    started = time.monotonic()
    _refuse_repair(candidates, job_path)
    results: dict[int, CandidateResult] = {}
    for position, candidate in enumerate(candidates):
        cached = cached_result(ledger, candidate, candidate_label(position + 1, candidates), left=len(candidates) - position - 1)
        if cached is not None:
            results[position] = cached
    to_run = [position for position in range(len(candidates)) if position not in results]
    groups = baseline_groups(candidates, to_run)
    requests = _requests(candidates, to_run, groups, installed_target())
    with connected(address) as ray:
        nodes = alive_nodes(ray)
        check_some_node_fits({label: request for label, (request, _) in requests.items()}, [n.resources for n in nodes], file=job_path)
        probe_shared_store(ray, current_settings().artifacts_dir.resolve(), nodes)
        _check_registries_writable(candidates)
        progress(f"Ray cluster: {len(nodes)} node(s), shared store checked; {len(to_run)} candidate(s) to run, "
                 f"{len(groups)} baseline task(s), max_retries {job.max_retries}")
        status_dir = ledger.path.parent / f"{job.name}.tasks"
        shutil.rmtree(status_dir, ignore_errors=True)  # attempts are counted per run of the job
        handles, baselines = _submit(ray, candidates, groups, requests, job.max_retries, status_dir)
        try:
            with stop_requested() as stop:
                results.update(_collect(ray, candidates, handles, baselines, ledger, job.max_retries, status_dir, stop))
        finally:
            for handle in handles.values():  # what is left after an error or SIGTERM: workers and their servers stopped
                ray.cancel(handle, force=True)
    return summarize(planned, [results[p] for p in range(len(candidates))], round(time.monotonic() - started, 1))


@contextmanager
def stop_requested() -> Iterator[threading.Event]:
    """SIGTERM and SIGINT set an event the driver's loop checks between waits (then raises KeyboardInterrupt, the
    CLI's "interrupted"): Ray's driver replaces the CLI's SIGTERM handler with its own exit, and an exception raised
    by a handler inside Ray's wait comes out as SystemExit."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _refuse_repair(candidates: list[Candidate], job_path: Path) -> None:
    repairing = [candidate_label(p + 1, candidates) for p, c in enumerate(candidates) if c.repair]
    if repairing:
        raise InputError(f"repair: true is not available with the ray executor yet (each repair attempt registers itself, and only "
                         f"the driver may write the registry): {', '.join(repairing)}; run it with --executor local",
                         file=job_path, field="executor")


def _check_registries_writable(candidates: list[Candidate]) -> None:

    for path in {c.settings.registry_path for c in candidates if c.settings.registry_path is not None}:
        if Registry(path).read_only:  # opened (created, migrated) now, as a local run does before serving
            raise InputError("the registry cannot be written here; fix its permissions", file=path, field="registry")


def _requests(
    candidates: list[Candidate], to_run: list[int], groups: list[BaselineGroup], target: ServeTarget,
) -> dict[str, tuple[TaskResources, int | str]]:
    """Each task's resources by label, with the candidate position (or baseline group key) it is for."""
    requests: dict[str, tuple[TaskResources, int | str]] = {}
    for position in to_run:  # candidates first: a refusal names the candidate that needs what no node has
        candidate = candidates[position]
        fit = candidate.settings.policy.fit_for(candidate.loaded.name)
        request = task_resources(candidate.model, candidate.loaded, fit, target, cpu_kv_cache_gib=candidate.settings.serve.cpu_kv_cache_gib)
        requests[f"candidates {candidate_label(position + 1, candidates)}"] = (request, position)
    for group in groups:
        request = task_resources(group.model, None, group.settings.policy.fit, target, cpu_kv_cache_gib=group.settings.serve.cpu_kv_cache_gib)
        requests[f"the 16-bit baseline of {group.model.name}"] = (request, group.key)
    return requests


def _submit(
    ray: Any, candidates: list[Candidate], groups: list[BaselineGroup], requests: dict[str, tuple[TaskResources, int | str]],
    max_retries: int, status_dir: Path,
) -> tuple[dict[int, Any], dict[int, Any]]:
    """The candidates' task handles, and the baseline task handle each depends on, by position."""
    by_target = {target: request for request, target in requests.values()}
    baseline_remote = ray.remote(max_calls=1, retry_exceptions=False)(baseline_task)
    candidate_remote = ray.remote(max_calls=1, retry_exceptions=False)(candidate_task)

    def submit_baseline(group: BaselineGroup) -> Any:
        options = by_target[group.key].ray_options()
        return baseline_remote.options(**options, max_retries=max_retries, name=f"baseline {group.model.name}").remote(group.model, group.settings)

    baselines: dict[int, Any] = {}

    def submit_candidate(position: int, baseline: Any) -> Any:
        baselines[position] = baseline
        candidate = candidates[position]
        options = by_target[position].ray_options()
        name = f"{candidate.model.name} x {candidate.recipe}"
        return candidate_remote.options(**options, max_retries=max_retries, name=name).remote(candidate, baseline, status_dir)

    return submit_graph(groups, submit_baseline, submit_candidate), baselines


def _collect(
    ray: Any, candidates: list[Candidate], handles: dict[int, Any], baselines: dict[int, Any], ledger: Ledger, max_retries: int,
    status_dir: Path, stop: threading.Event,
) -> dict[int, CandidateResult]:
    """Results as they arrive, each verified, registered and recorded before the next; progress meanwhile."""
    tracker = Tracker({p: candidate_label(p + 1, candidates) for p in handles}, {p: candidates[p].key for p in handles}, status_dir)
    pending = {handle: position for position, handle in handles.items()}
    baseline_handles = list(dict.fromkeys(baselines.values()))
    results: dict[int, CandidateResult] = {}
    last_line = 0.0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        if stop.is_set():
            raise KeyboardInterrupt
        changed = tracker.poll()
        scored, _ = ray.wait(baseline_handles, num_returns=len(baseline_handles), timeout=0)
        if (len(scored), len(baseline_handles)) != tracker.baselines:
            tracker.baselines, changed = (len(scored), len(baseline_handles)), True
        for handle in ready:
            position = pending.pop(handle)
            candidate = candidates[position]
            outcome = _result_of(ray, handle, baselines[position], candidate, tracker.running.get(position), max_retries)
            result = _record(outcome, candidate, ledger)
            tracker.finish(position, result.wall_s)
            progress(f"{tracker.labels[position]}: {decision_line(result)} (node {result.node}, {result.wall_s:.0f} s)")
            results[position] = result
            changed = True
        if changed or time.monotonic() - last_line > PROGRESS_EVERY_S:
            progress(f"job: {tracker.line()}")
            last_line = time.monotonic()
    return results


def _result_of(
    ray: Any, handle: Any, baseline: Any, candidate: Candidate, status: TaskStatus | None, max_retries: int,
) -> CandidateResult:
    """The worker's result; a task's exception (the baseline task's, which its candidates share) or a worker that
    died more than max_retries times, as an error result."""
    common = {"model": candidate.model.name, "recipe": candidate.recipe, "key": candidate.key}
    where = {"node": status.node, "attempts": status.attempt} if status else {}
    try:
        result: CandidateResult = ray.get(handle)
        return result
    except ray.exceptions.RayTaskError as error:  # raised in a task (a candidate task returns its own errors as results)
        failed, task = _baseline_error(ray, baseline) or (error, "candidate task")
        return CandidateResult(**common, **where, status="error", reasons=[f"{task}: {_reason(failed)}"])
    except ray.exceptions.RayError as error:
        reason = f"the worker process died and was retried {max_retries} time(s): {type(error).__name__}: {' '.join(str(error).split())[:300]}"
        return CandidateResult(**common, **where, status="error", reasons=[reason])


def _baseline_error(ray: Any, baseline: Any) -> tuple[Exception, str] | None:
    """The baseline task's own exception when it failed (its candidates then fail without running), else None."""
    try:
        ray.get(baseline, timeout=0)
    except ray.exceptions.RayTaskError as error:
        return error, "baseline task"
    except ray.exceptions.RayError:
        return None
    return None


def _reason(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, QuantGateError):
        return cause.one_line()
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:500]}"


def _record(result: CandidateResult, candidate: Candidate, ledger: Ledger) -> CandidateResult:
    """The driver's write: the artifact verified on the shared store, the run registered, the ledger entry."""
    if result.status != "error" and result.artifact_dir is not None and result.run_dir is not None:
        try:
            check = verify_artifact(Path(result.artifact_dir), manifest_sha256=result.manifest_sha256, fingerprint=result.fingerprint)
            version = None
            if candidate.settings.registry_path is not None:
                version = register_run(Path(result.run_dir), candidate.model, candidate.settings, check)
            result = result.model_copy(update={"registry_version": version, "fingerprint": check.fingerprint})
        except QuantGateError as error:
            result = result.model_copy(update={"status": "error", "reasons": [f"not recorded: the artifact on the shared store: {error.one_line()}"]})
    ledger.record(result)
    return result
