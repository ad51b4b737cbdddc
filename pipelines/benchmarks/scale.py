"""The Ray executor's cost, and what it buys at scale: `make bench-scale`.

    python -m pipelines.benchmarks.scale [--recipes w8a8,w4a16,gptq,aggressive] [--eval-sets ticket_routing] [--loadtest]
                                         [--ray-cpus 1] [--candidates 64] [--gpus 8] [--models 8]

Runs the demo job (the demo model x the recipes) twice, each cold in a fresh artifacts root: `quantize job` with
the local executor, then with `--executor ray` against a local Ray runtime started here (`--ray-cpus` CPUs: 1 runs
one task at a time as the local executor does, so the ratio is the engine's own overhead: a worker process per
task, the runtime environment, the probe, the baseline as a task of its own). Prints both wall times and their
ratio, whether verdicts and artifact hashes agree, the per-stage times measured (from the local run's gate.json
files), and the wall time those stage times project for `--candidates` candidates of `--models` models on
`--gpus` GPUs:

    local:  models x baseline + candidates x (candidate + 0)
    ray:    ceil(models / gpus) x baseline + ceil(candidates / gpus) x (candidate + overhead per task)

where `candidate` is the mean of quantize + server start + scoring + gate per candidate and `overhead per task` is
(Ray wall - local wall) / candidates measured here. The stage times are the demo model's on this CPU: a 7-70B
model on a GPU multiplies every stage, the model of N candidates at once does not change. Not a test: the
figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipelines.artifact import artifact_hash
from pipelines.gate.policy import DEFAULT_POLICY
from pipelines.gate.schema import load_report
from pipelines.paths import DEMO_MODEL_DIR

CANDIDATE_STAGES = ("quantize_s", "candidate_serve_start_s", "candidate_scoring_s", "gate_s")
BASELINE_STAGES = ("baseline_serve_start_s", "baseline_scoring_s")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def write_job(root: Path, recipes: list[str], eval_sets: str, loadtest: bool) -> Path:
    policy = root / "policy.yaml"
    text = DEFAULT_POLICY.read_text()
    policy.write_text(text if loadtest else text.replace("performance:\n  enabled: true", "performance:\n  enabled: false"))
    path = root / "bench-scale.yaml"
    path.write_text(
        f"name: bench-scale\nregistry: {root / 'registry.db'}\ndefaults:\n  eval_sets: [{eval_sets}]\n  policy: {policy}\n"
        f"candidates:\n  - model: {DEMO_MODEL_DIR}\n    recipes: [{', '.join(recipes)}]\n"
    )
    return path


def run_job(root: Path, job: Path, *extra: str) -> tuple[dict, float]:
    quantize = Path(sys.executable).with_name("quantize")
    started = time.monotonic()
    # A runtime started by ray.init takes other drivers with its token only (~/.ray/auth_token).
    env = {**os.environ, **OFFLINE, "QUANTGATE_ARTIFACTS": str(root), "RAY_AUTH_MODE": "token"}
    result = subprocess.run([str(quantize), "job", str(job), "--json", *extra], capture_output=True, text=True, check=False, env=env)
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"quantize job {' '.join(extra)} failed (exit {result.returncode}): {result.stderr.strip().splitlines()[-3:]}")
    return json.loads(result.stdout), wall


def start_ray(root: Path, cpus: int) -> tuple[str, float]:
    import ray  # heavy: imported when used

    started = time.monotonic()
    ray.init(num_cpus=cpus, object_store_memory=256 * 1024**2, include_dashboard=False, _temp_dir=str(root / "ray"), logging_level=logging.WARNING)
    return ray.get_runtime_context().gcs_address, time.monotonic() - started


def stage_means(summary: dict) -> tuple[dict[str, float], dict[str, float]]:
    """Mean seconds per candidate stage, and the baseline's stages (scored within the local run's first candidate)."""
    reports = [load_report(Path(r["run_dir"]) / "gate.json") for r in summary["results"]]
    candidate = {name: sum(r.stages.get(name, 0.0) for r in reports) / len(reports) for name in CANDIDATE_STAGES}
    baseline = {name: sum(r.stages.get(name, 0.0) for r in reports) for name in BASELINE_STAGES}
    return candidate, baseline


def projection(candidate_s: float, baseline_s: float, overhead_s: float, candidates: int, gpus: int, models: int) -> tuple[float, float]:
    local = models * baseline_s + candidates * candidate_s
    ray = math.ceil(models / gpus) * baseline_s + math.ceil(candidates / gpus) * (candidate_s + overhead_s)
    return local, ray


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="w8a8,w4a16,gptq,aggressive")
    parser.add_argument("--eval-sets", default="ticket_routing")
    parser.add_argument("--loadtest", action="store_true", help="keep the policy's load test on (off by default: minutes per candidate)")
    parser.add_argument("--ray-cpus", type=int, default=1)
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--models", type=int, default=8)
    args = parser.parse_args(argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    local_root, ray_root = (Path(tempfile.mkdtemp(prefix=f"quantgate-bench-scale-{kind}-")) for kind in ("local", "ray"))
    print(f"artifacts roots: {local_root} (local), {ray_root} (ray)", file=sys.stderr)
    local, local_wall = run_job(local_root, write_job(local_root, recipes, args.eval_sets, args.loadtest))
    address, ray_start = start_ray(ray_root, args.ray_cpus)
    ray_summary, ray_wall = run_job(ray_root, write_job(ray_root, recipes, args.eval_sets, args.loadtest), "--executor", "ray",
                                    "--ray-address", address)
    same = all(  # the artifact's hash is its files' (manifest.json itself also records times and peak memory)
        (a["recipe"], a["status"], artifact_hash(Path(a["artifact_dir"]))) == (b["recipe"], b["status"], artifact_hash(Path(b["artifact_dir"])))
        for a, b in zip(local["results"], ray_summary["results"], strict=True)
    )
    candidate, baseline = stage_means(local)
    candidate_s, baseline_s = sum(candidate.values()), sum(baseline.values())
    overhead_s = (ray_wall - local_wall) / len(recipes)
    projected_local, projected_ray = projection(candidate_s, baseline_s, overhead_s, args.candidates, args.gpus, args.models)
    lines = [
        f"## The demo job, {len(recipes)} candidates ({', '.join(recipes)}) on {args.eval_sets}, cold, load test "
        f"{'on' if args.loadtest else 'off'}",
        f"local executor: {local_wall:.1f} s; ray executor ({args.ray_cpus} CPU(s), one task at a time): {ray_wall:.1f} s "
        f"(+ {ray_start:.1f} s to start the local Ray runtime)",
        f"overhead ratio ray / local: {ray_wall / local_wall:.2f} ({(ray_wall + ray_start) / local_wall:.2f} with the runtime's start); "
        f"{overhead_s:+.1f} s per candidate",
        f"verdicts and artifact hashes identical: {same}",
        "",
        "| stage (local run) | mean s per candidate |", "| --- | --- |",
        *[f"| {name} | {value:.1f} |" for name, value in candidate.items()],
        f"| candidate total | {candidate_s:.1f} |",
        f"| baseline (start + scoring, once per model) | {baseline_s:.1f} |",
        "",
        f"## Projected: {args.candidates} candidates of {args.models} models on {args.gpus} GPUs, these stage times",
        f"local (one after another): {projected_local / 3600:.2f} h; ray: {projected_ray / 3600:.2f} h "
        f"({projected_local / projected_ray:.1f}x faster)",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
