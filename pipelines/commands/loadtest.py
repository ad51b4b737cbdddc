"""`quantize loadtest --model DIR [--artifact DIR]`: the load test on its own, with servers it starts itself.

With --artifact, the artifact is the candidate and --model its 16-bit baseline: both are served, swept and
compared as in a gate run (docs/loadtest.md); without it, --model alone is measured (figures, KV, memory,
measured tuning; no ratios). Results go to a run folder (`<runs>/<id>`: loadtest.json, loadtest.md, plots,
the tool's files) and to the terminal, or as JSON with --json. Exit 0 unless enforced checks fail (1: on a GPU
target, or with `enforce: always`); every error is exit 2, and no server outlives the command.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path

from pipelines.artifact import CONFIG_NAME, MANIFEST_NAME, read_model_config, require_model_dir, verify_artifact
from pipelines.bounds import MAX_CONTEXT
from pipelines.commands.args import eval_set_names, int_arg
from pipelines.commands.common import library_output_on_stderr
from pipelines.console.capture import add_verbose_option
from pipelines.console.output import emit, progress, say, table
from pipelines.errors import EXIT_OK, EXIT_REJECTED, InputError
from pipelines.evaluation.evalsets import EvalSet, select_eval_sets
from pipelines.evaluation.evaluate import ANSWER_RESERVE_TOKENS, check_prompt_lengths, load_prompts, materialize_tasks
from pipelines.files.atomic import write_json_atomic, write_text_atomic
from pipelines.gate.policy import FitRequirement, load_gate_policy
from pipelines.gate.report import performance_markdown
from pipelines.hardware.targets import installed_target
from pipelines.loadtest.config import MAX_LEVEL, PerformancePolicy
from pipelines.loadtest.gate_hook import ServerPool
from pipelines.loadtest.render import console_tables
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


def options(args: argparse.Namespace) -> Options:
    model = servable_folder(args.model, "--model")
    artifact = servable_folder(args.artifact, "--artifact") if args.artifact else None
    policy, _ = load_gate_policy(args.policy)
    identity = _identity(artifact)
    performance = policy.performance_for(identity)
    load = {key: value for key, value in (("max_concurrency", args.concurrency), ("repeats", args.repeats)) if value is not None}
    if load:
        performance = performance.model_copy(update={"load": performance.load.model_copy(update=load)})
    fit = policy.fit_for(identity)
    # The sweep's top, never above MAX_LEVEL (a fit's concurrency may be far higher): the servers' max_num_seqs.
    top = min(performance.load.max_concurrency or (fit.concurrency if fit else None) or ServeSettings().max_num_seqs, MAX_LEVEL)
    check_plan(performance.load, top, models=2 if artifact is not None else 1)  # before a folder is made or a file written
    names = eval_set_names(args.eval_sets)
    return Options(
        model=model, artifact=artifact, performance=performance, fit=fit, eval_sets=select_eval_sets(names),
        # Servers started here may take the whole sweep (a gate run's servers keep their own max_num_seqs).
        serve=ServeSettings(max_model_len=args.max_model_len, max_num_seqs=max(ServeSettings().max_num_seqs, top)),
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


def handle(args: argparse.Namespace) -> int:
    chosen = options(args)  # bad input fails here, before a folder or a server exists
    with library_output_on_stderr(verbose=args.verbose):
        report, run_dir = run(chosen)

    def render(result: dict) -> None:
        console_tables(report, table, say)
        progress(f"load test evidence in {run_dir}")

    emit({"run_dir": str(run_dir), "performance": report}, as_json=args.json, render=render)
    return EXIT_REJECTED if report.reasons else EXIT_OK


def register(subparsers) -> None:
    parser = subparsers.add_parser("loadtest")  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("--model", type=Path, required=True, help="the 16-bit model folder (the baseline)")
    parser.add_argument("--artifact", type=Path, help="a quantized artifact to compare against --model (the candidate)")
    parser.add_argument("--eval-sets", help="comma-separated eval set names whose prompts make the load (default: every set)")
    parser.add_argument("--policy", type=Path, help="policy YAML whose performance block applies (default: policies/default.yaml)")
    parser.add_argument("--concurrency", type=int_arg(1, MAX_LEVEL), help="top of the sweep (default: the policy's)")
    parser.add_argument("--repeats", type=int_arg(1, 50), help="runs per model and concurrency (default: the policy's)")
    parser.add_argument("--max-model-len", type=int_arg(1, MAX_CONTEXT), default=ServeSettings().max_model_len, help="vLLM max model length")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    add_verbose_option(parser)
    parser.set_defaults(handler=handle)
