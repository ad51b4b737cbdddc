"""The job as a Ray task graph: one baseline task per (model, eval sets, policy, serve settings), then each
candidate as a task that depends on its group's baseline task, so no two workers ever score the same baseline
and no candidate starts before its baseline's scores are in the shared cache.

Building the graph is plain data (`baseline_groups`); `submit_graph` hands it to the two submit functions
the driver gives it (Ray's `.remote` calls), passing each candidate its baseline task's handle: Ray schedules
a task only once the tasks whose results it takes as arguments have finished.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict

from pipelines.files.hashing import sha256_file, sha256_json
from pipelines.jobs.job import Candidate
from pipelines.runs.runner import GateSettings

Handle = TypeVar("Handle")


class BaselineGroup(BaseModel):
    """The candidates that share one 16-bit baseline: same model, eval sets, policy and serve settings."""

    model_config = ConfigDict(extra="forbid")

    key: str
    model: Path
    settings: GateSettings
    members: list[int]  # positions in the job's candidate list


def baseline_key(candidate: Candidate) -> str:
    settings = candidate.settings
    return sha256_json({
        "model": str(candidate.model),
        "eval_sets": {s.name: s.sha256 for s in settings.eval_sets},
        "policy": sha256_file(settings.policy_path),
        "serve": settings.serve.cache_fields(),
    })


def baseline_groups(candidates: list[Candidate], positions: list[int] | None = None) -> list[BaselineGroup]:
    """One group per distinct baseline among `candidates` (those at `positions`, default all), in job order."""
    groups: dict[str, BaselineGroup] = {}
    for position in range(len(candidates)) if positions is None else positions:
        candidate = candidates[position]
        key = baseline_key(candidate)
        if key not in groups:
            groups[key] = BaselineGroup(key=key, model=candidate.model, settings=candidate.settings, members=[])
        groups[key].members.append(position)
    return list(groups.values())


def submit_graph(
    groups: list[BaselineGroup],
    submit_baseline: Callable[[BaselineGroup], Handle],
    submit_candidate: Callable[[int, Handle], Handle],
) -> dict[int, Handle]:
    """Submit every group's baseline task, then its candidates with that task's handle; candidate handles by position."""
    handles: dict[int, Handle] = {}
    for group in groups:
        baseline = submit_baseline(group)
        for position in group.members:
            handles[position] = submit_candidate(position, baseline)
    return handles
