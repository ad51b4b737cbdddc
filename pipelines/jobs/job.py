"""The offline registry job: many (model, recipe) candidates, each through the runner, one summary.

A job file lists candidates; everything in it is validated before any work starts, with every problem
listed at once: the file's fields, each model folder (config.json, safetensors headers), and each recipe
compiled against each model by the same checks `quantize` runs (pipelines.quantize.compiler.compile_recipe), so
a recipe that cannot apply to its model fails the job at plan time, naming the job file, the candidate
and the reason, before any candidate runs.

A candidate (or the job's `defaults`) may name its own calibration data (`calibration:` a folder with
data.jsonl, a JSONL file, a set under eval_sets/, or `from-eval-sets`; docs/calibration.md), checked at
plan time like everything else; without it each recipe calibrates on its own `calibration.dataset`.

Each candidate's inputs (model content, recipe text, eval sets, policy, target, and its calibration data
when it names some) make a key; a ledger
under artifacts/jobs/ records the verdict per key after each candidate completes, so a rerun skips what
was already decided and resumes from the first candidate that was not (an interrupted candidate left
no ledger entry; its artifact and the baseline scores are reused from their caches). A promoted entry
is skipped only after its artifact is verified against what the ledger recorded (manifest.json's own
sha256, and the files' stat fingerprint, re-hashing any file whose stat changed) and, when the registry holds
its version signed, its promotion bundle (pipelines.registry.evidence.verify_promotion); a failed check makes
the candidate an error naming the file (recorded, so the next run redoes it). A ledger that cannot be
read is an error naming it.

`executor: ray` (or `quantize job FILE --executor ray`) runs the same plan on a Ray cluster, one worker
process per candidate (pipelines.jobs.ray); the ledger, the skips and the verdicts are the same.

`objective: size|speed` (or `--objective`) says which of a model's passing candidates wins: the fewest weight bytes,
or the best measured throughput (pipelines.repair.objective); the summary names the winner per model and
artifacts/jobs/<name>/report.md shows both frontiers (pipelines.jobs.report). A `repair: true` candidate's repair
picks its attempt by the same objective.
"""

from __future__ import annotations

import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.artifact import check_model_dir, is_model_dir, verify_artifact
from pipelines.bounds import MAX_CONTEXT, MiB
from pipelines.console.output import progress
from pipelines.errors import InputError, QuantGateError
from pipelines.evaluation import evalsets
from pipelines.evaluation.evalsets import EvalSet, select_eval_sets
from pipelines.files.atomic import write_json_atomic
from pipelines.files.hashing import folder_hash, sha256_file, sha256_json
from pipelines.files.jsonio import parse_json_strict
from pipelines.files.safepath import ensure_inside, safe_component
from pipelines.files.yamlio import load_yaml_model, read_user_bytes
from pipelines.gate.policy import FitRequirement, check_attainable, load_gate_policy
from pipelines.jobs.report import ModelChoice, choose_per_model, write_report
from pipelines.loadtest.results import PerformanceSummary
from pipelines.quantize.calibration import check_calibration_source
from pipelines.quantize.compiler import compile_recipe
from pipelines.quantize.layout import layout_from_model_dir
from pipelines.recipe import FROM_EVAL_SETS, LoadedRecipe, load_recipe
from pipelines.registry.promotion import verify_recorded
from pipelines.repair.compare import measured_bytes
from pipelines.repair.objective import Contender, Objective, QualityBound, quality_bound
from pipelines.repair.pricing import recipe_bytes, shape_of
from pipelines.repair.session import RepairOptions, repair_outcome
from pipelines.runs.runner import GateSettings, RunOutcome, quantize_and_gate
from pipelines.schema import StrictModel
from pipelines.serve.serving import ServeSettings
from pipelines.settings import current as current_settings

MAX_LEDGER_BYTES = 64 * MiB


