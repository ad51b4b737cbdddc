"""Rollback on a sustained breach (`quantize watch --rollback-after N`, opt-in).

After N consecutive windows breach the envelope, the alias moves to the newest earlier version of its stack that verifies
in full: promoted, its artifact against its manifest, and its signed promotion bundle (signature with the recorded, trusted
key; every file; evidence that says promoted). A version that fails any check (or was promoted before signing) is skipped
and named; none is ever moved to. The move is the registry's own rollback (one transaction, verified again under its
lock), recorded as an `alias_rollback` event whose evidence names the breaching windows, their figures and limits, and the
versions skipped with why.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pipelines.deploy.spec import ServedSpec
from pipelines.errors import InputError
from pipelines.registry.mirror import mirror_after
from pipelines.registry.store import Registry
from pipelines.schema import StrictModel


class Skipped(StrictModel):
    version: int
    why: str


class RollbackResult(StrictModel):
    moved: bool
    model: str
    alias: str
    from_version: int
    to_version: int | None = None
    reason: str
    skipped: list[Skipped] = Field(default_factory=list)
    breached_windows: list[int]


def roll_back(registry: Registry, spec: ServedSpec, windows: list[dict[str, Any]], *, url: str) -> RollbackResult:
    """Move spec.alias to the newest earlier version that verifies; `windows`: the breaching windows' evidence."""
    assert spec.alias is not None  # the command refuses --rollback-after without NAME@ALIAS
    indexes = [window["index"] for window in windows]
    figures = sorted({figure for window in windows for figure in window["breached"]})
    reason = (f"quantize watch: {len(windows)} consecutive window(s) of {url} breached the envelope of v{spec.version} "
              f"({', '.join(figures)})")
    stack = registry.alias_stack(spec.model, spec.alias)
    current = stack[0]
    skipped: list[Skipped] = []
    for number in _earlier(stack):
        evidence = {"by": "quantize watch", "url": url, "watched_version": spec.version, "breached_windows": windows,
                    "skipped": [item.model_dump() for item in skipped]}
        target = None
        try:  # the registry's rollback is the one check: promoted, artifact, signed bundle (each hashed once)
            why = _status_why_not(registry, spec.model, number)
            target = registry.rollback(spec.model, spec.alias, reason, to_version=number, evidence=evidence,
                                       require_signature=True) if why is None else None
        except InputError as error:
            why = error.one_line()
        if target is None:
            skipped.append(Skipped(version=number, why=why or "not verified"))
            continue
        mirror_after(registry, spec.model)  # after the move: a mirror failure never undoes it
        return RollbackResult(moved=True, model=spec.model, alias=spec.alias, from_version=current, to_version=target.version, reason=reason,
                              skipped=skipped, breached_windows=indexes)
    return RollbackResult(moved=False, model=spec.model, alias=spec.alias, from_version=current, reason=reason + "; no earlier version "
                          "verifies, the alias stays", skipped=skipped, breached_windows=indexes)


def _earlier(stack: list[int]) -> list[int]:
    """Earlier targets, newest first, each once, never the current one."""
    seen = {stack[0]}
    ordered = []
    for number in stack[1:]:
        if number not in seen:
            seen.add(number)
            ordered.append(number)
    return ordered


def _status_why_not(registry: Registry, model: str, number: int) -> str | None:
    """Why version `number` cannot be rolled back to by its status alone (None: promoted; its files are the rollback's to check)."""
    version = registry.show(model, number)
    return f"its status is {version.status}" if version.status != "promoted" else None
