"""`quantize repair RUN_ID`: repair a rejected run (docs/repair.md); also the options `quantize --repair` shares.

Exit 0: a passing artifact was found (its recipe is repaired.yaml in the repair folder); 1: the budget ran out
(or the ladder did) with the closest attempt and why it failed; 2: an error (an unknown run id, a run that is
not a rejection, a budget of 0, a ladder rung no kernel serves, ... : one line).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.commands.args import float_arg, int_arg
from pipelines.commands.common import library_output_on_stderr, print_outcome
from pipelines.console.capture import add_verbose_option
from pipelines.console.output import console, emit, progress, table
from pipelines.hardware.targets import installed_target
from pipelines.quantize.calibration import check_calibration_source
from pipelines.recipe import Recipe
from pipelines.registry.store import default_registry_path
from pipelines.repair.ladder import calibration_available, load_ladder
from pipelines.repair.objective import OBJECTIVE_HELP, OBJECTIVES
from pipelines.repair.parent import load_parent
from pipelines.repair.result import RepairResult
from pipelines.repair.search import Budget
from pipelines.repair.sensitivity import SensitivitySettings
from pipelines.repair.session import RepairOptions, check_objective, repair
from pipelines.runs.runner import GateSettings, RunOutcome
from pipelines.settings import current


def add_repair_options(parser: argparse.ArgumentParser) -> None:
    """The search's budget and inputs (`quantize repair` and `quantize --recipe ... --repair`)."""
    defaults, sensitivity = Budget(), SensitivitySettings()
    parser.add_argument("--repair-budget", type=int_arg(1, 1000), default=defaults.max_gates, metavar="GATES",
                        help="full gates (quantize, serve, score, gate) the repair may run (default: %(default)s)")
    parser.add_argument("--repair-time", type=float_arg(0, 30 * 24 * 3600, low_open=True), default=defaults.max_wall_s, metavar="SECONDS",
                        help="wall time of the whole repair; no gate starts that the slowest so far would not finish in (default: %(default)s)")
    parser.add_argument("--ladder", type=Path, help="fallback ladder file (default: recipes/ladders/<serve target>.yaml)")
    parser.add_argument("--kl-prompts", type=int_arg(4, 4096), default=sensitivity.prompts,
                        help="reference paths the sensitivity KL is measured on (default: %(default)s)")
    parser.add_argument("--kl-top", type=int_arg(1, 100_000), default=sensitivity.kl_top,
                        help="modules whose KL is measured, the proxy's top (default: %(default)s)")
    parser.add_argument("--objective", choices=OBJECTIVES, default=RepairOptions().objective,
                        help=f"{OBJECTIVE_HELP}; speed needs the load test (default: %(default)s)")


def repair_options(args: argparse.Namespace) -> RepairOptions:
    return RepairOptions(
        budget=Budget(max_gates=args.repair_budget, max_wall_s=args.repair_time), ladder=args.ladder,
        sensitivity=SensitivitySettings(prompts=args.kl_prompts, kl_top=args.kl_top), objective=args.objective,
    )


def check_ladder(args: argparse.Namespace, recipe: Recipe | None = None) -> None:
    """A bad ladder file fails before any work (a rung no kernel serves is refused here; with `recipe`, the rejected
    run's, so is a rung that needs calibration data the repair will not have)."""

    calibrated = recipe is None or calibration_available(recipe, args.calibration)
    load_ladder(args.ladder, installed_target(), calibrated=calibrated)


def check_repair_inputs(args: argparse.Namespace, recipe: Recipe, settings: GateSettings) -> None:
    """`quantize --recipe ... --repair`: the ladder and the objective checked before quantizing (speed needs the load test)."""
    check_ladder(args, recipe)
    check_objective(args.objective, settings, recipe.identity)