class CandidateOptions(StrictModel):
    eval_sets: list[str] | None = Field(default=None, description="eval set names; default: every set")
    policy: Path | None = Field(default=None, description="gate policy YAML; default: policies/default.yaml")
    target: FitRequirement | None = Field(default=None, description="the GPU the artifact must fit")
    calibration: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description=f"calibration data instead of each recipe's: a folder with data.jsonl or a JSONL file (relative to the "
                    f"job file), a set under eval_sets/, or {FROM_EVAL_SETS!r} (docs/calibration.md)",
    )
    repair: bool = Field(default=False, description="when the gate rejects a recipe, search for the smallest artifact that passes "
                                                     "(docs/repair.md); the candidate is promoted when the repair finds one")


class CandidateSpec(CandidateOptions):
    model: Path
    recipes: list[str] = Field(min_length=1)


Executor = Literal["local", "ray"]


class JobFile(StrictModel):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    executor: Executor = Field(default="local", description="local: one candidate after another here; ray: a Ray task per "
                                                              "candidate on a cluster (docs/scale-out.md)")
    max_retries: int = Field(default=2, ge=0, le=20, description="ray: times a candidate whose worker process died (killed, "
                                                                  "node lost) is run again; its own errors are never retried")
    registry: Path = Field(default_factory=lambda: current_settings().registry_path)  # $QUANTGATE_REGISTRY as run
    max_model_len: int = Field(default=ServeSettings().max_model_len, gt=0, le=MAX_CONTEXT)
    objective: Objective = Field(default="size", description="which passing candidate wins per model: size (fewest weight bytes) or "
                                                             "speed (best measured throughput ratio); --objective overrides it")
    defaults: CandidateOptions = CandidateOptions()
    candidates: list[CandidateSpec] = Field(min_length=1)


class Candidate(BaseModel):
    """One (model, recipe) unit of work, fully resolved and validated."""

    model_config = ConfigDict(extra="forbid")

    model: Path
    recipe: str  # as the job file names it
    loaded: LoadedRecipe  # parsed once, at plan time: what the candidate quantizes with
    settings: GateSettings
    key: str
    calibration: str | None = None  # resolved: an absolute path, a set name, FROM_EVAL_SETS; None: the recipe's own
    repair: bool = False  # run the repair search when the gate rejects (pipelines.repair)
    objective: Objective = "size"  # what a repair picks among its passing attempts


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
    node: str | None = None  # the machine that ran it (a Ray node's host name under the ray executor)
    attempts: int | None = None  # ray: worker processes it took (more than 1: a process died and Ray retried it)
    # The artifact the verdict is about, and manifest.json's own sha256: what a cached skip verifies.
    artifact_dir: str | None = None
    manifest_sha256: str | None = None
    # stat of the artifact's files when it was last verified (kept in the ledger, not printed).
    fingerprint: dict[str, list[int]] | None = Field(default=None, exclude=True, repr=False)
    # The repair folder (repair.json, report.md) when the candidate was rejected and `repair: true` searched on.
    repair_dir: str | None = None
    # The load test's headline figures (RunOutcome.performance; gate.json has them all); None when it did not run.
    performance: PerformanceSummary | None = None
    # What the objective ranks on (None in ledgers written before it): the artifact's weight bytes (its manifest's
    # measure, else the planner's prediction for the recipe) and the worst set's worsening bound.
    weight_bytes: int | None = None
    quality: QualityBound | None = None

    def contender(self, name: str) -> Contender:
        return Contender(name=name, passed=self.status == "promoted", weight_bytes=self.weight_bytes, quality=self.quality,
                         performance=self.performance)


class JobSummary(BaseModel):
    job: str
    results: list[CandidateResult]
    wall_s: float
    objective: Objective = "size"
    choices: list[ModelChoice] = Field(default=[], description="per model: the winner under the objective, and why")
    report_md: str | None = Field(default=None, description="report.md with both frontiers per model")

    @property
    def exit_code(self) -> int:
        return 2 if any(r.status == "error" for r in self.results) else 0


def load_job(path: Path) -> JobFile:
    return load_yaml_model(path, JobFile, "job")


def _resolve(base: Path, path: Path) -> Path:
    return (path if path.is_absolute() else (base / path)).resolve()


