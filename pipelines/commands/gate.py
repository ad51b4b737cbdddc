"""`quantize gate --artifact PATH --baseline MODEL`: gate an artifact quantized elsewhere (the CI/CD case)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipelines.gate import load_report
from pipelines.output import emit, progress
from pipelines.registry import default_registry_path
from pipelines.report import render_console
from pipelines.runner import GateJob, GateSettings, RunOutcome, load_gate_policy, run_gate, select_eval_sets
from pipelines.serving import ServeSettings


@contextmanager
def library_output_on_stderr() -> Iterator[None]:
    """While the work runs, file descriptor 1 points at stderr: libraries writing to stdout (llm-compressor's
    loguru sink, C code) land beside the progress lines, and stdout carries only the result (the table,
    or the JSON document that --json prints afterwards)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def add_gate_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by `quantize --recipe` and `quantize gate`."""
    parser.add_argument("--eval-sets", help="comma-separated eval set names (default: every set under eval_sets/)")
    parser.add_argument("--policy", type=Path, help="gate policy YAML (default: policies/default.yaml)")
    parser.add_argument("--registry", type=Path, default=default_registry_path(), help="registry database (default: %(default)s; env QUANTGATE_REGISTRY)")
    parser.add_argument("--no-registry", action="store_true", help="decide and report, but do not write the registry")
    parser.add_argument("--max-model-len", type=int, default=ServeSettings().max_model_len, help="vLLM max model length")
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON on stdout")


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
        progress(f"verdict: {result.verdict.upper()} (exit {result.exit_code}){registry}; evidence in {result.run_dir}")

    emit(outcome, as_json=as_json, render=render)
    return outcome.exit_code


def _recipe_name_of(artifact: Path) -> str:
    manifest = artifact / "manifest.json"
    if manifest.is_file():
        recipe = json.loads(manifest.read_text()).get("recipe")
        if isinstance(recipe, str) and recipe:
            return recipe
    return artifact.name


def handle(args: argparse.Namespace) -> int:
    recipe_name = args.recipe_name or _recipe_name_of(args.artifact)
    job = GateJob(
        artifact_dir=args.artifact.resolve(), baseline_dir=args.baseline.resolve(), recipe_name=recipe_name,
        settings=gate_settings(args),
    )
    with library_output_on_stderr():
        outcome = run_gate(job)
    return print_outcome(outcome, args.json)


def register(subparsers) -> None:
    parser = subparsers.add_parser("gate", help="gate an existing artifact against its 16-bit baseline")
    parser.add_argument("--artifact", type=Path, required=True, help="quantized model folder (compressed-tensors)")
    parser.add_argument("--baseline", type=Path, required=True, help="the 16-bit source model folder")
    parser.add_argument("--recipe-name", help="name used for policy overrides (default: from manifest.json)")
    add_gate_options(parser)
    parser.set_defaults(handler=handle)
