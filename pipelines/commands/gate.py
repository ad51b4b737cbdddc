"""`quantize gate --artifact PATH --baseline MODEL`: gate an artifact quantized elsewhere (the CI/CD case)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.artifact import MANIFEST_NAME, manifest_recipe
from pipelines.commands.common import add_gate_options, gate_settings, library_output_on_stderr, print_outcome
from pipelines.errors import InputError
from pipelines.files.safepath import safe_component
from pipelines.gate.policy import check_attainable
from pipelines.runs.runner import GateJob, run_gate


def recipe_name_for(artifact: Path, option: str | None) -> str:
    """The recipe name (policy overrides, the run folder's name): --recipe-name, else the manifest's
    `recipe`, else the artifact folder's name; whichever it is must be a safe path component."""
    if option is not None:
        return safe_component(option, "--recipe-name")
    recipe = manifest_recipe(artifact)  # malformed: InputError naming manifest.json
    if recipe:
        return safe_component(recipe, "recipe", file=artifact / MANIFEST_NAME)
    return safe_component(artifact.name, "--artifact (folder name; or give --recipe-name)", file=artifact)


def handle(args: argparse.Namespace) -> int:
    try:
        artifact, baseline = args.artifact.resolve(), args.baseline.resolve()
    except (OSError, RuntimeError, ValueError) as error:  # RuntimeError: a symlink loop
        raise InputError(f"not a usable path ({error})", field="--artifact/--baseline") from None
    recipe_name = recipe_name_for(artifact, args.recipe_name)
    settings = gate_settings(args)
    # A policy the selected sets cannot meet (a set too small for its tolerance, a metric in its own unit without a
    # relative one) is exit 2 now, before any server starts: one line naming the policy file, the field, the set and n.
    check_attainable(settings.policy, settings.eval_sets, recipe_name, file=settings.policy_path)
    job = GateJob(
        artifact_dir=artifact, baseline_dir=baseline, recipe_name=recipe_name,
        settings=settings, allow_unverified=args.allow_unverified,
    )
    with library_output_on_stderr(verbose=args.verbose):
        outcome = run_gate(job)
    return print_outcome(outcome, args.json)


def register(subparsers) -> None:
    parser = subparsers.add_parser("gate")  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("--artifact", type=Path, required=True, help="quantized model folder (compressed-tensors)")
    parser.add_argument("--baseline", type=Path, required=True, help="the 16-bit source model folder")
    parser.add_argument("--recipe-name", help="name used for policy overrides and the run folder (default: from manifest.json)")
    parser.add_argument(
        "--allow-unverified", action="store_true",
        help="gate an artifact that has no manifest.json (its files cannot be verified); it is reported as unverified and never registered",
    )
    add_gate_options(parser)
    parser.set_defaults(handler=handle)