def plan_candidates(job: JobFile, job_path: Path) -> list[Candidate]:
    """Resolve and validate every candidate; raise one error listing every problem found.

    Beyond the file's own fields: each model folder is checked as `quantize` checks it (config.json,
    safetensors headers), its name must be a safe path component (artifacts land under
    candidates/<model name>/), and each recipe is compiled against the model's layout, so a recipe that
    cannot apply to it (a group size that does not divide a layer, a scheme vLLM cannot serve, ...) is
    refused here, before any candidate runs.
    """
    base = job_path.parent
    problems: list[str] = []
    candidates: list[Candidate] = []
    layouts: dict[Path, Any] = {}  # one layout per model folder, however many candidates share it
    discovered: list[EvalSet] | None = None  # the eval sets, discovered (each task YAML parsed) once for every candidate
    try:
        safe_component(job.name, "name", file=job_path)  # the ledger is jobs/<name>.json
    except QuantGateError as error:
        problems.append(f"name: {error.message}")
    for index, spec in enumerate(job.candidates):
        where = f"candidates.{index}"
        found = len(problems)  # every check runs, so one pass over the file reports everything
        settings = None
        try:
            discovered = evalsets.discover_eval_sets() if discovered is None else discovered
            settings = _settings(job, spec, base, discovered)
        except QuantGateError as error:
            problems.append(f"{where}: {error.one_line()}")
        calibration, calibration_hash = _calibration(job, spec, base, settings, where, problems)
        model = _resolve(base, spec.model)
        layout = None
        if not is_model_dir(model):
            problems.append(f"{where}.model: not a model folder (no config.json): {model}")
        else:
            try:
                layout = layouts[model] if model in layouts else layouts.setdefault(model, _model_layout(model, f"{where}.model"))
            except QuantGateError as error:
                problems.append(f"{where}.model: {error.one_line()}")
        recipes: dict[str, LoadedRecipe] = {}
        for recipe in spec.recipes:
            try:
                recipes[recipe] = load_recipe(recipe)
            except QuantGateError as error:
                problems.append(f"{where}.recipes: {error.one_line()}")
                continue
            if layout is not None:
                problem = _cannot_apply(recipes[recipe], layout)
                if problem:
                    problems.append(f"{where} ({model.name} x {recipe}): recipe cannot apply to this model: {problem}")
        if len(problems) == found and settings is not None:  # settings is None only with a problem
            candidates += [
                Candidate(model=model, recipe=recipe, loaded=loaded, settings=settings,
                          key=_key(model, loaded.text, settings, calibration_hash, repair=_repair(job, spec),
                                   objective=job.objective), calibration=calibration, repair=_repair(job, spec), objective=job.objective)
                for recipe, loaded in recipes.items()
            ]
    if problems:
        raise InputError(f"{len(problems)} problem(s): " + " | ".join(problems), file=job_path)
    return candidates


def _model_layout(model: Path, field: str) -> Any:
    """What `quantize` checks of a model before loading it, and its layout for the compiler."""

    safe_component(model.name, field, file=model)
    check_model_dir(model)
    return layout_from_model_dir(model)


def _cannot_apply(recipe: LoadedRecipe, layout: Any) -> str | None:
    """compile_recipe's refusal (the one `quantize` would give after minutes of set-up), or None."""

    try:
        compile_recipe(recipe.recipe, layout, recipe.path)
    except QuantGateError as error:
        return error.one_line()
    return None


def _settings(job: JobFile, spec: CandidateSpec, base: Path, discovered: list[EvalSet]) -> GateSettings:
    merged = {**job.defaults.model_dump(exclude_unset=True), **spec.model_dump(exclude_unset=True)}
    policy_file = merged.get("policy")
    eval_sets = select_eval_sets(merged.get("eval_sets"), discovered)
    policy, policy_path = load_gate_policy(_resolve(base, policy_file) if policy_file is not None else None)
    for recipe in spec.recipes:  # a policy the selected sets cannot meet fails the candidate now, not after quantizing
        check_attainable(policy, eval_sets, recipe, file=policy_path)
    if merged.get("target") is not None:
        policy = policy.model_copy(update={"fit": FitRequirement.model_validate(merged["target"])})
    return GateSettings(
        eval_sets=eval_sets, policy=policy, policy_path=policy_path,
        serve=ServeSettings(max_model_len=job.max_model_len), registry_path=_resolve(base, job.registry),
    )


