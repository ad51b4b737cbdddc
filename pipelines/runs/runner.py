"""The job: quantize -> serve -> score against the 16-bit baseline -> gate -> promote, with evidence.

Every run gets a folder under artifacts/runs/: it is assembled in a hidden staging folder and renamed
into place when complete (gate.json, report.md, server and lm-eval logs, per-sample results). A run that
fails is renamed to `<run id>-error` with error.txt beside its logs, so the evidence of a failure is kept
but can never be mistaken for a verdict. The registry is written last, and only from a complete run.

Before anything is served the artifact is verified against its manifest.json (every file's sha256) and
again, cheaply (manifest hash, stat of each file), before gate.json is written and when registering. An
artifact without a manifest is refused unless the job allows it (`quantize gate --allow-unverified`):
then it is gated and reported as unverified, and never written to the registry.

A disk that is full or read-only ends the run as a StorageError (exit 2) naming the original errno and
path; error.txt is written if the disk still allows it, and the staging folder is renamed to
`<run id>-error` or, failing that, removed. Staging folders of runs that died are reclaimed at the start
of the next run (pipelines.serve.reclaim).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipelines.artifact import (
    CONFIG_NAME,
    ArtifactCheck,
    require_model_dir,
    served_kv_cache_dtype,
    verify_artifact,
    verify_before_serving,
)
from pipelines.canary.build import sources_of
from pipelines.canary.golden import GOLDEN_FILE
from pipelines.console.output import progress
from pipelines.errors import InputError
from pipelines.evaluation import baseline as baseline_cache
from pipelines.evaluation.divergence import KL_METHOD, item_kl
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import ANSWER_RESERVE_TOKENS, ScoringDeadline, SetScore, materialize_tasks
from pipelines.files.atomic import write_json_atomic, write_text_atomic
from pipelines.files.hashing import folder_hash, sha256_file, sha256_text
from pipelines.files.safepath import safe_component
from pipelines.gate.floor import refuse_below_floor
from pipelines.gate.pairing import pair_set
from pipelines.gate.policy import Policy
from pipelines.gate.report import render_markdown, with_unverified_note
from pipelines.gate.schema import FitCheck, GateReport, load_report
from pipelines.gate.verdict import SetComparison, decide
from pipelines.hardware.host import host_profile
from pipelines.hardware.probe_rules import kv_probe_problem, probe_problem
from pipelines.hardware.runtime import runtime_here
from pipelines.hardware.speed import artifact_cases, estimate_scoring, probed_speed
from pipelines.hardware.targets import host_record, installed_target
from pipelines.loadtest.gate_hook import ServerPool, server_pool, stage_inputs
from pipelines.loadtest.render import summary as performance_summary
from pipelines.loadtest.results import PerformanceSummary
from pipelines.planner.shape import load_config, model_shape
from pipelines.recipe import LoadedRecipe, RecipeIdentity, identity_from_text
from pipelines.registry.evidence import EVIDENCE_DIR, write_run_evidence
from pipelines.registry.mirror import mirror_after
from pipelines.registry.promotion import promote_signed
from pipelines.registry.signing import load_signer
from pipelines.registry.store import EvalSetRef, NewVersion, Registry
from pipelines.reports.run_page import render_run_page
from pipelines.runs.runfolder import run_folder
from pipelines.runs.stack import REAL_STACK, GateStack
from pipelines.serve.serving import RunningServer, ServeSettings
from pipelines.settings import current as current_settings

# What every run drives unless it is handed another stack (tests hand it a fake: tests/fakes.py).
STACK: GateStack = REAL_STACK


def default_runs_dir() -> Path:
    """`$QUANTGATE_ARTIFACTS/runs` as the environment says now (not only when this module was imported)."""
    return current_settings().runs_dir


class RunOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verdict: Literal["promoted", "rejected"]
    exit_code: int
    run_dir: Path
    gate_json: Path
    report_md: Path
    artifact_dir: Path
    registry_version: int | None = None
    reasons: list[str]
    stages: dict[str, float]
    # False when the artifact had no manifest.json (gated with allow_unverified; never registered).
    verified: bool = True
    manifest_sha256: str | None = None
    # stat of the artifact's files at the run's last verification (for the job ledger; not printed).
    artifact_fingerprint: dict[str, list[int]] | None = Field(default=None, exclude=True, repr=False)
    # The load test's headline figures (gate.json's `performance` holds them all); None when it did not run.
    performance: PerformanceSummary | None = None
    # gate.json as the run wrote it (not printed: --json prints the fields above, gate.json holds the rest).
    report: GateReport | None = Field(default=None, exclude=True, repr=False)

    def gate_report(self) -> GateReport:
        """The gate.json this outcome points at: the run's own report, else (an outcome made elsewhere) read from gate_json."""
        return self.report if self.report is not None else load_report(self.gate_json)


