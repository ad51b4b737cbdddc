"""What several commands share: the gate options (run and gate), their settings, printing an outcome,
and keeping library output off the terminal while the work runs (run, gate, job, models)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.bounds import MAX_CONTEXT
from pipelines.commands.args import eval_set_names, int_arg
from pipelines.console.capture import add_verbose_option, library_output_to_log
from pipelines.console.output import emit, progress
from pipelines.evaluation.evalsets import select_eval_sets
from pipelines.gate.policy import check_attainable, load_gate_policy
from pipelines.gate.report import render_console
from pipelines.registry.store import default_registry_path
from pipelines.runs.runner import GateSettings, RunOutcome
from pipelines.serve.serving import ServeSettings


@contextmanager
def library_output_on_stderr(verbose: bool | None = None) -> Iterator[Path | None]:
    """While the work runs, library output (llm-compressor's loguru sink, transformers warnings, tqdm bars,
    C code writing to fd 1/2, lm-eval's logging) goes to a log file under artifacts/logs (and each run's
    own part to its run folder's library.log), while the product's progress stays on the terminal; stdout
    carries only the result printed afterwards (the table, or the JSON document of --json).

    verbose (default: whether --verbose was given): library output stays on stderr, as it comes."""
    with library_output_to_log(verbose=verbose) as log_path:
        yield log_path


def add_gate_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by `quantize --recipe` and `quantize gate`."""
    parser.add_argument("--eval-sets", help="comma-separated eval set names (default: every set under eval_sets/)")
    parser.add_argument("--policy", type=Path, help="gate policy YAML (default: policies/default.yaml)")
    parser.add_argument("--registry", type=Path, default=default_registry_path(),
                        help="registry database (default: %(default)s; env QUANTGATE_REGISTRY)")
    parser.add_argument("--no-registry", action="store_true", help="decide and report, but do not write the registry")
    parser.add_argument("--max-model-len", type=int_arg(1, MAX_CONTEXT), default=ServeSettings().max_model_len, help="vLLM max model length")
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON on stdout")
    parser.add_argument(
        "--no-loadtest", action="store_true",
        help="skip the load test after a promoted quality gate (the policy's performance.enabled: false does the same)",
    )
    add_verbose_option(parser)


def gate_settings(args: argparse.Namespace) -> GateSettings:
    """Everything the options say, validated before any heavy work starts."""
    policy, policy_path = load_gate_policy(args.policy)
    names = eval_set_names(args.eval_sets)
    eval_sets = select_eval_sets(names)
    # A policy the selected sets cannot meet is refused now (exit 2), not after quantizing and serving.
    check_attainable(policy, eval_sets, getattr(args, "recipe", None), file=policy_path)
    return GateSettings(
        eval_sets=eval_sets, policy=policy, policy_path=policy_path,
        serve=ServeSettings(max_model_len=args.max_model_len),
        registry_path=None if args.no_registry else args.registry, loadtest=not args.no_loadtest,
    )


def print_outcome(outcome: RunOutcome, as_json: bool) -> int:
    def render(result: RunOutcome) -> None:
        render_console(result.gate_report())
        registry = f", registry version {result.registry_version}" if result.registry_version is not None else ""
        unverified = "" if result.verified else " [UNVERIFIED artifact: no manifest.json; not registered]"
        progress(f"verdict: {result.verdict.upper()} (exit {result.exit_code}){registry}{unverified}; evidence in {result.run_dir}")

    emit(outcome, as_json=as_json, render=render)
    return outcome.exit_code
