"""The offline registry job: many (model, recipe) candidates, each through the runner, one summary.

A job file lists candidates; everything in it is validated before any work starts, with every problem
listed at once. Each candidate's inputs (model content, recipe text, eval sets, policy, target) make a
key; a ledger under artifacts/jobs/ records the verdict per key after each candidate completes, so a rerun
skips what was already decided and resumes from the first candidate that was not (an interrupted
candidate left no ledger entry; its artifact and the baseline scores are reused from their caches).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipelines.atomic import write_json_atomic
from pipelines.errors import InputError, QuantGateError
from pipelines.hashing import folder_hash, sha256_file, sha256_json
from pipelines.output import progress
from pipelines.paths import ARTIFACTS_DIR
from pipelines.policy import FitRequirement
from pipelines.recipe import load_recipe
from pipelines.runner import GateSettings, load_gate_policy, quantize_and_gate, select_eval_sets
from pipelines.serving import ServeSettings
from pipelines.yamlio import load_yaml_model

JOBS_DIR = ARTIFACTS_DIR / "jobs"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CandidateOptions(_Strict):
    eval_sets: list[str] | None = Field(default=None, description="eval set names; default: every set")
    policy: Path | None = Field(default=None, description="gate policy YAML; default: policies/default.yaml")
    target: FitRequirement | None = Field(default=None, description="the GPU the artifact must fit")


class CandidateSpec(CandidateOptions):
    model: Path
    recipes: list[str] = Field(min_length=1)


class JobFile(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    registry: Path = ARTIFACTS_DIR / "registry.db"
    max_model_len: int = Field(default=ServeSettings().max_model_len, gt=0)
    defaults: CandidateOptions = CandidateOptions()
    candidates: list[CandidateSpec] = Field(min_length=1)


class Candidate(BaseModel):
    """One (model, recipe) unit of work, fully resolved and validated."""

    model_config = ConfigDict(extra="forbid")

    model: Path
    recipe: str
    settings: GateSettings
    key: str


class CandidateResult(BaseModel):
    model: str
    recipe: str
    status: Literal["promoted", "rejected", "error"]
    reasons: list[str] = []
    run_dir: str | None = None
    registry_version: int | None = None
    wall_s: float = 0.0
    skipped: bool = False
    key: str


class JobSummary(BaseModel):
    job: str
    results: list[CandidateResult]
    wall_s: float

    @property
    def exit_code(self) -> int:
        return 2 if any(r.status == "error" for r in self.results) else 0


def load_job(path: Path) -> JobFile:
    return load_yaml_model(path, JobFile, "job")


def _resolve(base: Path, path: Path | None) -> Path | None:
    return None if path is None else (path if path.is_absolute() else (base / path)).resolve()


def plan_candidates(job: JobFile, job_path: Path) -> list[Candidate]:
    """Resolve and validate every candidate; raise one error listing every problem found."""
    base = job_path.parent
    problems: list[str] = []
    candidates: list[Candidate] = []
    for index, spec in enumerate(job.candidates):
        where = f"candidates.{index}"
        found = len(problems)  # every check runs, so one pass over the file reports everything
        settings = None
        try:
            settings = _settings(job, spec, base)
        except QuantGateError as error:
            problems.append(f"{where}: {error.one_line()}")
        model = _resolve(base, spec.model)
        if not (model / "config.json").is_file():
            problems.append(f"{where}.model: not a model folder (no config.json): {model}")
        recipes = {}
        for recipe in spec.recipes:
            try:
                recipes[recipe] = load_recipe(recipe)[2]
            except QuantGateError as error:
                problems.append(f"{where}.recipes: {error.one_line()}")
        if len(problems) == found:
            candidates += [
                Candidate(model=model, recipe=recipe, settings=settings, key=_key(model, text, settings))
                for recipe, text in recipes.items()
            ]
    if problems:
        raise InputError(f"{len(problems)} problem(s): " + " | ".join(problems), file=job_path)
    return candidates


def _settings(job: JobFile, spec: CandidateSpec, base: Path) -> GateSettings:
    merged = {**job.defaults.model_dump(exclude_unset=True), **spec.model_dump(exclude_unset=True)}
    policy, policy_path = load_gate_policy(_resolve(base, merged.get("policy")))
    if merged.get("target") is not None:
        policy = policy.model_copy(update={"fit": FitRequirement.model_validate(merged["target"])})
    return GateSettings(
        eval_sets=select_eval_sets(merged.get("eval_sets")), policy=policy, policy_path=policy_path,
        serve=ServeSettings(max_model_len=job.max_model_len), registry_path=_resolve(base, job.registry),
    )


def _key(model: Path, recipe_text: str, settings: GateSettings) -> str:
    return sha256_json(
        {
            "model": folder_hash(model),
            "recipe": recipe_text,
            "eval_sets": {s.name: s.sha256 for s in settings.eval_sets},
            "policy": sha256_file(settings.policy_path),
            "fit": settings.policy.fit.model_dump() if settings.policy.fit else None,
            "serve": settings.serve.cache_fields(),
        }
    )


class Ledger:
    """Verdicts per candidate key, rewritten atomically after each candidate."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, CandidateResult] = {}
        if path.is_file():
            raw = json.loads(path.read_text())
            self.entries = {key: CandidateResult.model_validate(value) for key, value in raw.get("decided", {}).items()}

    def decided(self, key: str) -> CandidateResult | None:
        entry = self.entries.get(key)
        return entry if entry is not None and entry.status != "error" else None

    def record(self, result: CandidateResult) -> None:
        self.entries[result.key] = result
        write_json_atomic(
            self.path,
            {"updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "decided": {key: entry.model_dump(mode="json") for key, entry in self.entries.items()}},
        )


def run_job(job_path: Path, *, jobs_dir: Path = JOBS_DIR) -> JobSummary:
    job = load_job(job_path)
    candidates = plan_candidates(job, job_path)
    ledger = Ledger(jobs_dir / f"{job.name}.json")
    started = time.monotonic()
    results = []
    for number, candidate in enumerate(candidates, start=1):
        label = f"[{number}/{len(candidates)}] {candidate.model.name} x {candidate.recipe}"
        previous = ledger.decided(candidate.key)
        if previous is not None:
            progress(f"{label}: already {previous.status} with the same inputs; skipped ({len(candidates) - number} left)")
            results.append(previous.model_copy(update={"skipped": True}))
            continue
        progress(f"{label}: running ({len(candidates) - number} left after this one)")
        result = _run_candidate(candidate)
        ledger.record(result)
        progress(f"{label}: {result.status}" + (f" ({'; '.join(result.reasons)})" if result.reasons else ""))
        results.append(result)
    return JobSummary(job=job.name, results=results, wall_s=round(time.monotonic() - started, 1))


def _run_candidate(candidate: Candidate) -> CandidateResult:
    started = time.monotonic()
    common = {"model": candidate.model.name, "recipe": candidate.recipe, "key": candidate.key}
    try:
        outcome = quantize_and_gate(candidate.recipe, candidate.model, candidate.settings)
    except QuantGateError as error:
        return CandidateResult(**common, status="error", reasons=[error.one_line()], wall_s=round(time.monotonic() - started, 1))
    except Exception as error:  # noqa: BLE001 - a crashing candidate must not stop the job
        return CandidateResult(**common, status="error", reasons=[f"{type(error).__name__}: {error}"], wall_s=round(time.monotonic() - started, 1))
    return CandidateResult(
        **common, status=outcome.verdict, reasons=outcome.reasons, run_dir=str(outcome.run_dir),
        registry_version=outcome.registry_version, wall_s=round(time.monotonic() - started, 1),
    )
