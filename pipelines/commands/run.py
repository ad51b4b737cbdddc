"""`quantize --recipe NAME`: the whole job on one model: quantize, serve, score, gate, promote."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.commands.common import add_gate_options, gate_settings, library_output_on_stderr, print_outcome
from pipelines.commands.repair import add_repair_options, check_repair_inputs, repair_after
from pipelines.errors import InputError
from pipelines.paths import DEMO_MODEL_DIR
from pipelines.quantize.backends.specs import BACKENDS
from pipelines.quantize.calibration import check_calibration_source
from pipelines.recipe import FROM_EVAL_SETS, load_recipe, with_backend
from pipelines.runs.runner import quantize_and_gate


def handle(args: argparse.Namespace) -> int:
    try:
        model = args.model.resolve()
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop
        raise InputError(f"not a usable path ({error})", file=args.model, field="--model") from None
    settings = gate_settings(args)  # a bad policy or eval set name fails before minutes of quantizing
    extra = {}
    if args.calibration is not None:  # without it, the recipe's own calibration data (the call as it always was)

        check_calibration_source(args.calibration, settings.eval_sets)  # a bad --calibration fails before quantizing too
        extra["calibration"] = args.calibration
    recipe = load_recipe(args.recipe)
    if args.backend is not None:
        recipe = with_backend(recipe, args.backend)
    if args.repair:  # a bad ladder, budget or objective fails before quantizing too

        check_repair_inputs(args, recipe.recipe, settings)
    with library_output_on_stderr():
        outcome = quantize_and_gate(recipe, model, settings, force=args.force, **extra)
    if args.repair and outcome.verdict == "rejected":
        return repair_after(outcome, settings, args)
    return print_outcome(outcome, args.json)


def register(subparsers) -> None:
    parser = subparsers.add_parser("run")  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("--recipe", required=True, help="a shipped recipe (w8a8, w4a16, gptq, aggressive) or a YAML path")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="16-bit source model folder (default: the demo model)")
    parser.add_argument(
        "--calibration", metavar="DATA",
        help="calibration data instead of the recipe's: a folder with data.jsonl, a JSONL file of {\"text\": ...} lines, "
             f"or {FROM_EVAL_SETS} (the prompts of each scored set's held-out calibration.jsonl; docs/calibration.md)",
    )
    parser.add_argument("--backend", choices=list(BACKENDS),
                        help="the toolkit that quantizes, instead of the recipe's own (default llm-compressor; docs/backends.md)")
    parser.add_argument("--force", action="store_true", help="re-quantize even if an identical artifact exists")
    parser.add_argument("--repair", action="store_true",
                        help="when the gate rejects, search for the smallest artifact that passes (docs/repair.md; exit 0 found, 1 not)")
    add_repair_options(parser)
    add_gate_options(parser)
    parser.set_defaults(handler=handle)
