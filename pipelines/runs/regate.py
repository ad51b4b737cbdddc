"""`quantize regate NAME@ALIAS`: a promoted version's verdict re-checked on the serving runtime at hand.

In order, each step refusing before the next costs anything:

1. The version resolves, is promoted, and its signed bundle verifies (signature, every file, evidence).
2. Its inputs are here: the 16-bit baseline it was gated against (folder hash = the version's signed source_hash;
   `--baseline DIR` when it moved), and every eval set with the content hash the version recorded.
3. The kernel probe: every scheme of the bundle has a vLLM kernel on this host. None is a failed re-gate, recorded.
4. The paired gate, rescored on this runtime at this host's serve dtype: the baseline (from the cache only when this
   runtime scored it: the cache is keyed by the host class, the serve dtype and the serve environment's versions) and
   the bundle, set by set on two servers kept up for the whole re-gate, each set judged by the promotion's policy file
   (the bundle's policy.yaml, signed) at its full size. Sets go in the order of the promotion's margins, the narrowest
   first, and the re-gate stops at the first set that fails: no later set can turn a failed set into a pass, so
   stopping there changes neither error rate (deterministic curtailment). Per set, a candidate whose true worsening is
   the tolerance passes at most 1 - confidence of the time (docs/guarantees.md); an unchanged one is rejected at the
   rate the record's unchanged_reject_probability gives, measured on this runtime. A failed re-gate vetoes the runtime
   for the version (pipelines/registry/regates.py): retrying until a pass would multiply the false-pass rate.
5. The semantic canary, when the bundle has a golden set: its prompts against the bundle served here (output
   divergence on prompts held out of the gate's scoring).

The result (runtime, changes, per-set verdicts, the canary's, the cost) is signed into its own folder beside the
bundle and recorded as a `regated` event (pipelines/registry/regates.py); a passing re-gate makes this runtime one the
version may be served on. Exit 0 passed, 1 failed, 2 every error.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipelines.artifact import require_model_dir
from pipelines.canary.golden import load_golden
from pipelines.canary.probe import probe_canary
from pipelines.console.output import progress
from pipelines.errors import InputError
from pipelines.evaluation import baseline as baseline_cache
from pipelines.evaluation.evalsets import EvalSet, select_eval_sets
from pipelines.evaluation.evaluate import ANSWER_RESERVE_TOKENS, materialize_tasks
from pipelines.files.atomic import write_json_atomic
from pipelines.files.hashing import folder_hash
from pipelines.gate.policy import Policy, load_policy
from pipelines.gate.schema import GateReport, GateResult, SetVerdict
from pipelines.gate.verdict import decide
from pipelines.hardware.runtime import runtime_here
from pipelines.recipe import RecipeIdentity, identity_from_text
from pipelines.registry.evidence import EVIDENCE_DIR, GATE_JSON, POLICY_FILE, RECIPE_FILE, registry_record
from pipelines.registry.reference import split_reference
from pipelines.registry.regates import REGATE_JSON, RegateRecord, SetOutcome, gated_runtime, record_regate
from pipelines.registry.store import Registry, Version, verify_version
from pipelines.runs import runner
from pipelines.runs.runfolder import run_folder
from pipelines.runs.runner import (
    GateJob,
    GateSettings,
    check_served_here,
    default_runs_dir,
    scored_comparisons,
)
from pipelines.runs.stack import GateStack
from pipelines.serve.serving import HOST_DTYPE, LOOPBACK, RunningServer, ServeSettings


def error_rates(policy: Policy) -> str:
    """What a re-gate's verdict guarantees, in the version's own policy's terms."""
    levels = sorted({policy.for_set(None, name).confidence for name in policy.eval_sets} | {policy.defaults.confidence})
    miss = " or ".join(f"{1 - level:.1%}" for level in levels)
    return (f"each set is judged by the promotion's own rules at its full size on this runtime: a candidate whose true worsening is "
            f"the set's tolerance passes it at most {miss} of the time (1 - confidence; docs/guarantees.md); stopping at the first "
            f"failed set is deterministic curtailment and changes neither error rate; an unchanged candidate is rejected at the "
            f"rate unchanged_reject_probability gives for the sets scored; a failed re-gate vetoes this runtime for the version")


class RegateOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    record: RegateRecord
    folder: Path  # the signed re-gate folder beside the bundle
    run_dir: Path

    @property
    def exit_code(self) -> int:
        return 0 if self.record.verdict == "passed" else 1


class KeptServers:
    """One server per served name for the whole re-gate: every set reuses it (the runner's `serve` signature)."""

    def __init__(self, stack: ExitStack, start: Any):
        self._stack, self._start = stack, start
        self._servers: dict[str, RunningServer] = {}

    @contextmanager
    def serve(self, model_dir: Path, *, log_path: Path, settings: Any, served_name: str) -> Iterator[RunningServer]:
        if served_name not in self._servers:
            self._servers[served_name] = self._stack.enter_context(
                self._start(model_dir, log_path=log_path, settings=settings, served_name=served_name))
        yield self._servers[served_name]


