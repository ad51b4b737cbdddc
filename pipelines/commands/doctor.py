"""`quantize doctor`: this host's class, its vLLM build, and what each shipped recipe and ladder rung gets here.

Every scheme of the shipped recipes (recipes/*.yaml) and of the host's repair ladder is looked up in the kernel
probe (pipelines/hardware/kernels.py; probed once per host and cached): the kernel vLLM chose for it or why none
could, its speed against 16-bit at a decode-like and a prefill-like row count, and what the product does with it
here. With `--target CLASS` (another machine) the written rules (pipelines/hardware/targets.py) answer instead; nothing is
probed.

With `--model DIR` it also probes the model's own Linear shapes (pipelines/hardware/prediction.py) under each recipe
(`--recipe`, default DEFAULT_MODEL_RECIPES): per shape the kernel and its speed against 16-bit at every decode batch up
to `--max-num-seqs` and at a prefill chunk, and the model-level prediction.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.artifact import require_model_dir
from pipelines.commands.args import int_arg
from pipelines.console.output import emit, say, table
from pipelines.errors import InputError
from pipelines.files.yamlio import parse_yaml_model, read_user_text
from pipelines.hardware import diagnosis
from pipelines.hardware.diagnosis import DoctorReport, SchemeRow
from pipelines.hardware.kernels import DECODE_ROWS, PREFILL_ROWS, PROBE_IN_FEATURES, PROBE_OUT_FEATURES, SLOW_RATIO
from pipelines.hardware.prediction import NO_DIFFERENCE, ShapePrediction, ShapeTiming, direction_of, predict_for_recipe
from pipelines.hardware.shape_probe import MAX_DECODE_ROWS
from pipelines.hardware.targets import TARGET_HELP, ServeTarget, installed_target, parse_target
from pipelines.planner.shape import load_config, model_shape
from pipelines.planner.weights import linear_schemes, model_linears
from pipelines.recipe import GroupScheme, LoadedRecipe, Recipe, load_recipe, shipped_recipes
from pipelines.repair.ladder import Families, Ladder, default_ladder_path
from pipelines.serve.serving import ServeSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("doctor")  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("--target", metavar="CLASS", help=f"judge another machine by the written rules: {TARGET_HELP}")
    parser.add_argument("--model", type=Path, metavar="DIR", help="also probe this model's own Linear shapes under each recipe")
    parser.add_argument("--recipe", action="extend", nargs="+", default=[], metavar="RECIPE",
                        help=f"with --model: shipped recipe names or YAML paths (default: {', '.join(DEFAULT_MODEL_RECIPES)})")
    parser.add_argument("--max-num-seqs", type=int_arg(1, MAX_DECODE_ROWS), default=ServeSettings().max_num_seqs, metavar="N",
                        help=f"with --model: the serving max_num_seqs, the largest decode batch probed (default {ServeSettings().max_num_seqs})")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")
    parser.set_defaults(handler=doctor)


DEFAULT_MODEL_RECIPES = ("w8a8", "w4a16", "gptq")  # the shipped recipes a user picks for speed (fp8: no fast CPU kernel)


def doctor(args: argparse.Namespace) -> int:
    target = parse_target(args.target, field="--target") if args.target else installed_target()
    if args.model is None and args.recipe:
        raise InputError("--recipe needs --model (the recipes' speed is probed at a model's own shapes)", field="--recipe")
    if args.model is not None:
        if args.target:
            raise InputError("--model probes this host; it cannot be combined with --target", field="--model")
        require_model_dir(args.model, "--model")
        recipes = _recipes(args.recipe or [n for n in DEFAULT_MODEL_RECIPES if n in shipped_recipes()])
    report = diagnose(target)
    if args.model is not None:
        report.model = [predict_model(args.model, loaded.name, loaded.recipe, args.max_num_seqs) for loaded in recipes]
    emit(report, as_json=args.json, render=_render)
    return 0


def _recipes(names: list[str]) -> list[LoadedRecipe]:
    try:
        return [load_recipe(name) for name in names]
    except InputError as error:  # one line naming the option, with the recipe file and its field
        where = f"{error.field}: " if error.field and error.field != "recipe" else ""
        raise InputError(f"{where}{error.message}", file=error.file, field="--recipe") from None


def predict_model(model_dir: Path, name: str, recipe: Recipe, max_num_seqs: int) -> ShapePrediction:
    """The shape probe's prediction for `model_dir` under `recipe` on this host."""
    shape = model_shape(*load_config(model_dir))
    if shape.not_quantizable:
        raise InputError(shape.not_quantizable, file=model_dir, field="--model")
    linears = model_linears(shape)
    return predict_for_recipe(linears, linear_schemes(shape, recipe), max_num_seqs, model=model_dir.name, recipe=name)


def diagnose(target: ServeTarget) -> DoctorReport:
    """The diagnosis (pipelines/hardware/diagnosis.py) of the shipped recipes and `target`'s shipped ladder."""
    ladder = default_ladder_path(target)
    return diagnosis.diagnose(target, ladder, _ladder_schemes(ladder))


