"""The load test as a run of its own (`quantize loadtest`): its inputs checked before a folder is made or a server
started, its servers started and stopped here, its evidence in a run folder (loadtest.json, loadtest.md, plots, the
tool's files). With an artifact, the artifact is the candidate and the model its 16-bit baseline: both are served, swept
and compared as in a gate run (docs/loadtest.md); without, the model alone is measured."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from pydantic import ValidationError

from pipelines.artifact import CONFIG_NAME, MANIFEST_NAME, read_model_config, require_model_dir, verify_artifact
from pipelines.errors import InputError
from pipelines.evaluation.evalsets import EvalSet, select_eval_sets
from pipelines.evaluation.evaluate import ANSWER_RESERVE_TOKENS, check_prompt_lengths, load_prompts, materialize_tasks
from pipelines.files.atomic import write_json_atomic, write_text_atomic
from pipelines.gate.policy import FitRequirement, load_gate_policy
from pipelines.gate.report import performance_markdown
from pipelines.hardware.targets import installed_target
from pipelines.loadtest.config import MAX_LEVEL, ComparisonSettings, PerformancePolicy
from pipelines.loadtest.gate_hook import ServerPool
from pipelines.loadtest.results import PerformanceReport, Role
from pipelines.loadtest.stage import StageInputs, check_plan, plan_for, run_loadtest
from pipelines.recipe import RecipeIdentity, identity_from_text
from pipelines.runs.runfolder import run_folder
from pipelines.schema import StrictModel
from pipelines.serve.serving import ServeSettings
from pipelines.settings import current as current_settings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _identity(artifact: Path | None) -> RecipeIdentity:
    """The recipe a policy's overrides match: the artifact's (verified manifest), else 16-bit."""
    if artifact is None or not (artifact / MANIFEST_NAME).exists():
        return RecipeIdentity(name=artifact.name if artifact else "16-bit")
    return identity_from_text(verify_artifact(artifact).recipe_text, artifact.name)


def budget(settings: ComparisonSettings, seconds: float) -> ComparisonSettings:
    """The comparison's settings with --budget-s, checked like the policy's (one line, exit 2, when it cannot hold a pair)."""
    try:
        return ComparisonSettings.model_validate({**settings.model_dump(), "budget_s": seconds})
    except ValidationError as error:
        raise InputError(error.errors()[0]["msg"].removeprefix("Value error, "), field="--budget-s") from None


class Options(StrictModel):
    """The command line, checked before any folder is made or server started."""

    model: Path
    artifact: Path | None
    performance: PerformancePolicy
    fit: FitRequirement | None
    serve: ServeSettings
    eval_sets: list[EvalSet]


def servable_folder(path: Path, field: str) -> Path:
    """A model folder the load test can serve and tokenize for, resolved: no symlink loop, a config.json that is a
    JSON object with a model_type inside the folder (not a link out of it), and a tokenizer."""
    try:
        folder = path.resolve(strict=True)
        config = (folder / CONFIG_NAME).resolve()
    except FileNotFoundError:
        raise InputError("not found", file=path, field=field) from None
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop
        raise InputError(f"cannot resolve the path ({error})", file=path, field=field) from None
    require_model_dir(folder, field)
    if not config.is_relative_to(folder):
        raise InputError(f"config.json leads outside the model folder (a link to {config})", file=folder / CONFIG_NAME, field=field)
    read_model_config(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"no tokenizer ({' or '.join(TOKENIZER_FILES)}): the workload's prompts are tokenized with it", file=folder, field=field)
    return folder


def options(
    model_dir: Path, artifact_dir: Path | None, *, policy_path: Path | None, concurrency: int | None, repeats: int | None,
    eval_sets: list[str] | None, max_model_len: int, budget_s: float | None = None,
) -> Options:
    """The command line's inputs, each checked (one line naming the option on a problem)."""
    model = servable_folder(model_dir, "--model")
    artifact = servable_folder(artifact_dir, "--artifact") if artifact_dir else None
    policy, _ = load_gate_policy(policy_path)
    identity = _identity(artifact)
    performance = policy.performance_for(identity)
    load = {key: value for key, value in (("max_concurrency", concurrency), ("repeats", repeats)) if value is not None}
    if load:
        performance = performance.model_copy(update={"load": performance.load.model_copy(update=load)})
    if budget_s is not None:
        performance = performance.model_copy(update={"comparison": budget(performance.comparison, budget_s)})
    fit = policy.fit_for(identity)
    # The sweep's top, never above MAX_LEVEL (a fit's concurrency may be far higher): the servers' max_num_seqs.
    top = min(performance.load.max_concurrency or (fit.concurrency if fit else None) or ServeSettings().max_num_seqs, MAX_LEVEL)
    check_plan(performance.load, top, models=2 if artifact is not None else 1)  # before a folder is made or a file written
    return Options(
        model=model, artifact=artifact, performance=performance, fit=fit, eval_sets=select_eval_sets(eval_sets),
        # Servers started here may take the whole sweep (a gate run's servers keep their own max_num_seqs).
        serve=ServeSettings(max_model_len=max_model_len, max_num_seqs=max(ServeSettings().max_num_seqs, top)),
    )


def stage_inputs(chosen: Options, run_dir: Path) -> StageInputs:
    include_dir = materialize_tasks(chosen.eval_sets, run_dir / "tasks")
    prompts = {s.name: load_prompts(s, include_dir, chosen.model) for s in chosen.eval_sets}
    for eval_set in chosen.eval_sets:
        check_prompt_lengths(eval_set, prompts[eval_set.name], chosen.model, chosen.serve.max_model_len, ANSWER_RESERVE_TOKENS)
    artifact, model = chosen.artifact, chosen.model
    return StageInputs(
        eval_sets=chosen.eval_sets, prompts=prompts, baseline_dir=model, artifact_dir=artifact, serve=chosen.serve,
        policy=chosen.performance, fit_concurrency=chosen.fit.concurrency if chosen.fit else None,
        plan=plan_for(chosen.fit, artifact or model), target=str(installed_target()), run_dir=run_dir,
        title=f"{artifact.name} against {model.name}" if artifact else model.name,
    )


def run(chosen: Options) -> tuple[PerformanceReport, Path]:
    with run_folder(current_settings().runs_dir, "loadtest") as folder:
        with ExitStack() as stack:  # every server (and the tool) this command starts stops here, however it ends
            models: dict[Role, Path] = {"baseline": chosen.model, "candidate": chosen.artifact or chosen.model}
            pool = ServerPool(stack, folder.path, chosen.serve, models, {})  # the tool's import starts now
            report = run_loadtest(stage_inputs(chosen, folder.path), pool, pool.driver)
        write_json_atomic(folder.path / "loadtest.json", report.model_dump(mode="json"))
        write_text_atomic(folder.path / "loadtest.md", performance_markdown(report))
    return report, folder.final
