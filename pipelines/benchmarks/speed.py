"""What each shipped recipe buys in speed here, against 16-bit, measured in one run: `make bench-speed`.

    python -m pipelines.benchmarks.speed [--models demo,smollm2] [--recipes w8a8,w4a16] [--budget-s 120] [--no-peer]

Per model (the demo model and SmolLM2-135M-Instruct, each on its own business sets): every shipped recipe is quantized
(or its artifact reused; a recipe this host cannot serve is listed with the reason), then the 16-bit model is served
once and each candidate beside it in turn, and the load test's paired comparison (pipelines/loadtest/comparison.py)
measures candidate / 16-bit throughput and p95 TTFT at the policy's concurrency, with intervals. Beside each row:
the shape probe's predicted direction (pipelines/hardware/prediction.py, for the same workload), and an independent
interleaved check of the same two servers that shares no code with the load test (plain HTTP: greedy completions at
a fixed concurrency, the models alternating, as a person would measure it by hand). Then the peer a CPU user would
pick instead, llama.cpp (llama-cpp-python's server, in an environment of its own) on the same model as GGUF at Q8_0
and Q4_K_M, against the same 16-bit vLLM server (pipelines/benchmarks/speed_peer.py).

Writes artifacts/bench-speed/<stamp>/speed.md and speed.json, each run's load-test evidence beside them, and prints
the table. Not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path

import httpx

from pipelines import paths
from pipelines.benchmarks.speed_peer import PEER_BUDGET_S, PeerRow, peer_rows
from pipelines.benchmarks.speed_peer import markdown as peer_markdown
from pipelines.console.capture import library_log
from pipelines.console.output import progress, say
from pipelines.errors import QuantGateError
from pipelines.files.atomic import write_json_atomic, write_text_atomic
from pipelines.hardware.host import host_profile
from pipelines.loadtest import bench
from pipelines.loadtest.memory import weight_bytes
from pipelines.loadtest.results import PerformanceReport, Role
from pipelines.loadtest.stage import StageInputs, artifact_prediction, run_loadtest
from pipelines.loadtest.verdict import ratio_text
from pipelines.paths import DEMO_EVAL_SETS
from pipelines.recipe import FROM_EVAL_SETS, shipped_recipes
from pipelines.runs.loadtest import Options, options, stage_inputs
from pipelines.schema import StrictModel
from pipelines.serve.serving import RunningServer, vllm_server
from pipelines.settings import current as current_settings

REAL_MODEL = "smollm2-135m"
REAL_SETS = ("retail_sentiment", "retail_faulty_item", "retail_order_id")
REASON_CHARS = 200  # a refusal's reason in the table (speed.json has it whole)
CHECK_ROUNDS = 4
CHECK_REQUESTS = 64
CHECK_CONCURRENCY = 8
CHECK_TOKENS = 16


class ModelCase(StrictModel):
    name: str
    model_dir: Path
    eval_sets: tuple[str, ...]
    calibration: str | None = None


def model_cases() -> dict[str, ModelCase]:
    return {
        "demo": ModelCase(name="demo-llama", model_dir=paths.DEMO_MODEL_DIR, eval_sets=DEMO_EVAL_SETS),
        "smollm2": ModelCase(name=REAL_MODEL, model_dir=paths.MODELS_DIR / REAL_MODEL, eval_sets=REAL_SETS, calibration=FROM_EVAL_SETS),
    }


class IndependentCheck(StrictModel):
    """Requests/s of the candidate over the baseline's, per round (alternating which goes first), and their geometric mean."""

    ratios: list[float]
    estimate: float
    method: str = (f"{CHECK_REQUESTS} greedy {CHECK_TOKENS}-token completions at concurrency {CHECK_CONCURRENCY} per model and "
                   f"round, {CHECK_ROUNDS} rounds, the first model alternating; plain HTTP, no vllm bench")