def _ladder_schemes(path: Path) -> list[tuple[str, GroupScheme]]:
    ladder = parse_yaml_model(read_user_text(path, what="ladder", field="ladder"), path, Ladder, "ladder")
    found = []
    for family in Families.model_fields:
        rungs = getattr(ladder.families, family)
        for index, rung in enumerate(rungs.rungs if rungs else []):
            if rung is not None:
                found.append((f"ladder {path.name}: {family} rung {index}", diagnosis.concrete(rung)))
    return found


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _here(row: SchemeRow, reasons: dict[str, int]) -> str:
    if row.why:
        return f"{row.action} [{reasons.setdefault(row.why, len(reasons) + 1)}]"
    return row.action


def _render(report: DoctorReport) -> None:
    host = report.host
    if host is not None:
        emulated = " (emulated)" if host.emulated else ""
        say(f"host class {host.host_class}{emulated}: vLLM {host.vllm_version} loads {host.library}; {host.cpu_model}; "
            f"torch {host.torch_version}")
        say(f"serve dtype {host.serve_dtype}: {host.dtype_reason}")
        say(f"kernel probe: a {PROBE_IN_FEATURES}x{PROBE_OUT_FEATURES} Linear, time per call against 16-bit ({host.serve_dtype}) at "
            f"{DECODE_ROWS} rows (decode) and {PREFILL_ROWS} rows (prefill); 'runs slowly' from {SLOW_RATIO:g}x (geometric mean)")
    else:
        say(f"target {report.target}: written rules (pipelines/hardware/targets.py); nothing probed on this machine")
    actions = report.recipe_actions()
    say(f"negative control here: {report.negative_control or 'none of the shipped ones serves here'}")
    say(table("shipped recipes", ["recipe", "here"], [[name, action] for name, action in actions.items()]))
    reasons: dict[str, int] = {}
    say(table(None, ["where", "scheme", "kernel", "decode", "prefill", "here"], [
        [row.source, row.scheme, row.kernel or "-", _ratio(row.decode_ratio), _ratio(row.prefill_ratio), _here(row, reasons)]
        for row in report.rows
    ]))
    for why, number in reasons.items():
        say(f"[{number}] {why}")
    for prediction in report.model or []:
        _render_prediction(prediction)


def _render_prediction(prediction: ShapePrediction) -> None:
    llc = prediction.llc
    cache = f"L{llc.level} {llc.bytes / 2**20:g} MiB ({llc.source})" if llc.bytes else "unknown (32 MiB assumed)"
    say(f"\n{prediction.model} under {prediction.source}: its Linears as vLLM runs them, speed against 16-bit ({prediction.serve_dtype}; "
        "above 1 faster) per call at each decode batch and a prefill chunk of "
        f"{prediction.prefill_rows} tokens; {prediction.threads} thread(s) as vLLM's worker here; last-level cache {cache}; "
        f"working set {prediction.working_set['base'] / 2**20:.1f} MiB in 16 bits, {prediction.working_set['quant'] / 2**20:.1f} MiB quantized")
    batches = prediction.decode_rows
    rows = [_shape_row(shape, batches, prediction.prefill_rows) for shape in prediction.shapes]
    model = [prediction.speed(b) for b in batches] + [prediction.prefill_speed]
    rows.append(["model (sum x layers)", "", "", "", *(_speed(v) for v in model), ""])
    say(table(None, ["shape", "layers", "scheme", "kernel", *(f"decode {b}" for b in batches), f"prefill {prediction.prefill_rows}",
                     "new batch size (ms)"], rows))
    if prediction.error:
        say(f"no prediction: {prediction.error}")
        return
    fresh = prediction.fresh_rows_ms
    say(f"prediction: decode {_direction(prediction.speed(batches[0]))} at batch {batches[0]}, {_direction(prediction.speed(batches[-1]))} at "
        f"{batches[-1]}; prefill {_direction(prediction.prefill_speed)} (no difference: within ±{NO_DIFFERENCE:.0%}). The model's end-to-end "
        "ratio lies between 1 and these (attention, sampling and the server are not quantized). A batch size never seen "
        f"before costs the Linears {fresh['base']:.1f} ms in 16 bits, {fresh['quant']:.1f} ms quantized (oneDNN builds a primitive); "
        f"probed in {prediction.probe_seconds:.0f} s" + (" (from the cache)" if not prediction.probe_seconds else ""))


def _shape_row(shape: ShapeTiming, batches: list[int], prefill: int) -> list[str]:
    names = f"{shape.linear.name} ({'+'.join(shape.linear.shards)})" if len(shape.linear.shards) > 1 else shape.linear.name
    fresh = f"{shape.fresh_ms['base']:.2f} / {shape.fresh_ms['quant']:.2f}" if shape.fresh_ms else ""
    kernel = (shape.kernel or "-").removesuffix("LinearKernel")
    return [f"{names} {shape.linear.shape}", str(shape.layers), shape.case_key or "16-bit", shape.error or kernel,
            *(_speed(shape.speed(b)) for b in [*batches, prefill]), fresh]


def _speed(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _direction(speed: float | None) -> str:
    return "-" if speed is None else f"{direction_of(speed)} ({speed:.2f}x)"