def _calibration(
    job: JobFile, spec: CandidateSpec, base: Path, settings: GateSettings | None, where: str, problems: list[str],
) -> tuple[str | None, str | None]:
    """The candidate's `calibration:` (its own, else the job's default), resolved and checked now (data found,
    held-out prompts render and none is scored), with its content hash for the ledger key; (None, None) when
    the recipes' own calibration data is used."""
    value = spec.calibration if "calibration" in spec.model_fields_set else job.defaults.calibration
    if value is None:
        return None, None
    if value != FROM_EVAL_SETS and not Path(value).is_absolute() and (base / value).exists():
        value = str((base / value).resolve())  # relative to the job file, like model and policy
    if settings is None:
        return value, None  # the eval sets are unknown: the settings' own problem is already reported

    try:
        return value, check_calibration_source(value, settings.eval_sets)
    except QuantGateError as error:
        problems.append(f"{where}.calibration: {error.one_line()}")
        return value, None


def _repair(job: JobFile, spec: CandidateSpec) -> bool:
    return spec.repair if "repair" in spec.model_fields_set else job.defaults.repair


def _key(model: Path, recipe_text: str, settings: GateSettings, calibration_hash: str | None = None, *, repair: bool = False,
         objective: Objective = "size") -> str:
    inputs: dict[str, Any] = {
        "model": folder_hash(model),
        "recipe": recipe_text,
        "eval_sets": {s.name: s.sha256 for s in settings.eval_sets},
        "policy": sha256_file(settings.policy_path),
        "fit": settings.policy.fit.model_dump() if settings.policy.fit else None,
        "serve": settings.serve.cache_fields(),
    }
    if calibration_hash is not None:  # absent otherwise: ledgers written before `calibration:` keep their keys
        inputs["calibration"] = calibration_hash
    if repair:  # absent otherwise, likewise: a repaired verdict is not the plain one
        inputs["repair"] = True
        if objective != "size":  # a repair by speed may find another attempt than by size
            inputs["objective"] = objective
    return sha256_json(inputs)


class Ledger:
    """Verdicts per candidate key, rewritten atomically after each candidate."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, CandidateResult] = {}
        if path.exists():
            self.entries = self._read()

    def _read(self) -> dict[str, CandidateResult]:
        """The ledger's entries; anything malformed is an InputError naming the file (and what to do)."""
        advice = "; fix or delete it (a deleted ledger re-runs every candidate, reusing cached artifacts and scores)"
        raw = read_user_bytes(self.path, what="job ledger", max_bytes=MAX_LEDGER_BYTES)
        try:
            data = parse_json_strict(raw, self.path)
        except InputError as error:
            raise InputError(f"corrupt job ledger: {error.message}{advice}", file=self.path) from None
        decided = data.get("decided") if isinstance(data, dict) else None
        if not isinstance(decided, dict):
            raise InputError(f"corrupt job ledger: needs an object with a 'decided' object{advice}", file=self.path)
        entries = {}
        for key, value in decided.items():
            try:
                entries[key] = CandidateResult.model_validate(value)
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                raise InputError(f"corrupt job ledger: decided.{key[:12]}...{'.' + where if where else ''}: {first['msg']}{advice}",
                                 file=self.path) from None
        return entries

    def decided(self, key: str) -> CandidateResult | None:
        entry = self.entries.get(key)
        return entry if entry is not None and entry.status != "error" else None

    def record(self, result: CandidateResult) -> None:
        self.entries[result.key] = result
        write_json_atomic(
            self.path,
            {"updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "decided": {key: {**entry.model_dump(mode="json"), "fingerprint": entry.fingerprint}
                         for key, entry in self.entries.items()}},
        )


def default_jobs_dir() -> Path:
    """`$QUANTGATE_ARTIFACTS/jobs` as the environment says now (not only when this module was imported)."""
    return current_settings().jobs_dir


class PlannedJob(NamedTuple):
    """A job file parsed, every candidate planned and validated, and its ledger opened: what an executor runs."""

    job: JobFile
    path: Path
    candidates: list[Candidate]
    ledger: Ledger