def regate(reference: str, registry: Registry, *, baseline_dir: Path | None = None, runs_dir: Path | None = None,
           stack: GateStack | None = None) -> RegateOutcome:
    started = time.monotonic()
    version, bundle = _promoted_bundle(reference, registry)
    gate = GateReport.model_validate_json((bundle / EVIDENCE_DIR / GATE_JSON).read_bytes())  # verified with the bundle
    baseline = _baseline_here(version, baseline_dir)
    eval_sets = _eval_sets_here(version, gate)
    # The servers run as serve and deploy run them here: the recorded settings at this host's own dtype.
    serve = ServeSettings.as_recorded(gate.inputs.get("serve"), bundle / EVIDENCE_DIR / GATE_JSON).model_copy(update={"dtype": HOST_DTYPE})
    policy_path = bundle / EVIDENCE_DIR / POLICY_FILE  # as the promotion read it (policy.json's dump cannot say which rules were off)
    settings = GateSettings(eval_sets=eval_sets, policy=load_policy(policy_path), policy_path=policy_path,
                            serve=serve, runs_dir=runs_dir or default_runs_dir(), loadtest=False)
    gated = gated_runtime(bundle)
    here = runtime_here(bundle, settings.serve.model_dump(mode="json"), baseline_cache.serve_versions())
    changes = gated.changes(here)
    progress(f"re-gating {version.model} v{version.version}: gated on {gated.summary()}; here {here.summary()}"
             + (f" ({len(changes)} change(s): {'; '.join(changes)})" if changes else " (the same runtime)"))
    job = GateJob(artifact_dir=bundle, baseline_dir=baseline, recipe_name=version.recipe_name, settings=settings)
    with run_folder(settings.runs_dir, f"regate-{version.recipe_name}") as folder:
        sets, reasons, divergence = _judged(folder.path, job, bundle, stack or runner.STACK)
        passed = not reasons
        scored = [s.unchanged_reject_probability for s in sets if s.unchanged_reject_probability is not None]
        record = RegateRecord(
            model=version.model, version=version.version, registry_record=registry_record(version),
            at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            verdict="passed" if passed else "failed", reasons=reasons, runtime=here, gated_runtime=gated, changes=changes,
            sets=sets, stopped_early=any(s.verdict == "not scored" for s in sets), divergence=divergence,
            error_rates=error_rates(settings.policy), unchanged_reject_probability=1 - math.prod(1 - p for p in scored) if scored else None,
            run_dir=str(folder.final), cost_s=round(time.monotonic() - started, 1),
        )
        write_json_atomic(folder.path / REGATE_JSON, record.model_dump(mode="json"))
    signed = record_regate(registry, version, record, bundle)
    return RegateOutcome(record=record, folder=signed, run_dir=folder.final)


def _promoted_bundle(reference: str, registry: Registry) -> tuple[Version, Path]:
    model, wanted = split_reference(reference, field="NAME@ALIAS")
    if wanted is None:
        raise InputError("name the version to re-gate: NAME@VERSION or NAME@ALIAS", field="NAME@ALIAS")
    version = registry.show(model, wanted)
    if version.status != "promoted":
        raise InputError(f"{model} v{version.version} is {version.status}; only a promoted version is re-gated", file=registry.path,
                         field="status")
    verify_version(version)
    check = registry.verify_signature(version, required=True)
    assert check is not None  # required=True raises instead
    return version, check.bundle


def _baseline_here(version: Version, given: Path | None) -> Path:
    """The 16-bit model the version was gated against: `given`, else where its gate found it; its content must be the
    signed source_hash (a moved or changed baseline is named with what to do)."""
    recorded = version.gate.inputs.get("baseline") if version.gate is not None else None
    recorded_path = recorded.get("path") if isinstance(recorded, dict) and isinstance(recorded.get("path"), str) else None
    path = given or (Path(recorded_path) if recorded_path else None)
    field = "--baseline" if given else "inputs.baseline.path"
    if path is None or not (path / "config.json").is_file():
        where = f"is not at {path}" if path is not None else "was not recorded"
        raise InputError(f"the 16-bit baseline {version.model} v{version.version} was gated against {where}: restore it there or pass "
                         f"--baseline DIR (its folder hash must be {version.source_hash[:16]}...)", file=path or version.gate_path, field=field)
    require_model_dir(path, field)
    if folder_hash(path) != version.source_hash:
        raise InputError(f"this folder is not the baseline the version was gated against (folder hash must be "
                         f"{version.source_hash[:16]}...)", file=path, field=field)
    return path


