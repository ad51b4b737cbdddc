"""`quantize gate --artifact PATH --baseline MODEL`: gate an artifact quantized elsewhere (the CI/CD case)."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipelines.cli import int_arg
from pipelines.errors import InputError
from pipelines.gate import load_report
from pipelines.manifest import MANIFEST_NAME, read_manifest_json
from pipelines.output import emit, progress
from pipelines.policy import MAX_CONTEXT
from pipelines.progress import add_verbose_option, library_output_to_log
from pipelines.registry import default_registry_path
from pipelines.report import render_console
from pipelines.runner import GateJob, GateSettings, RunOutcome, load_gate_policy, run_gate, select_eval_sets
from pipelines.safepath import safe_component
from pipelines.serving import ServeSettings


@contextmanager
def library_output_on_stderr(verbose: bool | None = None) -> Iterator[Path | None]:
    """While the work runs, library output (llm-compressor's loguru sink, transformers warnings, tqdm bars,
    C code writing to fd 1/2, lm-eval's logging) goes to a log file under artifacts/logs (and each run's
    own part to its run folder's library.log), while the product's progress stays on the terminal; stdout
    carries only the result printed afterwards (the table, or the JSON document of --json).

    verbose (default: whether --verbose was given): library output stays on stderr, as it comes.
    The name is kept for the commands that call it (run, job, models)."""
    with library_output_to_log(verbose=verbose) as log_path:
        yield log_path


def add_gate_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by `quantize --recipe` and `quantize gate`."""
    parser.add_argument("--eval-sets", help="comma-separated eval set names (default: every set under eval_sets/)")
    parser.add_argument("--policy", type=Path, help="gate policy YAML (default: policies/default.yaml)")
    parser.add_argument("--registry", type=Path, default=default_registry_path(), help="registry database (default: %(default)s; env QUANTGATE_REGISTRY)")
    parser.add_argument("--no-registry", action="store_true", help="decide and report, but do not write the registry")
    parser.add_argument("--max-model-len", type=int_arg(1, MAX_CONTEXT), default=ServeSettings().max_model_len, help="vLLM max model length")
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON on stdout")
    add_verbose_option(parser)


def gate_settings(args: argparse.Namespace) -> GateSettings:
    """Everything the options say, validated before any heavy work starts."""
    policy, policy_path = load_gate_policy(args.policy)
    names = [n.strip() for n in args.eval_sets.split(",") if n.strip()] if args.eval_sets else None
    return GateSettings(
        eval_sets=select_eval_sets(names), policy=policy, policy_path=policy_path,
        serve=ServeSettings(max_model_len=args.max_model_len),
        registry_path=None if args.no_registry else args.registry,
    )


def print_outcome(outcome: RunOutcome, as_json: bool) -> int:
    def render(result: RunOutcome) -> None:
        render_console(load_report(result.gate_json))
        registry = f", registry version {result.registry_version}" if result.registry_version is not None else ""
        unverified = "" if result.verified else " [UNVERIFIED artifact: no manifest.json; not registered]"
        progress(f"verdict: {result.verdict.upper()} (exit {result.exit_code}){registry}{unverified}; evidence in {result.run_dir}")

    emit(outcome, as_json=as_json, render=render)
    return outcome.exit_code


def recipe_name_for(artifact: Path, option: str | None) -> str:
    """The recipe name (policy overrides, the run folder's name): --recipe-name, else the manifest's
    `recipe`, else the artifact folder's name; whichever it is must be a safe path component."""
    if option is not None:
        return safe_component(option, "--recipe-name")
    manifest = artifact / MANIFEST_NAME
    if manifest.exists():
        recipe = read_manifest_json(manifest)[0].get("recipe")  # malformed: InputError naming manifest.json
        if recipe:
            return safe_component(recipe, "recipe", file=manifest)
    return safe_component(artifact.name, "--artifact (folder name; or give --recipe-name)", file=artifact)


def handle(args: argparse.Namespace) -> int:
    try:
        artifact, baseline = args.artifact.resolve(), args.baseline.resolve()
    except (OSError, ValueError) as error:
        raise InputError(f"not a usable path ({error})", field="--artifact/--baseline") from None
    recipe_name = recipe_name_for(artifact, args.recipe_name)
    job = GateJob(
        artifact_dir=artifact, baseline_dir=baseline, recipe_name=recipe_name,
        settings=gate_settings(args), allow_unverified=args.allow_unverified,
    )
    with library_output_on_stderr(verbose=args.verbose):
        outcome = run_gate(job)
    return print_outcome(outcome, args.json)


def register(subparsers) -> None:
    parser = subparsers.add_parser("gate", help="gate an existing artifact against its 16-bit baseline")
    parser.add_argument("--artifact", type=Path, required=True, help="quantized model folder (compressed-tensors)")
    parser.add_argument("--baseline", type=Path, required=True, help="the 16-bit source model folder")
    parser.add_argument("--recipe-name", help="name used for policy overrides and the run folder (default: from manifest.json)")
    parser.add_argument(
        "--allow-unverified", action="store_true",
        help="gate an artifact that has no manifest.json (its files cannot be verified); it is reported as unverified and never registered",
    )
    add_gate_options(parser)
    parser.set_defaults(handler=handle)