class GateSettings(BaseModel):
    """What a gate run is judged on and where it writes: the same for every candidate of a job."""

    model_config = ConfigDict(extra="forbid")

    eval_sets: list[EvalSet]
    policy: Policy
    policy_path: Path
    serve: ServeSettings = ServeSettings()
    registry_path: Path | None = None
    runs_dir: Path = Field(default_factory=default_runs_dir)
    cache_dir: Path = Field(default_factory=lambda: current_settings().baseline_cache_dir)
    loadtest: bool = True  # False: --no-loadtest (the policy's performance.enabled can also turn it off)


class GateJob(BaseModel):
    """One gate run: an artifact against its 16-bit baseline under `settings`."""

    model_config = ConfigDict(extra="forbid")

    artifact_dir: Path
    baseline_dir: Path
    recipe_name: str
    settings: GateSettings
    stages: dict[str, float] = {}
    inputs: dict = {}
    # Gate an artifact without manifest.json (nothing to verify it against); it is never registered.
    allow_unverified: bool = False


@contextmanager
def timed(stages: dict[str, float], name: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        stages[name] = round(stages.get(name, 0.0) + time.monotonic() - started, 2)


def quantize_and_gate(
    recipe: str | LoadedRecipe, model_dir: Path, settings: GateSettings, *, force: bool = False, calibration: str | None = None,
    stack: GateStack | None = None,
) -> RunOutcome:
    """The whole job for one (model, recipe): quantize (or reuse the identical artifact), then gate."""
    from pipelines.quantize.oneshot import quantize_model  # heavy (torch, llm-compressor): only when quantizing

    require_model_dir(model_dir, "--model")
    if settings.registry_path is not None:
        load_signer(settings.registry_path)  # a missing or bad signing key fails now, not after quantizing
    result = quantize_model(recipe, model_dir, force=force, calibration=calibration, eval_sets=settings.eval_sets)
    manifest = result.manifest
    job = GateJob(
        artifact_dir=result.artifact_dir, baseline_dir=model_dir, recipe_name=manifest.recipe, settings=settings,
        stages={"quantize_s": 0.0 if result.reused else manifest.wall_time_s},
        inputs={"recipe_sha256": sha256_text(manifest.recipe_text), "quantize_input_key": manifest.input_key, "quantize_reused": result.reused},
    )
    return run_gate(job, stack)


def run_gate(job: GateJob, stack: GateStack | None = None) -> RunOutcome:
    """Serve baseline (unless cached) and candidate, score, compare, decide, write the evidence, register. `stack`:
    what it drives (servers, scorer, KL, prompts, load test); STACK unless given."""
    stack = stack or STACK
    safe_component(job.recipe_name, "recipe")  # it becomes part of the run folder's name
    require_model_dir(job.baseline_dir, "--baseline")
    require_model_dir(job.artifact_dir, "--artifact")
    check = verify_before_serving(job.artifact_dir, allow_unverified=job.allow_unverified)
    check_served_here(job.artifact_dir)
    register = _registrable(job, check)
    with run_folder(job.settings.runs_dir, job.recipe_name) as folder:
        report = _gate_in(folder.path, job, check, stack)
    final = folder.final
    outcome = RunOutcome(
        verdict=report.gate.verdict, exit_code=report.gate.exit_code, run_dir=final,
        gate_json=final / "gate.json", report_md=final / "report.md", artifact_dir=job.artifact_dir,
        reasons=report.gate.reasons, stages=report.stages, verified=check is not None,
        manifest_sha256=check.manifest_sha256 if check else None,
        artifact_fingerprint=check.fingerprint if check else None, report=report,
        performance=performance_summary(report.performance) if report.performance is not None else None,
    )
    if register:
        outcome.registry_version = _record_in_registry(job, outcome, check)
    return outcome


def _registrable(job: GateJob, check: ArtifactCheck | None) -> bool:
    """The registry takes only verified artifacts (with a manifest); said before the work, not after."""
    if job.settings.registry_path is None:
        return False
    if check is not None:

        # Opened (created, migrated) now: a registry that cannot be written fails the run before serving.
        if Registry(job.settings.registry_path).read_only:
            raise InputError("the registry cannot be written here; fix its permissions or gate with --no-registry",
                             file=job.settings.registry_path, field="--registry")
        load_signer(job.settings.registry_path)  # a missing or bad signing key fails the run before serving
        return True
    progress(f"{job.artifact_dir} has no manifest.json: it will be gated and reported as UNVERIFIED, and not registered")
    return False


def _gate_in(staging: Path, job: GateJob, check: ArtifactCheck | None, stack: GateStack) -> GateReport:
    stages = dict(job.stages)
    include_dir = materialize_tasks(job.settings.eval_sets, staging / "tasks")
    prompts = stack.prompts(job.settings.eval_sets, include_dir, job.baseline_dir)
    for eval_set in job.settings.eval_sets:
        stack.check_lengths(eval_set, prompts[eval_set.name], job.artifact_dir, job.settings.serve.max_model_len, ANSWER_RESERVE_TOKENS)
    identity = recipe_identity(job, check)
    loadtest = job.settings.loadtest and job.settings.policy.performance_for(identity).enabled
    # With the load test on, servers the scoring starts stay up for it (pipelines/loadtest/gate_hook.py).
    with server_pool(loadtest, staging, job.settings.serve, job.baseline_dir, job.artifact_dir, stages, stack.serve) as pool:
        baseline, comparisons = scored_comparisons(staging, job, include_dir, prompts, identity, stages, stack, check=check, pool=pool)
        with timed(stages, "gate_s"):
            fit, plan = _fit_and_plan(job, identity)
            gate = decide(comparisons, job.settings.policy, identity, fit)
        gate, performance = stack.load_test(gate, pool, lambda: stage_inputs(job, prompts, identity, plan, staging), stages)
        if check is not None and gate.verdict == "promoted":  # the canary's golden set, from the weights being promoted
            with timed(stages, "canary_s"):
                stack.golden(lambda: _candidate_server(staging, job, stack, pool),
                             sources_of(prompts, {s.name: s.chat_template for s in job.settings.eval_sets}),
                             staging / EVIDENCE_DIR / GOLDEN_FILE)
    with timed(stages, "gate_s"):
        if check is not None:  # nothing changed while it was served: the verdict is about these bytes
            verify_artifact(job.artifact_dir, manifest_sha256=check.manifest_sha256, fingerprint=check.fingerprint)
    report = GateReport(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        inputs=_inputs(job, baseline, check),
        stages=stages,
        plan=plan,
        gate=gate,
        performance=performance,
    )
    write_json_atomic(staging / "gate.json", report.model_dump(mode="json"))
    write_text_atomic(staging / "report.md", with_unverified_note(render_markdown(report), check is None))
    write_text_atomic(staging / "report.html", render_run_page(report))
    write_run_evidence(  # what a promotion bundle carries besides gate.json and report.md (pipelines.registry.evidence)
        staging, artifact_dir=job.artifact_dir, recipe={"name": job.recipe_name, "sha256": job.inputs.get("recipe_sha256")},
        policy_path=job.settings.policy_path, policy=job.settings.policy, eval_sets=job.settings.eval_sets,
        comparisons=comparisons, report=report,
    )
    return report


def scored_comparisons(
    staging: Path, job: GateJob, include_dir: Path, prompts: dict, identity: RecipeIdentity, stages: dict[str, float], stack: GateStack, *,
    check: ArtifactCheck | None, pool: ServerPool | None = None, artifact_hash: str | None = None,
) -> tuple[dict[str, baseline_cache.BaselineEntry], list[SetComparison]]:
    """Every set of `job` scored (or read from the cache) for the baseline, its repeat where the policy wants the noise
    floor, and the candidate, then paired: what a gate run and a re-gate (pipelines/runs/regate.py) judge."""
    baseline = _baseline_entries(staging, job, include_dir, prompts, stages, stack, pool)
    repeats = _repeat_entries(staging, job, include_dir, baseline, identity, stages, stack)
    candidate = _candidate_entries(staging, job, include_dir, baseline, stages, check, stack, pool, artifact_hash=artifact_hash)
    with timed(stages, "gate_s"):
        comparisons = [
            pair_set(s, baseline[s.name].score, candidate[s.name].score, candidate[s.name].kl_by_doc, KL_METHOD,
                     repeats[s.name].score if s.name in repeats else None)
            for s in job.settings.eval_sets
        ]
    return baseline, comparisons


def _candidate_server(staging: Path, job: GateJob, stack: GateStack, pool: ServerPool | None) -> AbstractContextManager[RunningServer]:
    """The candidate's server: the pool's (up since its scoring or the load test), else a short serve of its own."""
    if pool is not None:
        return nullcontext(pool("candidate")[0])
    return stack.serve(job.artifact_dir, log_path=staging / "canary-server.log", settings=job.settings.serve, served_name="candidate")


def _baseline_entries(
    staging, job: GateJob, include_dir, prompts, stages, stack: GateStack, pool: ServerPool | None = None,
) -> dict[str, baseline_cache.BaselineEntry]:
    model_hash = folder_hash(job.baseline_dir)
    keys = {s.name: baseline_cache.cache_key(model_hash, s, job.settings.serve) for s in job.settings.eval_sets}

    def entry(server: RunningServer, eval_set: EvalSet, score: SetScore) -> baseline_cache.BaselineEntry:
        references = stack.references(
            server, [(p.doc_id, p.text) for p in prompts[eval_set.name]], add_special_tokens=not eval_set.chat_template
        )
        return baseline_cache.BaselineEntry(key=keys[eval_set.name], model_hash=model_hash, score=score, references=references)

    return _cached_or_served("baseline", job.baseline_dir, keys, baseline_cache.BaselineEntry, entry, staging, job, include_dir, stages, stack, pool)


def _repeat_entries(
    staging, job: GateJob, include_dir, baseline, recipe: RecipeIdentity | None, stages, stack: GateStack,
) -> dict[str, baseline_cache.RepeatEntry]:
    """The baseline scored a second time, on a fresh server, for the sets whose policy wants the noise floor (cached like
    the first: one rescoring per model, set and runtime); a tolerance under a set's floor is refused before any candidate
    is served (pipelines.gate.noise)."""
    policy = job.settings.policy
    sets = [s for s in job.settings.eval_sets if policy.for_set(recipe, s.name).noise_floor_for(s.metric.kind)]
    keys = {s.name: baseline_cache.repeat_key(baseline[s.name].key) for s in sets}

    def entry(server: RunningServer, eval_set: EvalSet, score: SetScore) -> baseline_cache.RepeatEntry:
        first = baseline[eval_set.name]
        return baseline_cache.RepeatEntry(key=keys[eval_set.name], model_hash=first.model_hash, score=score, first_key=first.key)

    repeats = _cached_or_served("baseline_repeat", job.baseline_dir, keys, baseline_cache.RepeatEntry, entry, staging, job,
                                include_dir, stages, stack) if sets else {}
    for s in sets:
        refuse_below_floor(s, baseline[s.name].score, repeats[s.name].score, policy, job.settings.policy_path, recipe)
    return repeats


def _candidate_entries(
    staging, job: GateJob, include_dir, baseline, stages, check: ArtifactCheck | None, stack: GateStack, pool: ServerPool | None = None,
    artifact_hash: str | None = None,
) -> dict[str, baseline_cache.CandidateEntry]:
    # A verified artifact's folder hash comes from its check (every file accounted for), or the caller: not read again.
    artifact_hash = artifact_hash or (check.folder_hash if check is not None else folder_hash(job.artifact_dir))
    keys = {
        s.name: baseline_cache.candidate_key(artifact_hash, s, job.settings.serve, baseline[s.name]) for s in job.settings.eval_sets
    }

    def entry(server: RunningServer, eval_set: EvalSet, score: SetScore) -> baseline_cache.CandidateEntry:
        references = baseline[eval_set.name].references
        kl_by_doc = {ref.doc_id: item_kl(ref, top) for ref, top in zip(references, stack.topk(server, references), strict=True)}
        return baseline_cache.CandidateEntry(key=keys[eval_set.name], model_hash=artifact_hash, score=score, kl_by_doc=kl_by_doc)

    def check_speed(missing: list[EvalSet]) -> ScoringDeadline | None:
        return scoring_deadline(job, {s.name: baseline[s.name] for s in missing}, missing, stages)

    return _cached_or_served("candidate", job.artifact_dir, keys, baseline_cache.CandidateEntry, entry, staging, job, include_dir,
                             stages, stack, pool, before_serving=check_speed)


def check_served_here(artifact_dir: Path) -> None:
    """Before any server starts: every scheme in the artifact's config must have a kernel on this host (the probe's
    finding), or the run stops with the host class and the missing kernel, not with a server dying at its first request."""
    if not installed_target().local:
        return
    config = artifact_dir / CONFIG_NAME
    for case in artifact_cases(config):
        problem = probe_problem(case)
        if problem is not None:
            raise InputError(problem[1], file=config, field="quantization_config")
    kv_cache_dtype = served_kv_cache_dtype(artifact_dir)
    if kv_cache_dtype != "auto" and installed_target().kind == "cpu":
        found = kv_probe_problem(kv_cache_dtype, model_shape(*load_config(artifact_dir)).head_dim)
        if found is not None:
            raise InputError(found, file=artifact_dir / "manifest.json", field="kv_cache")


def scoring_deadline(
    job: GateJob, baseline: dict[str, baseline_cache.BaselineEntry], missing: list[EvalSet], stages: dict[str, float],
) -> ScoringDeadline | None:
    """Before a candidate is scored: a slow one (by the kernel probe, docs/hardware.md) gets its estimated scoring
    time, an upper bound from the baseline's measured time; the policy's max_scoring_time_s is then held against
    the measured pace while it is scored (a bound can be far above the truth: one Linear's ratio bounds the model's)."""
    target = installed_target()
    if target.local:
        speed = probed_speed(host_profile(), artifact_cases(job.artifact_dir / CONFIG_NAME))
        items = sum(entry.score.n for entry in baseline.values())
        estimate = estimate_scoring(items, sum(entry.score.wall_s for entry in baseline.values()), speed)
        if estimate is not None:
            stages["candidate_scoring_bound_s"] = round(estimate.seconds, 1)
            progress(estimate.line())
    limit = job.settings.policy.max_scoring_time_s
    if limit is None:
        return None
    requests = [s.num_requests for s in missing]
    total = sum(count for count in requests if count is not None) if None not in requests else None
    return ScoringDeadline(limit_s=limit, policy_file=job.settings.policy_path, total=total)


def _complete(entries: dict[str, baseline_cache.Entry | None]) -> dict[str, baseline_cache.Entry]:
    """Every set's entry, now that none is missing."""
    return {name: entry for name, entry in entries.items() if entry is not None}


def _cached_or_served(
    role: Literal["baseline", "candidate", "baseline_repeat"], model_dir: Path, keys: dict[str, str], entry_type: type[baseline_cache.Entry],
    make_entry: Callable[[RunningServer, EvalSet, SetScore], baseline_cache.Entry], staging: Path, job: GateJob, include_dir: Path,
    stages: dict[str, float], stack: GateStack, pool: ServerPool | None = None,
    before_serving: Callable[[list[EvalSet]], ScoringDeadline | None] | None = None,
) -> dict[str, baseline_cache.Entry]:
    """The cached entry of every set; `role`'s server is started only for the sets missing, which are then cached
    (and, with a pool, kept up after its scoring for the load test). `before_serving` sees the missing sets first."""
    entries = {name: baseline_cache.load_cached(key, job.settings.cache_dir, entry_type) for name, key in keys.items()}
    missing = [s for s in job.settings.eval_sets if s.name in entries and entries[s.name] is None]
    if not missing:
        progress(f"{role}: all {len(entries)} eval set(s) cached; no {role} server needed")
        return _complete(entries)
    deadline = before_serving(missing) if before_serving is not None else None
    progress(f"{role}: scoring {', '.join(s.name for s in missing)} on {model_dir}")
    serve = pool.serve if pool is not None else stack.serve
    with serve(model_dir, log_path=staging / f"{role}-server.log", settings=job.settings.serve, served_name=role) as server:
        stages[f"{role}_serve_start_s"] = round(server.startup_s, 2)
        with timed(stages, f"{role}_scoring_s"):
            scores = stack.score(server, model_dir, missing, include_dir, staging / role, deadline)
            for eval_set in missing:
                fresh = make_entry(server, eval_set, scores[eval_set.name])
                baseline_cache.store(fresh, job.settings.cache_dir)
                entries[eval_set.name] = fresh
    return _complete(entries)


def recipe_identity(job: GateJob, check: ArtifactCheck | None) -> RecipeIdentity:
    """The recipe's name, base and tags (policy overrides match them), from the verified manifest's recipe text."""
    if check is None:
        return RecipeIdentity(name=job.recipe_name)
    return identity_from_text(check.recipe_text, job.recipe_name)


def _fit_and_plan(job: GateJob, identity: RecipeIdentity) -> tuple[FitCheck | None, dict | None]:
    requirement = job.settings.policy.fit_for(identity)
    if requirement is None:
        return None, None
    from pipelines.planner import gpu_spec, plan  # here, not at the top: its name is taken in this module

    gpu = gpu_spec(requirement.gpu, requirement.memory_gib)
    result = plan(
        job.artifact_dir / CONFIG_NAME, [], gpu, requirement.max_model_len, requirement.concurrency,
        artifact_dir=job.artifact_dir,
    )
    row = result.fit_row()
    fit = FitCheck(fits=row.fits, required_bytes=row.total_bytes, available_bytes=row.available_bytes, gpu=gpu.name)
    return fit, result.model_dump(mode="json")


def _inputs(job: GateJob, baseline: dict, check: ArtifactCheck | None) -> dict:
    serve = {**job.settings.serve.model_dump(mode="json"), "dtype": job.settings.serve.served_dtype()}
    artifact = {"path": str(job.artifact_dir), "manifest_sha256": check.manifest_sha256 if check else None, "verified": check is not None}
    return {
        **job.inputs,
        "recipe": job.recipe_name,
        "artifact": artifact if check else {**artifact, "unverified": "no manifest.json; gated with --allow-unverified, not registered"},
        "baseline": {"path": str(job.baseline_dir), "sha256": next(iter(baseline.values())).model_hash},
        "policy": {"path": str(job.settings.policy_path), "sha256": sha256_file(job.settings.policy_path)},
        "eval_sets": {s.name: s.sha256 for s in job.settings.eval_sets},
        "serve": serve,
        "host": host_record(),
        "runtime": runtime_here(job.artifact_dir, serve, baseline_cache.serve_versions()).model_dump(mode="json"),
    }


def score_baseline(model_dir: Path, settings: GateSettings, stack: GateStack | None = None) -> list[str]:
    """Score and cache the 16-bit baseline of `model_dir` on every set of `settings` that is not cached yet
    (the Ray executor's baseline task, run once before the candidates that need it); the sets it scored.
    The server's and lm-eval's logs go to a run folder `<id>-baseline` only when something was scored."""
    job = GateJob(artifact_dir=model_dir, baseline_dir=model_dir, recipe_name="baseline", settings=settings)
    keys = {s.name: baseline_cache.cache_key(folder_hash(model_dir), s, settings.serve) for s in settings.eval_sets}
    cached = {name: baseline_cache.load_cached(key, settings.cache_dir) for name, key in keys.items()}
    missing = [name for name, entry in cached.items() if entry is None or _repeat_missing(settings, entry, name)]
    if missing:
        with run_folder(settings.runs_dir, "baseline") as folder:
            include_dir = materialize_tasks(settings.eval_sets, folder.path / "tasks")
            stack = stack or STACK
            prompts = stack.prompts(settings.eval_sets, include_dir, model_dir)
            baseline = _baseline_entries(folder.path, job, include_dir, prompts, {}, stack)
            _repeat_entries(folder.path, job, include_dir, baseline, None, {}, stack)
    return missing


def _repeat_missing(settings: GateSettings, entry: baseline_cache.BaselineEntry, name: str) -> bool:
    """Whether the set's policy (without a recipe's override) wants the baseline's second scoring and it is not cached."""
    kind = next(s.metric.kind for s in settings.eval_sets if s.name == name)
    wanted = settings.policy.for_set(None, name).noise_floor_for(kind)
    return wanted and baseline_cache.load_cached(baseline_cache.repeat_key(entry.key), settings.cache_dir, baseline_cache.RepeatEntry) is None


def register_run(run_dir: Path, baseline_dir: Path, settings: GateSettings, check: ArtifactCheck) -> int:
    """Register a complete run made in another process (a Ray worker gates with no registry; the driver, the
    registry's only writer, registers here) exactly as run_gate registers its own: the version's fields come
    from the run's gate.json and the artifact check the caller just made."""
    report = load_report(run_dir / "gate.json")
    job = GateJob(
        artifact_dir=check.artifact_dir, baseline_dir=baseline_dir, recipe_name=report.inputs["recipe"], settings=settings,
        inputs=report.inputs,
    )
    outcome = RunOutcome(
        verdict=report.gate.verdict, exit_code=report.gate.exit_code, run_dir=run_dir, gate_json=run_dir / "gate.json",
        report_md=run_dir / "report.md", artifact_dir=check.artifact_dir, reasons=report.gate.reasons, stages=report.stages,
        manifest_sha256=check.manifest_sha256, artifact_fingerprint=check.fingerprint, report=report,
    )
    return _record_in_registry(job, outcome, check)


def _record_in_registry(job: GateJob, outcome: RunOutcome, check: ArtifactCheck | None) -> int:

    registry = Registry(job.settings.registry_path)
    version = registry.register(
        NewVersion(
            source_model=job.baseline_dir.name,
            source_hash=folder_hash(job.baseline_dir),
            artifact_path=job.artifact_dir,
            recipe_name=job.recipe_name,
            recipe_hash=job.inputs.get("recipe_sha256", job.recipe_name),
            eval_sets=[EvalSetRef(name=s.name, hash=s.sha256) for s in job.settings.eval_sets],
            gate_path=outcome.gate_json,
        ),
        verified=check,
    )
    reason = "; ".join(outcome.reasons) or "gate passed"
    if outcome.verdict == "promoted":

        promoted = promote_signed(registry, version, reason, run_dir=outcome.run_dir)
        mirror_after(registry, promoted.model, [promoted.version])  # after the promotion: a mirror failure never undoes it
        return promoted.version
    return registry.reject(version.id, reason).version