def _eval_sets_here(version: Version, gate: GateReport) -> list[EvalSet]:
    """The version's eval sets as found under eval_sets/, each with the content it was gated on, the narrowest
    margin of the promotion first (the set most likely to fail ends a failing re-gate soonest)."""
    found = {s.name: s for s in select_eval_sets([ref.name for ref in version.eval_sets])}
    for ref in version.eval_sets:
        if found[ref.name].sha256 != ref.hash:
            raise InputError(f"eval set {ref.name} changed since v{version.version} was gated (sha256 {ref.hash[:12]}... recorded, "
                             f"{found[ref.name].sha256[:12]}... here): restore the version's copy to re-gate it", file=found[ref.name].folder,
                             field="eval_sets")
    margins = {s.eval_set: _margin(s) for s in gate.gate.sets}
    return sorted((found[ref.name] for ref in version.eval_sets), key=lambda s: margins.get(s.name, 0.0))


def _margin(verdict: SetVerdict) -> float:
    """How far the promotion's bound stayed inside the tolerance, as a share of it (0 when it recorded no bound rule)."""
    bound, tolerance = verdict.worsening_bound, verdict.tolerance
    return (tolerance - bound) / tolerance if bound is not None and tolerance else 0.0


def _judged(staging: Path, job: GateJob, bundle: Path, stack: GateStack) -> tuple[list[SetOutcome], list[str], dict[str, Any] | None]:
    """Kernel probe, then the sets one by one until one fails; then the canary. (sets, reasons, divergence)."""
    names = [s.name for s in job.settings.eval_sets]
    try:
        check_served_here(bundle)
    except InputError as error:
        return [SetOutcome(name=name, verdict="not scored") for name in names], [f"kernel probe: {error.one_line()}"], None
    recipe_text = (bundle / EVIDENCE_DIR / RECIPE_FILE).read_text() if (bundle / EVIDENCE_DIR / RECIPE_FILE).is_file() else ""
    identity = identity_from_text(recipe_text, job.recipe_name) if recipe_text else RecipeIdentity(name=job.recipe_name)
    artifact_hash = folder_hash(bundle)  # once: every set's candidate entry is keyed by it
    outcomes: list[SetOutcome] = []
    reasons: list[str] = []
    with ExitStack() as servers:
        kept = KeptServers(servers, stack.serve)
        kept_stack = dataclasses.replace(stack, serve=kept.serve)
        for index, eval_set in enumerate(job.settings.eval_sets):
            progress(f"re-gate: set {index + 1} of {len(names)}, {eval_set.name}")
            verdict = _judge_one(staging, job, eval_set, identity, kept_stack, artifact_hash)
            judged = verdict.sets[0]
            outcomes.append(SetOutcome(name=eval_set.name, verdict="passed" if verdict.verdict == "promoted" else "failed",
                                       reasons=verdict.reasons, worsening_bound=judged.worsening_bound, tolerance=judged.tolerance,
                                       unchanged_reject_probability=judged.unchanged_reject_probability))
            if verdict.verdict != "promoted":
                reasons += verdict.reasons
                outcomes += [SetOutcome(name=name, verdict="not scored") for name in names[index + 1:]]
                break
        divergence = _canary(bundle, kept.serve, job.settings.serve, staging)
    if divergence is not None and not divergence.get("healthy", True):
        reasons.append(f"semantic canary: {divergence.get('summary', 'the golden set disagrees')}")
    return outcomes, reasons, divergence


def _judge_one(staging: Path, job: GateJob, eval_set: EvalSet, identity: RecipeIdentity, stack: GateStack, artifact_hash: str) -> GateResult:
    one = job.model_copy(update={"settings": job.settings.model_copy(update={"eval_sets": [eval_set]}), "stages": {}})
    include_dir = materialize_tasks([eval_set], staging / "tasks" / eval_set.name)
    prompts = stack.prompts([eval_set], include_dir, job.baseline_dir)
    stack.check_lengths(eval_set, prompts[eval_set.name], job.artifact_dir, job.settings.serve.max_model_len, ANSWER_RESERVE_TOKENS)
    _, comparisons = scored_comparisons(staging, one, include_dir, prompts, identity, one.stages, stack, check=None,
                                        artifact_hash=artifact_hash)
    return decide(comparisons, job.settings.policy, identity, None)


def _canary(bundle: Path, serve: Any, settings: ServeSettings, staging: Path) -> dict[str, Any] | None:
    """The golden set (prompts held out of the gate's scoring, answered at promotion) against the bundle served here:
    the output divergence this runtime makes. None when the bundle predates golden sets."""
    golden = load_golden(bundle)
    if golden is None:
        return None
    with serve(bundle, log_path=staging / "candidate-server.log", settings=settings, served_name="candidate") as server:
        progress(f"re-gate: semantic canary, {len(golden.prompts)} golden prompts")
        result = probe_canary(f"http://{LOOPBACK}:{server.port}", model=server.served_name, golden=golden, api_key=server.api_key,
                              timeout_s=settings.request_timeout_s)
    return {**result.model_dump(mode="json", exclude={"checks"}), "summary": result.summary()}
