"""Every shipped recipe through the whole job on the real pretrained model: the table of docs/real-model.md.

    python -m pipelines.benchmarks.real_model [--model models/smollm2-135m] [--recipes w8a8,w4a16,gptq,aggressive]

Runs `quantize --recipe R --model M --eval-sets ... --calibration from-eval-sets --json` as a user would (a
subprocess per recipe: its own peak RSS, its own stderr), then prints one markdown table: verdict, per-set
baseline and candidate scores, flips (right->wrong / wrong->right), mean KL, quantize wall time and peak RSS,
and the artifact's weight bytes against the planner's prediction from the shapes alone (8 bits + one scale
per channel; 4 bits + one 16-bit scale per group). Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from pipelines.artifact import Manifest, read_manifest, read_model_config
from pipelines.gate.schema import GateReport, load_report
from pipelines.planner import GiB, model_shape, predict_weight_bytes
from pipelines.recipe import load_recipe

REAL_SETS = "retail_sentiment,retail_faulty_item,retail_order_id"
RECIPES = "w8a8,w4a16,gptq,aggressive"


class RecipeRun(BaseModel):
    recipe: str
    exit_code: int
    stderr_lines: int
    wall_s: float
    gate: GateReport | None = None
    manifest: Manifest | None = None
    error: str | None = None


def run_recipe(recipe: str, model: Path, sets: str) -> RecipeRun:
    command = [sys.executable, "-m", "pipelines.cli", "--recipe", recipe, "--model", str(model), "--eval-sets", sets,
               "--calibration", "from-eval-sets", "--json"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall_s = time.monotonic() - started
    stderr_lines = len(done.stderr.splitlines())
    try:
        outcome = json.loads(done.stdout)
    except json.JSONDecodeError:
        return RecipeRun(recipe=recipe, exit_code=done.returncode, stderr_lines=stderr_lines, wall_s=wall_s,
                         error=(done.stderr.strip().splitlines() or ["no output"])[-1])
    if "error" in outcome:
        return RecipeRun(recipe=recipe, exit_code=done.returncode, stderr_lines=stderr_lines, wall_s=wall_s, error=outcome["error"])
    return RecipeRun(recipe=recipe, exit_code=done.returncode, stderr_lines=stderr_lines, wall_s=wall_s,
                     gate=load_report(Path(outcome["gate_json"])), manifest=read_manifest(Path(outcome["artifact_dir"])))


def _or_dash(count: int | None) -> str:
    return "-" if count is None else str(count)


def _mb(count: int) -> str:
    return f"{count / 1e6:.1f} MB"


def table(runs: list[RecipeRun], model: Path) -> str:
    shape = model_shape(read_model_config(model))
    rows = ["| recipe | verdict | set: baseline → candidate (flips −/+, KL) | quantize | peak RSS | weights (planner) | stderr lines |",
            "|---|---|---|---|---|---|---|"]
    for run in runs:
        if run.gate is None or run.manifest is None:
            rows.append(f"| {run.recipe} | error (exit {run.exit_code}): {run.error} | | | | | {run.stderr_lines} |")
            continue
        sets = "<br>".join(
            f"{s.eval_set}: {s.baseline_score:.1f} → {s.candidate_score:.1f} "
            f"({_or_dash(s.flips_right_to_wrong)}/{_or_dash(s.flips_wrong_to_right)}, KL {s.kl_mean:.3f})" if s.kl_mean is not None else
            f"{s.eval_set}: {s.baseline_score:.1f} → {s.candidate_score:.1f}"
            for s in run.gate.gate.sets)
        predicted = predict_weight_bytes(shape, load_recipe(run.recipe).recipe).total_bytes
        measured = run.manifest.weight_bytes.after
        rows.append(
            f"| {run.recipe} | {run.gate.gate.verdict} | {sets} | {run.manifest.wall_time_s:.0f} s | "
            f"{run.manifest.peak_memory.bytes / GiB:.2f} GiB | {_mb(measured)} ({_mb(predicted)}, "
            f"{measured / predicted - 1:+.1%}) | {run.stderr_lines} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m"))
    parser.add_argument("--recipes", default=RECIPES)
    parser.add_argument("--eval-sets", default=REAL_SETS)
    args = parser.parse_args(argv)
    runs = []
    for recipe in args.recipes.split(","):
        print(f"bench-real: {recipe} ...", file=sys.stderr, flush=True)
        runs.append(run_recipe(recipe, args.model, args.eval_sets))
        print(f"bench-real: {recipe}: exit {runs[-1].exit_code} in {runs[-1].wall_s:.0f} s", file=sys.stderr, flush=True)
    shape_bytes = model_shape(read_model_config(args.model))
    print(f"16-bit model: {_mb(predict_weight_bytes(shape_bytes, None).total_bytes)} of weights (planner)")
    print(table(runs, args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
