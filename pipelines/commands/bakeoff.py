"""`quantize bakeoff --recipes gptq,w4a16 [--backends llm-compressor,gptqmodel,bitsandbytes] [--model DIR] [gate options]
[--json]`: one intent through every quantize backend on the same sets, policy and cached baseline; one table, one plot
(pipelines/bakeoff, docs/backends.md). Exit 0: a row passed; 1: none passed and the gate rejected one; 2: an error, or
no row could be gated (every one refused or failed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.bakeoff.loop import run_bakeoff
from pipelines.bakeoff.plan import BACKENDS, MAX_RECIPES, parse_backends, plan_bakeoff
from pipelines.bakeoff.records import Bakeoff
from pipelines.bakeoff.table import COLUMNS, cells
from pipelines.commands.args import comma_list
from pipelines.commands.common import add_gate_options, gate_settings, library_output_on_stderr
from pipelines.console.output import console, emit, progress, say, table
from pipelines.errors import InputError
from pipelines.paths import DEMO_MODEL_DIR

REGISTRY_OPTIONS = ("registry", "no_registry")


def handle(args: argparse.Namespace) -> int:
    if args.registry is not None:
        raise InputError("a bake-off compares and never registers: promote the row you choose with `quantize --recipe` "
                         "and its recipe file from the bake-off's recipes/ folder", field="--registry")
    try:
        model = args.model.resolve()
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop
        raise InputError(f"not a usable path ({error})", file=args.model, field="--model") from None
    given = None if args.backends is None else comma_list(args.backends, "--backends", max_items=len(BACKENDS) * 4) or []
    backends = parse_backends(given)
    recipes = comma_list(args.recipes, "--recipes", max_items=MAX_RECIPES) or []
    plan = plan_bakeoff(recipes, backends, model, gate_settings(args))  # every bad input fails here, before any row
    progress(f"bake-off: {len(plan.rows)} row(s): {', '.join(row.label for row in plan.rows)}")
    with library_output_on_stderr(verbose=args.verbose):
        bakeoff = run_bakeoff(plan)
    emit(bakeoff, as_json=args.json, render=_render)
    return bakeoff.exit_code


def _render(bakeoff: Bakeoff) -> None:
    console.print(table(f"bake-off: {bakeoff.model}: {len(bakeoff.rows)} row(s) in {bakeoff.wall_s:.0f} s", COLUMNS[:-1],
                        [cells(row)[:-1] for row in bakeoff.rows]))
    for row in bakeoff.rows:  # the reason column, one line each: vLLM's refusals are too long for a cell
        if row.reason:
            say(f"row {row.index} ({row.label}): {row.status}: {row.reason}")
    for line in bakeoff.conclusions:
        say(line)
    say(f"bakeoff.json, bakeoff.md, bakeoff.png and each gated row's recipe in {bakeoff.folder} (exit {bakeoff.exit_code})")


def _without_registry(parser: argparse.ArgumentParser) -> None:
    """The gate options' --registry and --no-registry: a bake-off never registers (hidden from --help; --registry refused)."""
    for action in parser._actions:
        if action.dest in REGISTRY_OPTIONS:
            action.help = argparse.SUPPRESS
    parser.set_defaults(registry=None, no_registry=True)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bakeoff")  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("--recipes", required=True,
                        help="comma-separated recipes, each run through every backend (shipped names such as gptq,w4a16, or YAML paths)")
    parser.add_argument("--backends", default=None,
                        help=f"comma-separated backends (default: all: {','.join(BACKENDS)}); a recipe that names a backend outside "
                             "them runs once, on its own")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="16-bit source model folder (default: the demo model)")
    add_gate_options(parser)
    _without_registry(parser)
    parser.set_defaults(handler=handle)
