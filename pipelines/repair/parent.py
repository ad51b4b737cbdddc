"""The run a repair starts from: a rejected run's folder under artifacts/runs, read back into what gated it.

From its gate.json: the model, the artifact (whose manifest.json holds the recipe as written and its
calibration data), the eval sets, the policy and the serve settings. A repair is judged by the same gate, so
an eval set that changed since the run is refused (exit 2), and so is a policy whose rules for this recipe
and these sets (or its fit) changed (another edit of the policy file is accepted), a run that is not a
rejection, a failed run (`-error`, no gate.json) or an unknown id.

What the run folder holds is only believed as the registry recorded it: the gate.json must be the evidence a
registry version was registered with (same sha256) and the artifact's manifest.json the one that version
recorded; a run the registry does not know is refused unless `--allow-unverified` (or it is the run this
process has just made). Every number taken from the files is bounded: the serve settings by ServeSettings,
stage times clipped to [0, 30 days] and the expected time of one more gate never below MIN_GATE_S, so
recorded times cannot make a real gate start past `--repair-time`.
"""

from __future__ import annotations

import math
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pipelines.artifact import MANIFEST_NAME, Manifest, is_model_dir, read_manifest
from pipelines.console.output import progress
from pipelines.errors import InputError, QuantGateError, from_validation_error
from pipelines.evaluation.evalsets import select_eval_sets
from pipelines.files.hashing import sha256_file, sha256_json
from pipelines.files.safepath import ensure_inside, safe_component
from pipelines.gate.policy import Policy, SetPolicy, load_gate_policy
from pipelines.gate.schema import GateReport, read_report
from pipelines.planner import gpu_spec
from pipelines.quantize.calibration import source_of
from pipelines.recipe import LoadedRecipe, RecipeIdentity, parse_recipe
from pipelines.registry.store import Registry, registry_exists
from pipelines.runs.runner import GateSettings
from pipelines.serve.serving import ServeSettings

if TYPE_CHECKING:
    from pipelines.registry.store import Version

GATE_JSON = "gate.json"
# No real gate (quantize, a vLLM start, scoring, the gate) takes less: the README measures 20-27 s for a vLLM
# start alone on the demo model. One more gate is never expected to be quicker, whatever a run recorded.
MIN_GATE_S = 10.0
MAX_STAGE_S = 30 * 24 * 3600.0  # the longest --repair-time


