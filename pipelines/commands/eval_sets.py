"""`quantize eval-sets list|validate|power`: the business eval sets under eval_sets/, their state, and what the
gate policy's tolerances need of their size."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.commands.args import comma_list, eval_set_names
from pipelines.console.output import emit, say, table
from pipelines.errors import InputError
from pipelines.evaluation.evalsets import CalibrationSet, EvalSet, discover_eval_sets, select_eval_sets, set_folders, validate_folder
from pipelines.files.safepath import MAX_COMPONENT, safe_component
from pipelines.gate.policy import load_gate_policy
from pipelines.gate.power import GUARANTEES, power_rows, whole_run_rows
from pipelines.gate.price import SECONDS, price_rows
from pipelines.paths import EVAL_SETS_DIR
from pipelines.recipe import RecipeIdentity, load_recipe, resolve_recipe_path
from pipelines.settings import current as current_settings

POWER_DISCORDANCES = (0.02, 0.04, 0.1)
MAX_RECIPE_NAME = 64  # pipelines.recipe.Recipe's name
MAX_DISCORDANCES = 16  # each is an exact sum over every 2x2 table of every set: seconds, not minutes
MAX_PRICE_SECONDS = 60.0  # per set: the unchanged candidate's simulation


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval-sets")  # its summary: pipelines.cli.COMMANDS
    actions = parser.add_subparsers(dest="eval_sets_action", metavar="ACTION", required=True)
    for name, handler, text in (
        ("list", list_sets, "list the eval sets and calibration sets"),
        ("validate", validate_sets, "check every set: YAML keys, data lines, fields the prompts need"),
        ("power", power_sets, "per set: the tolerance its size can certify and the items the policy's tolerance needs"),
    ):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("--root", type=Path, default=EVAL_SETS_DIR, help="folder of sets (default: eval_sets/)")
        sub.add_argument("--json", action="store_true", help="print JSON on stdout")
        sub.set_defaults(handler=handler)
        if name == "power":
            sub.add_argument("--eval-sets", help="comma-separated eval set names (default: every set)")
            sub.add_argument("--policy", type=Path, help="gate policy YAML (default: policies/default.yaml)")
            sub.add_argument("--recipe", help="recipe name whose policy overrides apply (default: none)")
            sub.add_argument("--discordance", default=",".join(str(d) for d in POWER_DISCORDANCES),
                             help="comma-separated shares of items the candidate may answer differently (default: %(default)s)")
            sub.add_argument("--baseline-score", type=float, default=0.8,
                             help="baseline accuracy assumed for the whole-run false-rejection figure (default: %(default)s)")
            sub.add_argument("--price-seconds", type=float, default=SECONDS,
                             help="per set, the time the unchanged candidate's simulation may take (default: %(default)s)")


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


def _fractions(text: str, option: str) -> list[float]:
    parts = comma_list(text, option, max_items=MAX_DISCORDANCES) or []
    shown = text if len(text) <= 80 else text[:77] + "..."
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise InputError(f"not a comma-separated list of numbers: {shown!r}", field=option) from None
    if not values or not all(0.0 <= value <= 1.0 for value in values):
        raise InputError(f"each value must lie in [0, 1] (got {shown!r})", field=option)
    return values


def recipe_identity(text: str | None) -> RecipeIdentity | None:
    """--recipe: a shipped recipe or a recipe YAML (its name, base and tags are what the policy's overrides match), or the
    bare name of a recipe quantized elsewhere; anything else (a path to another file, a name no recipe can have) is
    refused naming the option."""
    if text is None:
        return None
    if len(text) <= MAX_COMPONENT and (Path(text).suffix in (".yaml", ".yml") or resolve_recipe_path(text).is_file()):
        return load_recipe(text).recipe.identity
    return RecipeIdentity(name=safe_component(text, "--recipe", max_length=MAX_RECIPE_NAME))


def power_sets(args: argparse.Namespace) -> int:
    """`quantize eval-sets power`: sizing against the policy, before any model is served (docs/gate-json.md, "Sizing")."""

    discordances = _fractions(args.discordance, "--discordance")
    if not 0.0 < args.baseline_score < 1.0:
        raise InputError(f"must lie in (0, 1) (got {args.baseline_score})", field="--baseline-score")
    if not 0.0 < args.price_seconds <= MAX_PRICE_SECONDS:
        raise InputError(f"must lie in (0, {MAX_PRICE_SECONDS:g}] (got {args.price_seconds})", field="--price-seconds")
    names = eval_set_names(args.eval_sets)
    recipe = recipe_identity(args.recipe)
    found = discover_eval_sets(args.root)
    if not names and found.broken:  # sizing every set: one that does not validate is an error, never left out of the table
        raise next(iter(found.broken.values()))
    eval_sets = select_eval_sets(names, found)
    policy, policy_path = load_gate_policy(args.policy)
    prices = price_rows(eval_sets, policy, recipe, args.baseline_score, current_settings().baseline_cache_dir, seconds=args.price_seconds)
    document = {
        "policy": str(policy_path), "recipe": recipe.name if recipe else None,
        "sets": [row | prices[row["name"]] for row in power_rows(eval_sets, policy, recipe, discordances)],
        "whole_run": whole_run_rows(eval_sets, policy, recipe, discordances, args.baseline_score),
        "baseline_score": args.baseline_score,
    }
    emit(document, as_json=args.json, render=_render_power)
    return 0


def _render_power(document: dict) -> None:
    sets = document["sets"]
    discordances = [entry["discordance"] for entry in document["whole_run"]]
    columns = ["name", "metric", "items", "tolerance", "identical needs"] + [
        f"psi {psi:g}: certifies / needs / P(promote at T)" for psi in discordances]
    rows = []
    for row in sets:
        unit = "" if row["tolerance_kind"] == "points" else " (relative)"
        cells = [
            row["name"], row["metric"], str(row["items"]), "-" if row["tolerance"] is None else f"{row['tolerance']:g}{unit}",
            "-" if row["identical_items_needed"] is None else str(row["identical_items_needed"]),
        ]
        by = {entry["discordance"]: entry for entry in row["by_discordance"]}
        for psi in discordances:
            entry = by.get(psi)
            needed = "-" if entry is None or entry["items_needed"] is None else str(entry["items_needed"])
            rate = "-" if entry is None or entry["promote_at_tolerance"] is None else f"{entry['promote_at_tolerance']:.1%}"
            cells.append("-" if entry is None else f"{entry['certifies']:.2f} / {needed} / {rate}")
        rows.append(cells)
    say(table(f"Sizing against {document['policy']} (one-sided bounds; an unchanged candidate passing 80% of the time; P(promote at "
              f"T): a true worsening of the tolerance, worst split, multinomial model, exact)", columns, rows))
    _render_price(sets)
    for row in sets:
        if row["refused"]:
            say(f"refused at load: {row['refused']}")
    for kind in sorted({row["kind"] for row in sets}):
        say(f"guarantee ({kind} sets): {GUARANTEES[kind]}")
    for entry in document["whole_run"]:
        say(f"unchanged candidate, discordance {entry['discordance']:g}, baseline {document['baseline_score']:.0%}: rejected by at least "
            f"one of the {entry['sets']} pass/fail sets {entry['reject_probability']:.1%} of the time")


def _render_price(sets: list[dict]) -> None:
    """Each rule's price per set (docs/guarantees.md, "Price"): its bound's width against normal theory at the same
    one-sided level, and how often an unchanged candidate passes, at the noise the set shows."""
    rows = []
    for row in sets:
        for entry in row["price"]:
            ratio, rate = entry["width_ratio"], entry["unchanged_pass_rate"]
            how = "exact" if entry["method"] == "exact" else f"{entry['reps']} draws, se {entry['unchanged_pass_rate_se']:.1%}"
            rows.append([row["name"], str(entry["n"]), entry["noise"]["source"], entry["noise"]["label"],
                         "-" if ratio is None else f"{ratio:.2f}x", entry["method"] if rate is None else f"{rate:.1%} ({how})"])
    if rows:
        say(table("Price (width: the bound less the estimate, over normal theory's z(c) se; unchanged: an unchanged candidate's "
                  "pass rate)", ["name", "n", "noise", "noise level", "width", "unchanged passes"], rows))
