"""`quantize loadtest --model DIR [--artifact DIR]`: the load test on its own, with servers it starts itself.

With --artifact, the artifact is the candidate and --model its 16-bit baseline: both are served, swept and
compared as in a gate run (docs/loadtest.md); without it, --model alone is measured (figures, KV, memory,
measured tuning; no ratios). Results go to a run folder (`<runs>/<id>`: loadtest.json, loadtest.md, plots,
the tool's files) and to the terminal, or as JSON with --json. Exit 0 unless enforced checks fail (1: on a GPU
target, or with `enforce: always`); every error is exit 2, and no server outlives the command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.bounds import MAX_CONTEXT
from pipelines.commands.args import eval_set_names, float_arg, int_arg
from pipelines.commands.common import library_output_on_stderr
from pipelines.console.capture import add_verbose_option
from pipelines.console.output import emit, progress, say, table
from pipelines.errors import EXIT_OK, EXIT_REJECTED
from pipelines.loadtest.config import MAX_BUDGET_S, MAX_LEVEL
from pipelines.loadtest.render import console_tables
from pipelines.loadtest.verdict import inconclusive_error
from pipelines.runs.loadtest import options, run
from pipelines.serve.serving import ServeSettings


def handle(args: argparse.Namespace) -> int:
    chosen = options(  # bad input fails here, before a folder or a server exists
        args.model, args.artifact, policy_path=args.policy, concurrency=args.concurrency, repeats=args.repeats,
        eval_sets=eval_set_names(args.eval_sets), max_model_len=args.max_model_len, budget_s=args.budget_s,
    )
    with library_output_on_stderr(verbose=args.verbose):
        report, run_dir = run(chosen)

    def render(result: dict) -> None:
        console_tables(report, table, say)
        progress(f"load test evidence in {run_dir}")

    emit({"run_dir": str(run_dir), "performance": report}, as_json=args.json, render=render)
    undecided = inconclusive_error(report)
    if undecided is not None:  # enforced and undecided: an error, after the evidence is written and shown
        raise undecided
    return EXIT_REJECTED if report.reasons else EXIT_OK


def register(subparsers) -> None:
    parser = subparsers.add_parser("loadtest")  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("--model", type=Path, required=True, help="the 16-bit model folder (the baseline)")
    parser.add_argument("--artifact", type=Path, help="a quantized artifact to compare against --model (the candidate)")
    parser.add_argument("--eval-sets", help="comma-separated eval set names whose prompts make the load (default: every set)")
    parser.add_argument("--policy", type=Path, help="policy YAML whose performance block applies (default: policies/default.yaml)")
    parser.add_argument("--concurrency", type=int_arg(1, MAX_LEVEL), help="top of the sweep (default: the policy's)")
    parser.add_argument("--repeats", type=int_arg(1, 50), help="runs per model at each sweep level (default: the policy's)")
    parser.add_argument("--budget-s", type=float_arg(0, MAX_BUDGET_S, low_open=True),
                        help="seconds the paired comparison may take (default: the policy's performance.comparison.budget_s)")
    parser.add_argument("--max-model-len", type=int_arg(1, MAX_CONTEXT), default=ServeSettings().max_model_len, help="vLLM max model length")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    add_verbose_option(parser)
    parser.set_defaults(handler=handle)