def render(result: RepairResult) -> None:
    rows = [
        [str(a.number), a.recipe_name, str(len(a.modules_moved)), f"{(a.measured_weight_bytes or a.weight_bytes) / 2**20:.2f}",
         f"{a.predicted_kl:.3g}", "PASS" if a.verdict == "promoted" else "fail", a.contender().ratio_text(),
         "; ".join(a.failed_rules[:4]) + (" ..." if len(a.failed_rules) > 4 else "")]
        for a in result.attempts
    ]
    console.print(table(f"repair of {result.parent['recipe']} (run {result.parent['run_id']}): {result.status}",
                        ["#", "proposal", "modules moved", "MiB", "simulated KL", "verdict", "throughput ratio", "failed rules"], rows))
    for note in result.choice.notes if result.choice else []:
        progress(f"objective {result.objective}: {note}")
    if result.found:
        progress(f"repaired: {result.found.recipe_file} ({result.found.modules_moved} module(s) moved, "
                 f"{result.found.weight_bytes / 2**20:.2f} MiB); report {result.report_md}")
    elif result.closest:
        progress(f"no proposal passed ({result.status}); closest: attempt {result.closest['attempt']}, failed "
                 f"{'; '.join(result.closest['failed_rules'])}; report {result.report_md}")
    else:
        progress(f"no proposal was gated ({result.status}); report {result.report_md}")


def emit_result(result: RepairResult, as_json: bool) -> int:
    emit(result, as_json=as_json, render=lambda _: render(result))
    return result.exit_code


def repair_after(outcome: RunOutcome, settings: GateSettings, args: argparse.Namespace) -> int:
    """`quantize --recipe ... --repair` after a rejection: the rejected run is repaired with the same settings.
    --json prints one document: {"run": the rejected run's outcome, "repair": repair.json, "exit_code"}."""

    # The run this process has just made: nothing read back from it can have been edited by anyone else yet.
    parent = load_parent(outcome.run_dir.name, outcome.run_dir.parent, registry_path=settings.registry_path,
                         calibration=args.calibration, loadtest=settings.loadtest, allow_unverified=True)
    if not args.json:
        print_outcome(outcome, as_json=False)
    with library_output_on_stderr(verbose=args.verbose):
        result = repair(parent, repair_options(args))
    emit({"run": outcome, "repair": result, "exit_code": result.exit_code}, as_json=args.json, render=lambda _: render(result))
    return result.exit_code


def handle(args: argparse.Namespace) -> int:

    options = repair_options(args)
    check_ladder(args)
    registry = None if args.no_registry else args.registry
    parent = load_parent(args.run_id, current().runs_dir, registry_path=registry, calibration=args.calibration, loadtest=not args.no_loadtest,
                         allow_unverified=args.allow_unverified, recorded_in=args.registry)
    if args.calibration is not None:

        check_calibration_source(args.calibration, parent.settings.eval_sets)  # a bad --calibration fails before any work
    with library_output_on_stderr(verbose=args.verbose):
        result = repair(parent, options)
    return emit_result(result, args.json)


def register(subparsers) -> None:
    parser = subparsers.add_parser("repair")  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("run_id", metavar="RUN_ID", help="a rejected run: its folder name under artifacts/runs")
    add_repair_options(parser)
    parser.add_argument("--registry", type=Path, default=default_registry_path(),
                        help="registry database (default: %(default)s; env QUANTGATE_REGISTRY)")
    parser.add_argument("--no-registry", action="store_true", help="gate and report, but do not write the registry")
    parser.add_argument("--no-loadtest", action="store_true", help="skip the load test after a passing quality gate")
    parser.add_argument("--calibration", metavar="SOURCE",
                        help="calibration data for proposals that calibrate (GPTQ rungs, static scales) when the rejected recipe "
                             "recorded none: as `quantize --calibration` (default: the recipe's, else the calibration set)")
    parser.add_argument(
        "--allow-unverified", action="store_true",
        help="repair a run the registry does not know (its gate.json and manifest.json cannot be checked against recorded hashes)",
    )
    parser.add_argument("--json", action="store_true", help="print repair.json's content on stdout")
    add_verbose_option(parser)
    parser.set_defaults(handler=handle)
