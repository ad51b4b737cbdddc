"""`quantize plan`: will the model fit a GPU in 16-bit and under each recipe? Argument parsing and printing only."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pydantic import ValidationError

from pipelines.benchmarks.roofline import calibrate, calibration_models, render_calibration
from pipelines.bounds import MAX_CONCURRENCY, MAX_CONTEXT, MAX_GPU_BANDWIDTH_GBS, MAX_GPU_MEMORY_GIB
from pipelines.commands.args import float_arg, int_arg
from pipelines.console.output import emit, say, table
from pipelines.errors import InputError, from_validation_error
from pipelines.hardware.host import host_profile
from pipelines.hardware.kernels import PROBE_IN_FEATURES, KernelCase
from pipelines.hardware.speed import ProbedSpeed, probed_speed
from pipelines.hardware.targets import TARGET_HELP, installed_target, parse_target
from pipelines.planner import (
    KV_CACHE_DTYPES,
    MAX_BATCHED_TOKENS,
    MAX_GPU_PEAK_TFLOPS,
    MAX_OVERHEAD_GIB,
    TERA,
    GiB,
    GpuSpec,
    Plan,
    PlanSettings,
    gpu_spec,
    known_gpus,
    load_config,
    model_shape,
    plan,
)
from pipelines.planner.view import (
    PLAN_COLUMNS,
    gib,
    plan_row_cells,
    plan_title,
    roofline_lines,
    vllm_arguments,
)
from pipelines.recipe import Recipe, load_recipe
from pipelines.settings import current as current_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",  # its summary: pipelines.cli.COMMANDS
        description="Plan GPU memory for the 16-bit model and each recipe from config.json alone "
                    "(weights measured exactly from safetensors headers when the files are there).",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, metavar="DIR", help="a model folder (config.json; safetensors optional)")
    source.add_argument("--artifact", type=Path, metavar="DIR", help="a quantized artifact folder (measured exactly)")
    source.add_argument("--config", type=Path, metavar="FILE", help="a config.json: plan without any weights")
    parser.add_argument("--recipe", action="extend", nargs="+", default=[], metavar="RECIPE",
                        help="shipped recipe name (w8a8) or YAML path; repeatable")
    parser.add_argument("--gpu", metavar="NAME", help="a GPU from pipelines/data/gpus.yaml (see --list-gpus)")
    parser.add_argument("--gpu-memory-gib", type=float_arg(0, MAX_GPU_MEMORY_GIB, low_open=True), metavar="GIB",
                        help="or the device memory, in GiB")
    parser.add_argument("--gpu-bandwidth-gbs", type=float_arg(0, MAX_GPU_BANDWIDTH_GBS, low_open=True), metavar="GBS",
                        help="memory bandwidth in GB/s (the predicted decode speed's memory side)")
    parser.add_argument("--gpu-peak-tflops", type=float_arg(0, MAX_GPU_PEAK_TFLOPS, low_open=True), metavar="TFLOPS",
                        help="peak dense 16-bit TFLOPS (the predicted decode speed's compute side; default: the GPU table's)")
    parser.add_argument("--max-model-len", type=int_arg(1, MAX_CONTEXT), metavar="N",
                        help="tokens per sequence (default: the model's maximum)")
    parser.add_argument("--concurrency", type=int_arg(1, MAX_CONCURRENCY), default=1, metavar="N", help="sequences at once (default 1)")
    parser.add_argument("--kv-cache-dtype", action="extend", nargs="+", choices=list(KV_CACHE_DTYPES), metavar="DTYPE",
                        help="as vLLM's --kv-cache-dtype, one row per recipe and value: what each KV precision buys at this context "
                             f"({', '.join(KV_CACHE_DTYPES)}; default auto: the config's kv_cache_scheme, else the dtype the model is "
                             "served in). A recipe's own kv_cache wins")
    defaults = PlanSettings()
    parser.add_argument("--max-num-batched-tokens", type=int_arg(1, MAX_BATCHED_TOKENS), default=defaults.max_num_batched_tokens, metavar="N",
                        help="tokens in vLLM's profiling pass, sizes activations (default %(default)s)")
    parser.add_argument("--overhead-fraction", type=float_arg(0, 1), default=defaults.overhead_fraction, metavar="F",
                        help="slack on weights + KV + activations (default %(default)s)")
    parser.add_argument("--overhead-gib", type=float_arg(0, MAX_OVERHEAD_GIB), default=defaults.fixed_overhead_bytes / GiB, metavar="GIB",
                        help="fixed CUDA context and workspaces (default %(default)s)")
    parser.add_argument("--max-gpu-memory-utilization", type=float_arg(0, 1, low_open=True), default=defaults.max_gpu_memory_utilization,
                        metavar="F", help="share of device memory a plan may use (default %(default)s)")
    parser.add_argument("--target", metavar="TARGET",
                        help=f"check recipes against this serve target's vLLM kernels: {TARGET_HELP} (default: the "
                             "GPU's compute capability from the table, else the installed serve environment's)")
    parser.add_argument("--list-gpus", action="store_true", help="print the known GPUs and exit")
    parser.add_argument("--calibrate", action="store_true",
                        help="calibrate the roofline on this host: measure its memory bandwidth, predict the 16-bit model's decode "
                             "tokens/s at 1 and --concurrency sequences, serve it on vLLM and print measured vs predicted (--model "
                             "DIR; default the demo model and models/smollm2-135m)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.list_gpus:
        emit(list(known_gpus().values()), as_json=args.json, render=_render_gpus)
        return 0
    if args.calibrate:
        return _calibrate(args)
    config, artifact_dir = _source(args)
    if args.gpu is None and args.gpu_memory_gib is None:
        raise InputError("give --gpu NAME or --gpu-memory-gib GIB (see --list-gpus)", field="gpu")
    gpu = gpu_spec(args.gpu, args.gpu_memory_gib, args.gpu_bandwidth_gbs, args.gpu_peak_tflops)
    recipes = [None, *(load_recipe(name).recipe for name in args.recipe)]
    target = parse_target(args.target) if args.target else None
    result = plan(
        config, recipes, gpu, _max_model_len(args, config), args.concurrency, artifact_dir,
        settings=_settings(args), kv_cache_dtype=args.kv_cache_dtype or ['auto'], target=target,
    )
    if result.target is not None and (target or installed_target()).local:
        result.probed = {recipe.name: _probed(recipe) for recipe in recipes if recipe is not None}
    emit(result, as_json=args.json, render=render_plan)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if args.artifact or args.config:
        raise InputError("--calibrate serves a 16-bit model folder: give --model DIR (or nothing for the demo model and SmolLM2)",
                         field="calibrate")
    models = [args.model] if args.model else calibration_models()
    log_dir = current_settings().artifacts_dir / "calibration"
    emit(calibrate(models, args.concurrency, log_dir), as_json=args.json, render=render_calibration)
    return 0


def _probed(recipe: Recipe) -> ProbedSpeed:
    """The probe's ratios for the recipe's schemes on this host (group sizes as the probe's layer gets them)."""
    schemes = [getattr(recipe.groups, group) for group in ("attention", "mlp")]
    schemes += [getattr(override, group) for override in recipe.overrides for group in ("attention", "mlp")]
    cases = [KernelCase.of(s.model_copy(update={"weights": s.weights.for_layer(PROBE_IN_FEATURES)})) for s in schemes if s is not None]
    return probed_speed(host_profile(), cases)


def _source(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """config.json to plan from, and the folder whose safetensors are measured (if any)."""
    if args.config:
        return args.config, None
    folder = args.model or args.artifact
    if folder is None:
        raise InputError("give --model DIR, --artifact DIR or --config FILE", field="model")
    has_weights = any(Path(folder).glob("*.safetensors"))
    if args.artifact and not has_weights:
        raise InputError("no *.safetensors files", file=folder, field="artifact")
    return folder, folder if has_weights else None


def _max_model_len(args: argparse.Namespace, config: Path) -> int:
    if args.max_model_len is not None:
        return args.max_model_len
    shape = model_shape(*load_config(config))
    if shape.max_position is None:
        raise InputError("config.json has no max_position_embeddings: give --max-model-len", field="max_model_len")
    return shape.max_position


def _settings(args: argparse.Namespace) -> PlanSettings:
    if not math.isfinite(args.overhead_gib):
        raise InputError(f"must be a number of GiB (got {args.overhead_gib})", field="overhead_gib")
    try:
        return PlanSettings(
            max_num_batched_tokens=args.max_num_batched_tokens,
            overhead_fraction=args.overhead_fraction,
            fixed_overhead_bytes=int(args.overhead_gib * GiB),
            max_gpu_memory_utilization=args.max_gpu_memory_utilization,
        )
    except ValidationError as error:
        raise from_validation_error(error, "command line") from None


def render_plan(result: Plan) -> None:
    say(table(plan_title(result), PLAN_COLUMNS, [plan_row_cells(row) for row in result.rows]))
    for row in result.rows:
        say(f"{row.scheme}: {vllm_arguments(row)}")
    for line in roofline_lines(result):
        say(line)
    for name, speed in result.probed.items():
        if speed.slowdown is not None:
            say(f"{name}: probed on {speed.host_class} (its slowest scheme's Linear against 16-bit): {speed.decode_ratio:.2f}x at decode, "
                f"{speed.prefill_ratio:.2f}x at prefill (docs/hardware.md)")
    for row in result.rows:
        if row.vllm_kv_layout:
            say(f"{row.scheme}: vLLM KV cache {row.vllm_kv_tokens:,} tokens: {row.vllm_kv_layout}")


def _render_gpus(gpus: list[GpuSpec]) -> None:
    rows = [
        [g.name, gib(g.memory_bytes), f"{g.bandwidth_bytes_per_s / 1e9:g}" if g.bandwidth_bytes_per_s else "-", _peaks(g)]
        for g in gpus
    ]
    say(table("Known GPUs", ["name", "memory GiB", "bandwidth GB/s", "peak dense TFLOPS"], rows))


def _peaks(gpu: GpuSpec) -> str:
    return ", ".join(f"{dtype} {flops / TERA:g}" for dtype, flops in gpu.peak_flops_per_s.items()) or "-"