class ParentRun(BaseModel):
    """A rejected run and everything needed to gate its repairs the same way."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    run_id: str
    run_dir: Path
    report: GateReport
    model_dir: Path
    artifact_dir: Path
    manifest: Manifest
    recipe: LoadedRecipe
    calibration: str | None
    settings: GateSettings
    registry_version: int | None = None

    @property
    def gate_json(self) -> Path:
        return self.run_dir / GATE_JSON

    @property
    def candidate_wall_s(self) -> float:
        """What gating one more candidate costs, by this run: quantize + candidate serving and scoring + gate,
        each recorded time clipped to [0, MAX_STAGE_S], never less than MIN_GATE_S in all."""
        stages = self.report.stages
        spent = sum(_clipped_seconds(value) for key, value in stages.items() if key.startswith(("quantize", "candidate", "gate")))
        return max(MIN_GATE_S, min(spent, MAX_STAGE_S))


def _clipped_seconds(value: float) -> float:
    return min(max(value, 0.0), MAX_STAGE_S) if math.isfinite(value) else MAX_STAGE_S if value > 0 else 0.0


def load_parent(run_id: str, runs_dir: Path, *, registry_path: Path | None, calibration: str | None = None, loadtest: bool = True,
                allow_unverified: bool = False, recorded_in: Path | None = None) -> ParentRun:
    """The rejected run `run_id` (a folder name under `runs_dir`); an InputError (exit 2) for anything else.

    Its gate.json and manifest.json must be those the registry `recorded_in` (default: registry_path, where the
    repair's gates are registered) recorded for it; `allow_unverified`: a run the registry does not know is read
    as it is (with a warning line)."""
    safe_component(run_id, "RUN_ID")
    run_dir = ensure_inside(runs_dir, runs_dir / run_id, "RUN_ID")
    if not run_dir.is_dir():
        raise InputError(f"no run {run_id!r} under {runs_dir}", field="RUN_ID")
    if not (run_dir / GATE_JSON).is_file():
        raise InputError("not a rejection: the run has no gate.json (it failed before a verdict)", file=run_dir, field="RUN_ID")
    report, recorded = read_report(run_dir / GATE_JSON)
    if report.gate.verdict != "rejected":  # a refusal needs no verification; a rejection is believed only as recorded
        raise InputError(f"not a rejection: the gate {report.gate.verdict} this run; there is nothing to repair",
                         file=run_dir / GATE_JSON, field="gate.verdict")
    artifact_dir = _path(report, "artifact", run_dir)
    registry_version = verify_recorded_run(run_dir, recorded, artifact_dir, recorded_in or registry_path, allow_unverified=allow_unverified)
    model_dir = _path(report, "baseline", run_dir)
    manifest = read_manifest(artifact_dir)
    if manifest is None:
        raise InputError("the rejected artifact has no readable manifest.json (it records the recipe to repair)",
                         file=artifact_dir / MANIFEST_NAME, field="recipe_text")
    recipe = LoadedRecipe(recipe=parse_recipe(manifest.recipe_text, artifact_dir / MANIFEST_NAME), path=Path(manifest.recipe_file),
                          text=manifest.recipe_text)
    settings = _settings(report, run_dir, runs_dir, registry_path)
    identity = recipe.recipe.identity.model_copy(update={"name": report.gate.recipe})
    check_same_rules(report, settings.policy, identity, settings.policy_path, run_dir / GATE_JSON)
    return ParentRun(
        run_id=run_id, run_dir=run_dir, report=report, model_dir=model_dir, artifact_dir=artifact_dir, manifest=manifest, recipe=recipe,
        calibration=calibration if calibration is not None else source_of(manifest.calibration),
        settings=settings.model_copy(update={"loadtest": loadtest}), registry_version=registry_version,
    )


def verify_recorded_run(run_dir: Path, recorded: dict[str, Any], artifact_dir: Path, registry_path: Path | None, *,
                        allow_unverified: bool) -> int | None:
    """The registry version whose evidence is this run's gate.json, after checking that gate.json (`recorded`,
    as read) and the artifact's manifest.json are byte for byte what it recorded; None for an unregistered
    run when allowed."""
    gate_json = run_dir / GATE_JSON
    version = _registered_version(gate_json, registry_path)
    if version is None:
        if not allow_unverified:
            raise InputError(
                f"the registry{f' {registry_path}' if registry_path else ''} has no version from this run, so its gate.json and "
                "manifest.json cannot be checked against recorded hashes; give --allow-unverified to repair it as it is",
                file=gate_json, field="RUN_ID",
            )
        progress(f"WARNING: run {run_dir.name} is not in the registry: its gate.json and manifest.json are read unverified")
        return None
    where = f"{version.model} version {version.version} in {registry_path}"
    if sha256_json(recorded) != version.gate_hash:
        raise InputError(f"differs from the gate evidence the registry recorded ({where}): the file was changed since the run",
                         file=gate_json, field="gate.json")
    manifest = artifact_dir / MANIFEST_NAME
    if Path(version.artifact_path) != artifact_dir.resolve():
        raise InputError(f"names artifact {artifact_dir}, the registry recorded {version.artifact_path} ({where})",
                         file=gate_json, field="inputs.artifact.path")
    try:
        if not stat.S_ISREG(manifest.lstat().st_mode):  # a FIFO would block the hash; a link points at anything
            raise InputError("the manifest is not a regular file (a link, a FIFO, a device or a folder); refused", file=manifest,
                             field="manifest.json")
        manifest_hash = sha256_file(manifest)
    except OSError as error:
        raise InputError(f"cannot read the manifest ({error.strerror or error})", file=manifest, field="manifest.json") from None
    if version.manifest_hash is None or manifest_hash != version.manifest_hash:
        raise InputError(f"differs from the manifest the registry recorded ({where}): the file was changed since the run",
                         file=manifest, field="manifest.json")
    return version.version


def _registered_version(gate_json: Path, registry_path: Path | None) -> Version | None:
    """The registry's version whose evidence is gate_json, or None (no registry, or not in it)."""
    if not registry_exists(registry_path):
        return None

    target = gate_json.resolve().as_posix()
    try:
        versions = Registry(registry_path).list()
    except QuantGateError as error:
        raise InputError(f"cannot read the registry to verify the run: {error.one_line()}", file=registry_path, field="registry") from None
    return next((v for v in versions if v.gate_path == target), None)


