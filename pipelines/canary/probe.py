"""Probe a running server with a golden set: every golden prompt asked again, each answer compared with the recorded one
under the recorded tolerance (pipelines.canary.compare). Used by `watch` once per window and by the fleet's health check.

Nothing raises: a server that cannot be reached, answers an error or not in time gives healthy=False with the reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import Field

from pipelines.canary.client import ProbeFailure, ask_all
from pipelines.canary.compare import PromptCheck, distance, judge
from pipelines.canary.golden import GoldenSet
from pipelines.schema import StrictModel

_LISTED = 8  # prompt ids named in a summary line at most
T = TypeVar("T")


class CanaryResult(StrictModel):
    healthy: bool
    disagreeing: list[str] = Field(default_factory=list, description="ids of the golden prompts that disagree beyond tolerance")
    answered: int = Field(ge=0)
    total: int = Field(ge=0)
    tolerated: int = Field(ge=0, description="disagreeing prompts the tolerance allows")
    wall_s: float = Field(ge=0)
    error: str | None = None
    checks: list[PromptCheck] = Field(default_factory=list)

    def summary(self) -> str:
        if self.error is not None:
            return f"canary probe failed ({self.answered} of {self.total} golden prompts answered): {self.error}"
        if not self.disagreeing:
            return f"{self.total} of {self.total} golden prompts agree within tolerance"
        listed = ", ".join(self.disagreeing[:_LISTED]) + (", ..." if len(self.disagreeing) > _LISTED else "")
        allowed = f" ({self.tolerated} tolerated)" if self.tolerated else ""
        return f"{len(self.disagreeing)} of {self.total} golden prompts disagree beyond tolerance{allowed}: {listed}"


def probe_canary(base_url: str, *, model: str, golden: GoldenSet, api_key: str | None, timeout_s: float) -> CanaryResult:
    """Ask `base_url` (a server's base URL, http://HOST:PORT, with or without /v1) every golden prompt as `model`."""
    started = time.monotonic()
    try:
        answers = _run(ask_all(base_url, model=model, prompts=[p.prompt_ids for p in golden.prompts], settings=golden.settings,
                               api_key=api_key, timeout_s=timeout_s, concurrency=golden.settings.concurrency))
    except (OSError, ValueError) as problem:  # a URL httpx cannot use
        answers = [ProbeFailure(f"{type(problem).__name__}: {problem}")] * len(golden.prompts)
    checks = [judge(distance(prompt, answer[0], golden.settings.top_k), golden.tolerance)
              for prompt, answer in zip(golden.prompts, answers, strict=True) if not isinstance(answer, ProbeFailure)]
    failures = [answer for answer in answers if isinstance(answer, ProbeFailure)]
    disagreeing = [check.id for check in checks if check.disagrees]
    error = f"{len(failures)} request(s) failed; first: {failures[0]}" if failures else None
    return CanaryResult(
        healthy=error is None and len(disagreeing) <= golden.tolerance.max_disagreeing, disagreeing=disagreeing, answered=len(checks),
        total=len(golden.prompts), tolerated=golden.tolerance.max_disagreeing, wall_s=round(time.monotonic() - started, 3), error=error,
        checks=checks,
    )


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    """The coroutine's result from synchronous code, also when the caller's thread already runs an event loop (there
    asyncio.run refuses): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="canary-probe") as pool:
        return pool.submit(asyncio.run, coroutine).result()
