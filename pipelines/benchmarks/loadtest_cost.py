"""What the load test costs against the quality gate, and what it measured: `make bench-loadtest`.

    python -m pipelines.benchmarks.loadtest_cost [--recipes w8a8,w4a16] [--model models/demo-llama] [--eval-sets ...]
    python -m pipelines.benchmarks.loadtest_cost --gate-json RUN/gate.json [...]   # summarise runs already made

Runs `quantize --recipe R --json --no-registry` per recipe, one after the other in one temporary artifacts root
(the first run scores the 16-bit baseline: a cold run; the later ones find it cached: warm runs, where the load
test starts the baseline server itself), then prints per run: the quality gate's wall time (servers started for
scoring, scoring, the decision), the load test's (its own stage plus the servers it had to start) and their
ratio; the candidate/baseline ratios at every concurrency; vLLM's KV capacity against the planner's. Not a test:
the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pipelines.gate.schema import GateReport, load_report
from pipelines.loadtest.render import ratio_text
from pipelines.paths import DEMO_EVAL_SETS, DEMO_MODEL_DIR

QUALITY_STAGES = ("baseline_serve_start_s", "baseline_scoring_s", "candidate_serve_start_s", "candidate_scoring_s", "gate_s")
LOADTEST_STAGES = ("loadtest_s", "loadtest_baseline_serve_start_s", "loadtest_candidate_serve_start_s")


def stage_cost(stages: dict[str, float]) -> tuple[float, float]:
    """(quality gate seconds, load test seconds) from a run's stage times."""
    return sum(stages.get(name, 0.0) for name in QUALITY_STAGES), sum(stages.get(name, 0.0) for name in LOADTEST_STAGES)


def run_recipe(recipe: str, model: Path, eval_sets: str, root: Path) -> Path:
    env = {**os.environ, "QUANTGATE_ARTIFACTS": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    quantize = Path(sys.executable).with_name("quantize")
    result = subprocess.run(
        [str(quantize), "--recipe", recipe, "--model", str(model), "--eval-sets", eval_sets, "--no-registry", "--json"],
        capture_output=True, text=True, env=env, check=False,
    )
    if result.returncode not in (0, 1):
        raise SystemExit(f"quantize --recipe {recipe} failed (exit {result.returncode}): {result.stderr.strip().splitlines()[-1:]}")
    return Path(json.loads(result.stdout)["gate_json"])


def summary(report: GateReport) -> list[str]:
    quality, loadtest = stage_cost(report.stages)
    lines = [f"## {report.gate.recipe}: {report.gate.verdict}",
             f"quality gate {quality:.1f} s, load test {loadtest:.1f} s ({loadtest / quality:.2f} x the quality gate)"
             if quality else f"load test {loadtest:.1f} s (the quality gate's scores were all cached)"]
    performance = report.performance
    if performance is None:
        return [*lines, "no load test (not promoted, or turned off)"]
    starts = {name: report.stages[name] for name in LOADTEST_STAGES[1:] if name in report.stages}
    lines.append(f"load test stage {report.stages.get('loadtest_s', 0):.1f} s; servers it started: {starts or 'none'}; "
                 f"{performance.enforcement}")
    lines += ["", "| concurrency | throughput ratio [95% CI] | TTFT p95 ratio [95% CI] |", "| --- | --- | --- |"]
    lines += [f"| {r.concurrency} | {ratio_text(r.throughput)} | {ratio_text(r.ttft_p95)} |" for r in performance.ratios]
    for model in performance.models:
        lines.append(f"{model.role}: KV {model.kv_capacity_tokens} tokens measured, {model.kv_capacity_tokens_predicted} planned; "
                     f"peak memory {(model.peak_memory_bytes or 0) / 2**30:.2f} GiB")
    if performance.tuning is not None:
        lines.append(f"measured max_num_seqs {performance.tuning.measured_max_num_seqs} (planner {performance.tuning.planner_max_num_seqs})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="w8a8,w4a16")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--eval-sets", default=",".join(DEMO_EVAL_SETS))
    parser.add_argument("--gate-json", type=Path, nargs="*", help="summarise these runs instead of running quantize")
    args = parser.parse_args(argv)
    if args.gate_json:
        paths = list(args.gate_json)
    else:
        root = Path(tempfile.mkdtemp(prefix="quantgate-loadtest-cost-"))
        print(f"artifacts root: {root}", file=sys.stderr)
        paths = [run_recipe(recipe.strip(), args.model, args.eval_sets, root) for recipe in args.recipes.split(",") if recipe.strip()]
    for path in paths:
        print("\n".join([*summary(load_report(path)), f"(evidence: {path})", ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