def plan_job(job_path: Path, *, jobs_dir: Path | None = None, objective: Objective | None = None) -> PlannedJob:
    """`objective`: --objective, which overrides the job file's."""
    jobs_dir = default_jobs_dir() if jobs_dir is None else jobs_dir
    job = load_job(job_path)
    if objective is not None:
        job = job.model_copy(update={"objective": objective})
    candidates = plan_candidates(job, job_path)
    ledger = Ledger(ensure_inside(jobs_dir, jobs_dir / f"{safe_component(job.name, 'name', file=job_path)}.json", "name"))
    return PlannedJob(job, job_path, candidates, ledger)


def run_job(job_path: Path, *, jobs_dir: Path | None = None, objective: Objective | None = None) -> JobSummary:
    """Every candidate of the job file, one after another on this machine (the local executor)."""
    return run_locally(plan_job(job_path, jobs_dir=jobs_dir, objective=objective))


def run_locally(planned: PlannedJob) -> JobSummary:
    candidates, ledger = planned.candidates, planned.ledger
    started = time.monotonic()
    results = []
    for number, candidate in enumerate(candidates, start=1):
        label = candidate_label(number, candidates)
        cached = cached_result(ledger, candidate, label, left=len(candidates) - number)
        if cached is not None:
            results.append(cached)
            continue
        progress(f"{label}: running ({len(candidates) - number} left after this one)")
        result = run_candidate(candidate).model_copy(update={"node": platform.node()})
        ledger.record(result)
        progress(f"{label}: {decision_line(result)}")
        results.append(result)
    return summarize(planned, results, round(time.monotonic() - started, 1))


def summarize(planned: PlannedJob, results: list[CandidateResult], wall_s: float) -> JobSummary:
    """The job's summary (either executor): its results, the winner per model under the objective, report.md."""
    objective = planned.job.objective
    named = _named(results)
    by_model = {model: [result.contender(name) for name, result in decided.items()] for model, decided in named.items()}
    choices = [entry.model_copy(update={"registry_version": named[entry.model][entry.choice.winner].registry_version})
               if entry.choice.winner else entry for entry in choose_per_model(by_model, objective)]
    path, choices = write_report(planned.job.name, objective, choices, planned.ledger.path.with_suffix(""))
    for entry in choices:
        progress(f"{entry.model}: {' '.join(entry.choice.notes)}")
    return JobSummary(job=planned.job.name, results=results, wall_s=wall_s, objective=objective, choices=choices, report_md=str(path))


def _named(results: list[CandidateResult]) -> dict[str, dict[str, CandidateResult]]:
    """Per model, its decided results in size order (equal bytes in the job file's order, no bytes last) by name: its
    recipe ("(repaired)" when a repair found it; a recipe named twice is numbered)."""
    named: dict[str, dict[str, CandidateResult]] = {}
    ordered = sorted((r for r in results if r.status != "error"), key=lambda r: (r.weight_bytes is None, r.weight_bytes or 0))
    for result in ordered:
        decided = named.setdefault(result.model, {})
        name = result.recipe + (" (repaired)" if result.repair_dir else "")
        number = sum(1 for known in decided if known == name or known.startswith(f"{name} #")) + 1
        decided[name if number == 1 else f"{name} #{number}"] = result
    return named


def candidate_label(number: int, candidates: list[Candidate]) -> str:
    candidate = candidates[number - 1]
    return f"[{number}/{len(candidates)}] {candidate.model.name} x {candidate.recipe}"


def decision_line(result: CandidateResult) -> str:
    return result.status + (f" ({'; '.join(result.reasons)})" if result.reasons else "")


def cached_result(ledger: Ledger, candidate: Candidate, label: str, *, left: int) -> CandidateResult | None:
    """The candidate's result without running it, when the ledger has decided it with the same inputs (its
    artifact verified), or an error when that artifact failed its check (recorded); None: it must run."""
    previous = ledger.decided(candidate.key)
    if previous is None:
        return None
    refused = _verify_cached(previous, candidate.settings.registry_path)
    if refused is None:
        progress(f"{label}: already {previous.status} with the same inputs, artifact verified; skipped ({left} left)")
        return previous.model_copy(update={"skipped": True})
    if isinstance(refused, CandidateResult):  # the cached artifact failed its check: an error, not a skip
        ledger.record(refused)
        progress(f"{label}: error ({'; '.join(refused.reasons)})")
        return refused
    progress(f"{label}: the ledger entry does not say which artifact it promoted ({refused}); running it again")
    return None


