"""`quantize --recipe NAME`: the whole job on one model: quantize, serve, score, gate, promote."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.commands.gate import add_gate_options, gate_job, print_outcome
from pipelines.paths import DEMO_MODEL_DIR
from pipelines.runner import run_gate


def handle(args: argparse.Namespace) -> int:
    from pipelines.quantize import quantize_model  # heavy (torch, llm-compressor): only when quantizing

    # Fail on a bad policy / eval set name before spending minutes quantizing.
    gate_job(args, artifact=args.model, baseline=args.model, recipe_name=args.recipe)
    result = quantize_model(args.recipe, args.model.resolve(), force=args.force)
    manifest = result.manifest
    job = gate_job(
        args, artifact=result.artifact_dir, baseline=args.model, recipe_name=manifest.recipe_name,
        stages=dict(manifest.stages) if not result.reused else {"quantize_s": 0.0},
        inputs={"recipe_sha256": manifest.recipe_sha256, "quantize_reused": result.reused},
    )
    return print_outcome(run_gate(job), args.json)


def register(subparsers) -> None:
    parser = subparsers.add_parser("run", help="quantize, serve, score and gate one model with one recipe (the default command)")
    parser.add_argument("--recipe", required=True, help="a shipped recipe (w8a8, w4a16, gptq, aggressive) or a YAML path")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="16-bit source model folder (default: the demo model)")
    parser.add_argument("--force", action="store_true", help="re-quantize even if an identical artifact exists")
    add_gate_options(parser)
    parser.set_defaults(handler=handle)
