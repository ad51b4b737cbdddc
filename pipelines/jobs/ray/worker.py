"""What runs inside a Ray worker process: the baseline task and the candidate task, as plain functions (the
driver wraps them with `ray.remote`, one process per task).

One writer: a worker gates with no registry (`registry_path=None`) and never opens the ledger; it returns
its result and the driver, after verifying the artifact on the shared store, records and registers it. A
worker writes only what a local run writes (artifacts, run folders, cached scores) plus one status file,
`<jobs>/<job>.tasks/<key>.json` (host, pid, attempt, start), from which the driver shows where each
candidate runs and counts the attempts Ray made after a worker died.

vLLM servers started here live in their own process group with a watchdog tied to this process
(pipelines.serve.reclaim), so a worker killed by Ray or by a signal takes its servers with it.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from pipelines.files.atomic import write_json_atomic
from pipelines.jobs.job import Candidate, CandidateResult, run_candidate
from pipelines.runs.runner import GateSettings, score_baseline
from pipelines.schema import StrictModel

# "1" when the driver's own environment set OMP_NUM_THREADS (then the workers keep it: it came from the driver).
DRIVER_SET_THREADS = "QUANTGATE_DRIVER_SET_OMP_NUM_THREADS"


class TaskStatus(StrictModel):
    node: str
    pid: int
    attempt: int
    started_at: float  # epoch seconds


class BaselineDone(StrictModel):
    """A baseline task's result: the sets it had to score (empty: all were cached), where, how long."""

    node: str
    scored: list[str]
    wall_s: float


def status_path(status_dir: Path, key: str) -> Path:
    return status_dir / f"{key}.json"


def read_status(path: Path) -> TaskStatus | None:
    try:
        return TaskStatus.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def mark_running(status_dir: Path, key: str) -> TaskStatus:
    """Say this process now runs candidate `key`; the attempt counts the processes that started it."""
    path = status_path(status_dir, key)
    previous = read_status(path)
    status = TaskStatus(node=platform.node(), pid=os.getpid(), attempt=1 if previous is None else previous.attempt + 1,
                        started_at=time.time())
    write_json_atomic(path, status.model_dump())
    return status


def without_registry(candidate: Candidate) -> Candidate:
    """The candidate as a worker runs it: gated, never registered (the driver is the registry's only writer)."""
    return candidate.model_copy(update={"settings": candidate.settings.model_copy(update={"registry_path": None})})


def candidate_task(candidate: Candidate, baseline: BaselineDone, status_dir: Path) -> CandidateResult:
    """Quantize, serve, score and judge one candidate; its result, unregistered. `baseline` is the result of the
    baseline task it depends on (its scores are in the shared cache by now)."""
    _stdout_to_stderr()
    _node_threads()
    status = mark_running(status_dir, candidate.key)
    result = run_candidate(without_registry(candidate))
    return result.model_copy(update={"node": status.node, "attempts": status.attempt, "registry_version": None})


def baseline_task(model_dir: Path, settings: GateSettings) -> BaselineDone:
    """Score and cache the 16-bit baseline of one group (nothing when it is cached)."""
    _stdout_to_stderr()
    _node_threads()
    started = time.monotonic()
    scored = score_baseline(model_dir, settings.model_copy(update={"registry_path": None}))
    return BaselineDone(node=platform.node(), scored=scored, wall_s=round(time.monotonic() - started, 1))


def _node_threads() -> None:
    """Ray sets OMP_NUM_THREADS to a task's num_cpus in its workers. GPTQ and SmoothQuant sum in a thread-count-
    dependent order (pipelines/artifact.py), so unless the driver set it itself, a worker computes with the node's
    default thread count, as a local run there would: the same artifact hashes as the local executor."""
    if os.environ.get(DRIVER_SET_THREADS) != "1":
        os.environ.pop("OMP_NUM_THREADS", None)


def _stdout_to_stderr() -> None:
    """Ray forwards a worker's stdout to the driver's stdout, which `--json` keeps for the summary alone: this
    process (one per task) sends its output, and its children's, to stderr instead."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
