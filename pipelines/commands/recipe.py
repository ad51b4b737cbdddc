"""`quantize recipe list|show|validate`: the recipes and what they compile to for their backend (llm-compressor's
recipe, or another backend's configuration: docs/backends.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from pipelines.console.output import console, emit, say, table
from pipelines.hardware.targets import TARGET_HELP, ServeTarget, installed_target, parse_target
from pipelines.paths import DEMO_MODEL_DIR
from pipelines.quantize.backends.compile import compile_checked
from pipelines.quantize.backends.specs import BackendPlan
from pipelines.quantize.compiler import CompiledRecipe, kv_summary
from pipelines.quantize.layout import layout_from_model_dir
from pipelines.recipe import DEFAULT_BACKEND, load_recipe, shipped_recipes


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("recipe")  # its summary: pipelines.cli.COMMANDS
    actions = parser.add_subparsers(dest="recipe_action", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="the shipped recipes under recipes/")
    listing.add_argument("--json", action="store_true", help="print JSON on stdout")
    listing.set_defaults(handler=list_recipes)

    for name, handler, text in (
        ("show", show_recipe, "print what a recipe compiles to for a model: llm-compressor's recipe, or its backend's configuration"),
        ("validate", validate_recipe, "check a recipe against a model and vLLM's kernels (exit 0 ok, 2 not)"),
    ):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("recipe", help="a shipped recipe name (w8a8) or a YAML file")
        sub.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help=f"model folder (default: {DEMO_MODEL_DIR})")
        sub.add_argument("--target", metavar="TARGET",
                         help=f"the serve target whose vLLM kernels to check against: {TARGET_HELP} "
                              "(default: the installed serve environment's)")
        sub.add_argument("--json", action="store_true", help="print JSON on stdout")
        sub.set_defaults(handler=handler)


def list_recipes(args: argparse.Namespace) -> int:
    rows = []
    for name in shipped_recipes():
        loaded = load_recipe(name)
        recipe = loaded.recipe
        rows.append({
            "name": recipe.name, "file": str(loaded.path), "algorithm": recipe.algorithm.method, "description": recipe.description,
            "base": recipe.base, "tags": recipe.tags,
        })
    emit(rows, as_json=args.json, render=_render_list)
    return 0


def _render_list(rows: list[dict]) -> None:
    say(table(None, ["name", "algorithm", "description"], [[row["name"], row["algorithm"], row["description"]] for row in rows]))


def show_recipe(args: argparse.Namespace) -> int:
    compiled, plan = _compile(args)
    if plan is None:
        emit(compiled, as_json=args.json, render=lambda c: console.print(c.yaml, end="", markup=False))
    else:
        emit(plan, as_json=args.json, render=lambda p: console.print(yaml.safe_dump(p.model_dump(), sort_keys=False), end="", markup=False))
    return 0


def validate_recipe(args: argparse.Namespace) -> int:
    compiled, plan = _compile(args)
    result = {
        "recipe": compiled.recipe, "file": compiled.recipe_file, "model": str(args.model), "target": str(_target(args) or installed_target()),
        "valid": True, "backend": plan.backend if plan else DEFAULT_BACKEND, "backend_config": plan.config if plan else None,
        "layers": compiled.layers, "kv_cache": {**compiled.kv_cache.model_dump(), "summary": kv_summary(compiled.kv_cache)},
    }
    emit(result, as_json=args.json, render=_render_layers)
    return 0


def _compile(args: argparse.Namespace) -> tuple[CompiledRecipe, BackendPlan | None]:
    """Every check `quantize` makes before heavy work; bad input is named before the target is looked up."""
    loaded = load_recipe(args.recipe)
    layout = layout_from_model_dir(args.model)
    return compile_checked(loaded, layout, _target(args) or installed_target())


def _target(args: argparse.Namespace) -> ServeTarget | None:
    """--target, or None: the compiler then checks against the installed serve environment's."""
    return parse_target(args.target) if args.target else None


def _render_layers(result: dict) -> None:
    say(f"{result['file']}: valid for {result['model']} on {result['target']} (backend {result['backend']})")
    say(table(None, ["module", "scheme"], [[name, scheme] for name, scheme in result["layers"].items()]))
    say(f"KV cache: {result['kv_cache']['summary']}")