def _path(report: GateReport, key: str, run_dir: Path) -> Path:
    value = report.inputs.get(key)
    path = value.get("path") if isinstance(value, dict) else None
    if not isinstance(path, str) or not is_model_dir(Path(path)):
        raise InputError(f"gate.json names no {key} folder that still exists ({path})", file=run_dir / GATE_JSON, field=f"inputs.{key}.path")
    return Path(path)


def _settings(report: GateReport, run_dir: Path, runs_dir: Path, registry_path: Path | None) -> GateSettings:
    """The run's eval sets, policy and serve settings, checked unchanged since the run."""
    gate_json = run_dir / GATE_JSON
    recorded = report.inputs.get("eval_sets")
    if not isinstance(recorded, dict) or not recorded or not report.gate.sets:
        raise InputError("names no eval sets: a repair is judged on the sets that rejected the run", file=gate_json,
                         field="inputs.eval_sets" if not recorded else "gate.sets")
    eval_sets = select_eval_sets(list(recorded))
    for eval_set in eval_sets:
        if eval_set.sha256 != recorded[eval_set.name]:
            raise InputError(f"eval set {eval_set.name} changed since this run; a repair is judged by the same gate",
                             file=gate_json, field=f"inputs.eval_sets.{eval_set.name}")
    policy_file = _recorded_object(report.inputs.get("policy"), gate_json, "inputs.policy").get("path")
    if policy_file is not None and not isinstance(policy_file, str):
        raise InputError(f"must be a path (got {type(policy_file).__name__})", file=gate_json, field="inputs.policy.path")
    policy, policy_path = load_gate_policy(Path(policy_file) if policy_file else None)
    try:
        serve = ServeSettings.model_validate(report.inputs.get("serve") or {})
    except ValidationError as error:
        problem = from_validation_error(error, gate_json)
        raise InputError(problem.message, file=gate_json, field=f"inputs.serve.{problem.field}") from None
    return GateSettings(eval_sets=eval_sets, policy=policy, policy_path=policy_path, serve=serve, registry_path=registry_path, runs_dir=runs_dir)


def check_same_rules(report: GateReport, policy: Policy, identity: RecipeIdentity, policy_path: Path, gate_json: Path) -> None:
    """The policy file may have changed since the run (comments, other recipes, the load test); the rules that
    judged this recipe on these sets, and the deployment it had to fit, must not have."""
    recorded = _recorded_object(report.inputs.get("policy"), gate_json, "inputs.policy").get("sha256")
    if recorded == sha256_file(policy_path):
        return
    for verdict in report.gate.sets:
        now = policy.for_set(identity, verdict.eval_set)
        if now != verdict.rules:
            changed = next(name for name in SetPolicy.model_fields if getattr(now, name) != getattr(verdict.rules, name))
            raise InputError(f"the policy's {changed} for {identity.name} on {verdict.eval_set} changed since this run "
                             f"({getattr(verdict.rules, changed)} -> {getattr(now, changed)}); a repair is judged by the same gate",
                             file=policy_path, field=f"policy ({gate_json})")
    fit, plan = policy.fit_for(identity), _recorded_object(report.plan, gate_json, "plan")
    # By device memory, not name: the GPU table may name a device differently since (`L4-24GB`, `L4`).
    gpu = _recorded_object(plan.get("gpu"), gate_json, "plan.gpu")
    then = (gpu.get("memory_bytes"), plan.get("max_model_len"), plan.get("concurrency")) if plan else None
    now_fit = None
    if fit is not None:

        now_fit = (gpu_spec(fit.gpu, fit.memory_gib).memory_bytes, fit.max_model_len, fit.concurrency)
    if then != now_fit:
        raise InputError(f"the policy's fit for {identity.name} changed since this run ({then} -> {now_fit}); a repair is judged by "
                         "the same gate", file=policy_path, field=f"fit ({gate_json})")


def _recorded_object(value: object, gate_json: Path, field: str) -> dict[str, Any]:
    """A part of gate.json read as an object (absent: empty); anything else is a gate.json this quantgate did not write."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"must be a JSON object (got {type(value).__name__}): not a gate.json this quantgate wrote", file=gate_json,
                         field=field)
    return value