class SpeedRow(StrictModel):
    model: str
    recipe: str
    refused: str | None = None
    report: PerformanceReport | None = None
    check: IndependentCheck | None = None
    quantize_s: float | None = None

    def cells(self) -> list[str]:
        if self.report is None or self.report.comparison is None:
            why = self.refused if self.refused is None or len(self.refused) <= REASON_CHARS else self.refused[:REASON_CHARS] + "..."
            return [self.model, self.recipe, f"refused here: {why}" if why else "not measured", *["-"] * (len(COLUMNS) - 3)]
        speed, memory = self.report.comparison, self.report.memory
        weights = f"{memory.weight_ratio:.2f}x" if memory is not None and memory.weight_ratio else "-"
        shape = self.report.predicted
        predicted = f"{shape.direction} ({shape.throughput_ratio:.2f}x)" if shape is not None else "-"
        check = f"{self.check.estimate:.2f}x ({', '.join(f'{r:.2f}' for r in self.check.ratios)})" if self.check else "-"
        tpot = f"{speed.tpot_p50.outcome}: {ratio_text(speed.tpot_p50.interval)}" if speed.tpot_p50 else "-"
        return [self.model, self.recipe, f"{speed.throughput.outcome}", ratio_text(speed.throughput.interval),
                ratio_text(speed.ttft_p95.interval), tpot, f"{len(speed.pairs)} ({speed.stopped})", f"{speed.seconds:.0f}", weights, predicted,
                check]


COLUMNS = ["Model", "Recipe", "Throughput", "Throughput ratio", "TTFT p95 ratio", "Median TPOT ratio", "Pairs (stopped)", "Seconds",
           "Weights", "Probe predicts", "Independent check"]


# --------------------------------------------------------------------------------- the independent check


def _requests_per_second(server: RunningServer, prompts: list[str]) -> float:
    with httpx.Client(timeout=server.request_timeout_s) as client:
        def ask(prompt: str) -> None:
            body = {"model": server.served_name, "prompt": prompt, "max_tokens": CHECK_TOKENS, "temperature": 0, "ignore_eos": True}
            client.post(f"{server.base_url}/completions", json=body, headers=server.auth_headers).raise_for_status()

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=CHECK_CONCURRENCY) as pool:
            list(pool.map(ask, prompts))
        return len(prompts) / (time.perf_counter() - started)


def independent_check(baseline: RunningServer, candidate: RunningServer, prompts: list[str]) -> IndependentCheck:
    """The issue's own hand measurement, repeated: the two servers alternate, and each round gives one ratio."""
    chosen = [prompts[i % len(prompts)] for i in range(CHECK_REQUESTS)]
    _requests_per_second(baseline, chosen)  # a first round each, not measured: lazy set-up, caches, connections
    _requests_per_second(candidate, chosen)
    ratios = []
    for round_ in range(CHECK_ROUNDS):
        order = [("baseline", baseline), ("candidate", candidate)]
        rates = {name: _requests_per_second(server, chosen) for name, server in (order if round_ % 2 == 0 else order[::-1])}
        ratios.append(rates["candidate"] / rates["baseline"])
    return IndependentCheck(ratios=[round(r, 4) for r in ratios], estimate=math.exp(statistics.fmean(math.log(r) for r in ratios)))


# --------------------------------------------------------------------------------- one model


def quantized(case: ModelCase, recipe: str, chosen: Options) -> tuple[Path | None, str | None, float | None]:
    """(artifact, None, seconds) or (None, why this host cannot have it, None)."""
    from pipelines.quantize.oneshot import quantize_model  # heavy (torch, llm-compressor)

    try:
        result = quantize_model(recipe, case.model_dir, calibration=case.calibration, eval_sets=chosen.eval_sets)
    except QuantGateError as error:
        return None, str(error).splitlines()[0], None
    return result.artifact_dir, None, 0.0 if result.reused else result.manifest.wall_time_s


@contextmanager
def _served(model_dir: Path, folder: Path, chosen: Options, role: Role) -> Iterator[RunningServer]:
    with vllm_server(model_dir, log_path=folder / f"{role}-server.log", settings=chosen.serve, served_name=role) as server:
        yield server


def bench_model(case: ModelCase, recipes: list[str], budget_s: float | None, out: Path, peer_budget_s: float | None,
                ) -> tuple[list[SpeedRow], list[PeerRow]]:
    """`peer_budget_s`: llama.cpp's comparisons' budget (None: no peer)."""
    chosen = options(case.model_dir, None, policy_path=None, concurrency=None, repeats=None, eval_sets=list(case.eval_sets),
                     max_model_len=512, budget_s=budget_s)
    folder = out / case.name
    folder.mkdir(parents=True, exist_ok=True)
    artifacts = {recipe: quantized(case, recipe, chosen) for recipe in recipes}
    rows = [SpeedRow(model=case.name, recipe=recipe, refused=why) for recipe, (artifact, why, _) in artifacts.items() if artifact is None]
    with ExitStack() as stack:
        driver = stack.enter_context(bench.BenchDriver(folder / "tool"))
        baseline = stack.enter_context(_served(case.model_dir, folder, chosen, "baseline"))
        for recipe, (artifact, _, seconds) in artifacts.items():
            if artifact is None:
                continue
            progress(f"bench-speed: {case.name} {recipe}: serving the candidate beside the 16-bit baseline")
            with _served(artifact, folder / recipe, chosen, "candidate") as candidate:
                rows.append(_measure(case, recipe, artifact, chosen, folder / recipe, driver, {"baseline": baseline, "candidate": candidate},
                                     seconds))
        peers = [] if peer_budget_s is None else peer_rows(case.name, chosen, baseline, driver, folder, weight_bytes(case.model_dir),
                                                           peer_budget_s)
    return rows, peers