def _verify_cached(previous: CandidateResult, registry_path: Path | None = None) -> CandidateResult | str | None:
    """None when the decided entry can be skipped; an error result naming the bad file when a promoted
    entry's artifact is no longer what was judged; a reason (str) when a promoted entry records no
    artifact (an older ledger: run it again). A rejection stands whatever became of its artifact (it
    may have been deleted to save space): nothing is served on its strength."""
    if previous.status != "promoted":
        return None
    if previous.artifact_dir is None or previous.manifest_sha256 is None:
        return "no artifact recorded"
    try:
        verify_artifact(Path(previous.artifact_dir), manifest_sha256=previous.manifest_sha256, fingerprint=previous.fingerprint)
        if registry_path is not None and previous.registry_version is not None:  # and its signed promotion bundle

            verify_recorded(registry_path, previous.model, previous.registry_version)
    except QuantGateError as error:
        return previous.model_copy(update={
            "status": "error", "skipped": False, "wall_s": 0.0,
            "reasons": [f"cached {previous.status} verdict not trusted: {error.one_line()}"],
        })
    return None


def run_candidate(candidate: Candidate) -> CandidateResult:
    """Quantize, gate (and repair) one candidate; registered when its settings name a registry (a Ray worker's
    do not: the driver registers). Its own errors become an error result, never an exception."""
    started = time.monotonic()
    common = {"model": candidate.model.name, "recipe": candidate.recipe, "key": candidate.key}
    try:
        extra: dict[str, Any] = {} if candidate.calibration is None else {"calibration": candidate.calibration}
        outcome = quantize_and_gate(candidate.loaded, candidate.model, candidate.settings, **extra)
        repair_dir = None
        if candidate.repair and outcome.verdict == "rejected":

            outcome, repaired = repair_outcome(outcome, candidate.settings, candidate.calibration, RepairOptions(objective=candidate.objective))
            repair_dir = repaired.repair_dir
        # What the ledger will vouch for on a later skip: the artifact as the run last verified it.
        check = verify_artifact(outcome.artifact_dir, manifest_sha256=outcome.manifest_sha256, fingerprint=outcome.artifact_fingerprint)
    except QuantGateError as error:
        return CandidateResult(**common, status="error", reasons=[error.one_line()], wall_s=round(time.monotonic() - started, 1))
    except Exception as error:
        return CandidateResult(**common, status="error", reasons=[f"{type(error).__name__}: {error}"], wall_s=round(time.monotonic() - started, 1))
    return CandidateResult(
        **common, status=outcome.verdict, reasons=outcome.reasons, run_dir=str(outcome.run_dir),
        registry_version=outcome.registry_version, wall_s=round(time.monotonic() - started, 1),
        artifact_dir=str(outcome.artifact_dir), manifest_sha256=check.manifest_sha256, fingerprint=check.fingerprint,
        repair_dir=repair_dir, performance=outcome.performance, weight_bytes=_weight_bytes(candidate, outcome, repaired=repair_dir is not None),
        quality=_quality(outcome),
    )


def _weight_bytes(candidate: Candidate, outcome: RunOutcome, *, repaired: bool) -> int | None:
    """The artifact's weight bytes as its manifest measured them, else the planner's prediction for the candidate's recipe
    (not for a repaired one: its recipe is the repair's)."""
    measured = measured_bytes(outcome.artifact_dir)
    if measured is not None or repaired:
        return measured
    return recipe_bytes(shape_of(candidate.model), candidate.loaded.recipe)


def _quality(outcome: RunOutcome) -> QualityBound | None:
    """The worst set's worsening bound from the run's gate.json (None when the run left none to read)."""
    if outcome.report is None and not outcome.gate_json.is_file():
        return None
    return quality_bound(outcome.gate_report())
