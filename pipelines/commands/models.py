"""`quantize models add NAME [--gguf FILE] [--force] | list`: real pretrained models under models/, offline."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.commands.common import library_output_on_stderr
from pipelines.console.output import console, emit, progress, table
from pipelines.models.catalog import AddResult, ModelInfo, add_model, list_models
from pipelines.paths import MODELS_DIR


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models")  # its summary: pipelines.cli.COMMANDS
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION", required=True)

    add = actions.add_parser(
        "add",
        help="convert a GGUF into a 16-bit model folder models/NAME/ (a complete folder is left alone)",
        description="Convert a GGUF (llama.cpp architectures llama, qwen2, qwen3, gemma2, gemma3, phi3) into the bf16 HF "
        "folder the pipeline quantizes and serves; its tokenizer is checked against the GGUF's own vocabulary (and "
        "rebuilt from it when transformers' conversion is wrong). NAME is a catalogue model (smollm2-135m, gemma3-270m) "
        "or any name with --gguf FILE.",
    )
    add.add_argument("name", help="model name: a catalogue model (smollm2-135m, gemma3-270m) or your own with --gguf")
    add.add_argument("--gguf", type=Path, help="a local GGUF file (llama, qwen2, qwen3, gemma2, gemma3 or phi3)")
    add.add_argument("--force", action="store_true", help="convert again and replace an existing folder")
    add.add_argument("--models-dir", type=Path, default=MODELS_DIR, help="where model folders live (default: models/)")
    add.add_argument("--json", action="store_true", help="print JSON on stdout")
    add.set_defaults(handler=handle_add)

    listing = actions.add_parser("list", help="model folders under models/ and catalogue models not added yet")
    listing.add_argument("--models-dir", type=Path, default=MODELS_DIR, help="where model folders live (default: models/)")
    listing.add_argument("--json", action="store_true", help="print JSON on stdout")
    listing.set_defaults(handler=handle_list)


def _mib(size: int | None) -> str:
    return "" if size is None else f"{size / 2**20:.1f} MiB"


def _render_add(result: AddResult) -> None:
    if result.status == "present":
        progress(f"{result.path} is already there (from {result.source}); nothing done (--force converts again)")
    console.print(
        table(None, ["name", "status", "parameters", "size", "source", "path"],
              [[result.name, result.status, f"{result.parameters:,}" if result.parameters else "", _mib(result.bytes), result.source, result.path]])
    )


def handle_add(args: argparse.Namespace) -> int:
    with library_output_on_stderr():
        result = add_model(args.name, gguf_file=args.gguf, force=args.force, models_dir=args.models_dir)
    emit(result, as_json=args.json, render=_render_add)
    return 0


def _render_list(rows: list[ModelInfo]) -> None:
    console.print(
        table(None, ["name", "state", "architecture", "layers", "hidden", "parameters", "size", "source"], [
            [m.name, "ready" if m.present else "not added", m.architecture, m.layers, m.hidden,
             f"{m.parameters:,}" if m.parameters else None, _mib(m.bytes), m.source]
            for m in rows
        ])
    )


def handle_list(args: argparse.Namespace) -> int:
    emit(list_models(args.models_dir), as_json=args.json, render=_render_list)
    return 0