def _measure(case: ModelCase, recipe: str, artifact: Path, chosen: Options, folder: Path, driver: bench.BenchDriver,
             servers: dict[Role, RunningServer], seconds: float | None) -> SpeedRow:
    inputs: StageInputs = stage_inputs(chosen.model_copy(update={"artifact": artifact}), folder)
    artifact_prediction(artifact, chosen.serve.max_num_seqs, probe_missing=True)  # fills the probe's cache: the load test reads it
    report = run_loadtest(inputs, lambda role: (servers[role], "load test"), driver)
    write_json_atomic(folder / "loadtest.json", report.model_dump(mode="json"))
    prompts = [prompt.text for name in case.eval_sets for prompt in inputs.prompts.get(name, [])]
    check = independent_check(servers["baseline"], servers["candidate"], prompts)
    row = SpeedRow(model=case.name, recipe=recipe, report=report, check=check, quantize_s=seconds)
    say(" | ".join(row.cells()))
    return row


# --------------------------------------------------------------------------------- the whole run


def markdown(rows: list[SpeedRow], peers: list[PeerRow], started: str, seconds: float) -> str:
    profile = host_profile()
    lines = [
        f"# bench-speed: {started}, host class {profile.host_class} ({profile.cpu_model}, {os.cpu_count()} cores, vLLM {profile.vllm_version}), "
        f"{seconds:.0f} s",
        "",
        "Candidate / 16-bit at the policy's concurrency, from the load test's paired comparison (95% intervals; `no difference` "
        "is within 10% either way). Weights: the candidate's weight files over the 16-bit model's. Probe predicts: the shape "
        "probe's direction for the same workload (its ratio is the Linears' alone). Independent check: requests/s ratio "
        "per round of plain greedy completions, the models alternating.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
        *("| " + " | ".join(row.cells()) + " |" for row in rows),
    ]
    return "\n".join([*lines, "", *peer_markdown(peers)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.benchmarks.speed", description=__doc__.split("\n\n")[0])
    known = model_cases()
    parser.add_argument("--models", default="demo,smollm2", help=f"comma-separated, of {', '.join(known)}")
    parser.add_argument("--recipes", help="comma-separated shipped recipes (default: every shipped recipe)")
    parser.add_argument("--budget-s", type=float, help="the paired comparison's budget per recipe (default: the policy's)")
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    parser.add_argument("--peer-budget-s", type=float, default=PEER_BUDGET_S,
                        help=f"llama.cpp's comparisons' budget (default {PEER_BUDGET_S:g} s: it computes one request at a time)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.models.split(",") if name not in known]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    cases = [known[name] for name in args.models.split(",")]
    recipes = args.recipes.split(",") if args.recipes else shipped_recipes()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = current_settings().artifacts_dir / "bench-speed" / stamp
    started = time.monotonic()
    rows: list[SpeedRow] = []
    peers: list[PeerRow] = []
    out.mkdir(parents=True, exist_ok=True)
    progress(f"bench-speed: library output (llm-compressor, transformers) goes to {out / 'library.log'}")
    with library_log(out / "library.log"):
        for case in cases:
            found, peered = bench_model(case, recipes, args.budget_s, out, None if args.no_peer else args.peer_budget_s)
            rows, peers = rows + found, peers + peered
    text = markdown(rows, peers, stamp, time.monotonic() - started)
    write_text_atomic(out / "speed.md", text)
    write_json_atomic(out / "speed.json", {"recipes": [row.model_dump(mode="json") for row in rows],
                                           "peers": [row.model_dump(mode="json") for row in peers]})
    say(text)
    progress(f"bench-speed: written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
