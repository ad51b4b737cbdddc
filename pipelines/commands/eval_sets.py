"""`quantize eval-sets list|validate`: the business eval sets under eval_sets/ and their state."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.errors import InputError
from pipelines.evalsets import CalibrationSet, EvalSet, set_folders, validate_folder
from pipelines.output import emit, say, table
from pipelines.paths import EVAL_SETS_DIR


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval-sets")  # its summary: pipelines.cli.COMMANDS
    actions = parser.add_subparsers(dest="eval_sets_action", metavar="ACTION", required=True)
    for name, handler, text in (
        ("list", list_sets, "list the eval sets and calibration sets"),
        ("validate", validate_sets, "check every set: YAML keys, data lines, fields the prompts need"),
    ):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("--root", type=Path, default=EVAL_SETS_DIR, help="folder of sets (default: eval_sets/)")
        sub.add_argument("--json", action="store_true", help="print JSON on stdout")
        sub.set_defaults(handler=handler)


def _row(found: EvalSet | CalibrationSet) -> dict:
    return {
        "name": found.name,
        "type": found.output_type if isinstance(found, EvalSet) else "calibration",
        "items": found.num_items,
        "sha256": found.sha256,
        "data": str(found.data),
    }


def _render(rows: list[dict]) -> None:
    say(
        table(
            None,
            ["name", "type", "items", "hash", "status"],
            [[r["name"], r.get("type", "?"), r.get("items", "?"), r.get("sha256", "")[:12], r["status"]] for r in rows],
        )
    )


def list_sets(args: argparse.Namespace) -> int:
    rows = [{**_row(validate_folder(folder)), "status": "ok"} for folder in set_folders(args.root)]
    emit(rows, as_json=args.json, render=_render)
    return 0


def validate_sets(args: argparse.Namespace) -> int:
    """Checks every set and shows them all; the first broken one is then raised (one line, exit 2).

    With --json and a broken set, stdout carries one document: the error object, with every set's row
    under "sets"."""
    rows, errors = [], []
    for folder in set_folders(args.root):
        try:
            rows.append({**_row(validate_folder(folder)), "status": "ok"})
        except InputError as error:
            errors.append(error)
            rows.append({"name": folder.name, "status": "error", "error": error.one_line()})
    if errors:
        if args.json:
            errors[0].details = {"sets": rows}  # cli.main prints it inside the JSON error object
        else:
            _render(rows)
        raise errors[0]
    emit(rows, as_json=args.json, render=_render)
    return 0
