"""Which load generator for the load test: `vllm bench serve` against GuideLLM, measured on one server.

    python -m pipelines.benchmarks.loadgen [--rounds 6] [--requests 200] [--concurrency 16] [--json OUT]

Needs GuideLLM in an environment of its own, .venv-guidellm (torch pinned to the CPU wheel, so that it pulls no CUDA):

    python -m venv .venv-guidellm && printf 'torch==2.13.0+cpu\\n' > /tmp/c.txt && \\
        .venv-guidellm/bin/pip install -c /tmp/c.txt guidellm==0.8.1

Serves the demo model once (the product's `vllm_server`), writes a JSONL of the demo eval sets' prompts with a fixed
output length (the product's workload code), starts both tools' drivers (each imports its tool once, as the product's
vllm bench driver does: pipelines/loadtest/vllm_bench_driver.py and pipelines/benchmarks/guidellm_driver.py), warms
the server with one run of each, then runs `--rounds` rounds of one run per tool at `--concurrency`, the order swapped
every round, on the same server. Per run: output tokens/s as the tool reports it, the tool's own duration, the wall
time from the order to the tool's "done" line (the difference is the run's fixed overhead), the client's CPU seconds
(the driver process and its waited-for children, from /proc/PID/stat: GuideLLM's worker processes count) and the
server's. Then one feature check per tool: per-prompt output lengths (4, 8, 16, 24 tokens in turn) must come back as
asked; GuideLLM also runs once to a fixed duration. Prints a Markdown summary. Not a test: the figures depend on the
host and its load; docs/loadtest.md ("Which load generator") holds the figures and the choice.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipelines.evaluation.evalsets import select_eval_sets
from pipelines.evaluation.evaluate import load_all_prompts, materialize_tasks
from pipelines.hardware.host import host_profile
from pipelines.loadtest.bench import BenchDriver, PlannedRun, bench_argv, driver_environment, read_result
from pipelines.loadtest.vllm_bench_driver import READY_LINE as VLLM_READY
from pipelines.loadtest.workload import WorkloadItem, build_workload, write_dataset
from pipelines.paths import DEMO_EVAL_SETS, DEMO_MODEL_DIR
from pipelines.serve.reclaim import die_with_parent
from pipelines.serve.serving import RunningServer, ServeSettings, vllm_server

ROOT = Path(__file__).resolve().parents[2]
GUIDELLM_PYTHON = ROOT / ".venv-guidellm" / "bin" / "python"
GUIDELLM_DRIVER = Path(__file__).with_name("guidellm_driver.py")
GUIDELLM_DONE = "quantgate-guidellm: done"
GUIDELLM_READY = "quantgate-guidellm: GuideLLM imported"
TICK = os.sysconf("SC_CLK_TCK")
RUN_TIMEOUT_S = 180.0
IMPORT_TIMEOUT_S = 180.0
VARIED_LENGTHS = (4, 8, 16, 24)
FEATURE_REQUESTS = 32
DURATION_CHECK_S = 2.0
VLLM = "vllm bench serve"
GUIDELLM = "guidellm (default: 10 worker processes)"
GUIDELLM_1 = "guidellm, 1 worker process"
SHORT = {VLLM: "vllm", GUIDELLM: "guidellm", GUIDELLM_1: "guidellm1"}


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of a process (its own CPU and that of the children it has waited for)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(value) for value in fields[11:15]) / TICK


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and of its living descendants (a server and its engine core)."""
    total, stack, seen = 0.0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            total += cpu_seconds(current)
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def _wait_for_line(log_path: Path, prefix: str, count: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(1 for line in log_path.read_text(errors="replace").splitlines() if line.startswith(prefix)) < count:
        if process.poll() is not None:
            raise SystemExit(f"{log_path.name}: the driver exited ({process.returncode}): {log_path.read_text()[-600:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{log_path.name}: no '{prefix}' line within {timeout_s:.0f} s")
        time.sleep(0.02)


class GuideLLMDriver:
    """pipelines/benchmarks/guidellm_driver.py in .venv-guidellm: one process, one run per order, killed when the block ends."""

    def __init__(self, work_dir: Path, name: str, settings: dict[str, str]):
        self.log_path = work_dir / f"{name}.log"
        self.settings = settings
        self.process: subprocess.Popen | None = None
        self.finished = 0
        self.started = 0.0

    def __enter__(self) -> GuideLLMDriver:
        self.started = time.monotonic()
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen([str(GUIDELLM_PYTHON), str(GUIDELLM_DRIVER)], stdin=subprocess.PIPE, stdout=log,
                                            stderr=subprocess.STDOUT, text=True, env={**driver_environment(), **self.settings},
                                            cwd=self.log_path.parent, preexec_fn=die_with_parent(signal.SIGKILL))
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def wait_ready(self) -> float:
        assert self.process is not None
        _wait_for_line(self.log_path, GUIDELLM_READY, 1, self.process, IMPORT_TIMEOUT_S)
        return time.monotonic() - self.started

    def run(self, name: str, spec: dict, key: str | None) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps({"name": name, "spec": spec, "key": key}) + "\n")
        self.process.stdin.flush()
        self.finished += 1
        _wait_for_line(self.log_path, GUIDELLM_DONE, self.finished, self.process, RUN_TIMEOUT_S)


def guidellm_spec(server: RunningServer, model_dir: Path, dataset: Path, result: Path, concurrency: int,
                  requests: int | None = None, duration_s: float | None = None) -> dict:
    """What `guidellm run` takes for the same load as bench_argv: our JSONL (prompt + output_tokens, mapped onto GuideLLM's
    columns), /v1/completions, greedy, a fixed number of streams, N requests (or a duration), a JSON result."""
    constraints = [{"kind": "max_requests", "count": requests}] if requests else [{"kind": "max_duration", "seconds": duration_s}]
    return {
        "backend": {"kind": "openai_http", "target": server.base_url.removesuffix("/v1"), "model": server.served_name,
                    "request_format": "/v1/completions", "extras": {"body": {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": [concurrency]},
        "constraints": constraints,
        "tokenizer": {"kind": "huggingface_auto", "model": str(model_dir)},
        "data": [{"kind": "json_file", "path": str(dataset)}],
        "data_column_mapper": {"kind": "generative_column_mapper",
                               "column_mappings": {"text_column": "prompt", "output_tokens_count_column": "output_tokens"}},
        "outputs": [{"kind": "json", "path": str(result)}],
    }


def read_guidellm(path: Path) -> dict:
    """The figures of GuideLLM's JSON report that the comparison uses (its one benchmark's successful requests)."""
    report = json.loads(path.read_text())
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"] if "request_totals" in metrics else benchmark.get("request_totals", {})

    def successful(name: str, stat: str) -> float:
        return float(metrics[name]["successful"][stat])

    def pct(name: str, p: str) -> float:
        return float(metrics[name]["successful"]["percentiles"][p])

    requests = benchmark.get("requests", {}).get("successful", [])
    outputs = [r.get("output_metrics", {}).get("text_tokens") or r.get("output_tokens") for r in requests]
    return {
        "duration_s": float(benchmark["duration"]),
        "output_tok_s": successful("output_tokens_per_second", "mean") if "output_tokens_per_second" in metrics else 0.0,
        "completed": int(totals.get("successful", len(requests))), "failed": int(totals.get("errored", 0)),
        "ttft_p50_ms": pct("time_to_first_token_ms", "p50"), "ttft_p95_ms": pct("time_to_first_token_ms", "p95"),
        "itl_p50_ms": pct("inter_token_latency_ms", "p50"), "itl_p95_ms": pct("inter_token_latency_ms", "p95"),
        "output_tokens": [int(o) for o in outputs if o is not None],
    }


def demo_items(model_dir: Path, count: int, output_tokens: int, work_dir: Path) -> list[WorkloadItem]:
    """`count` prompts of the demo eval sets, as the load test builds them, each asking exactly `output_tokens` tokens (the
    workload's own lengths are capped by each set's answer limit: a multiple-choice set's is a token or two)."""
    sets = select_eval_sets(list(DEMO_EVAL_SETS))
    prompts = load_all_prompts(sets, materialize_tasks(sets, work_dir / "tasks"), tokenizer_dir=model_dir)
    workload = build_workload(sets, prompts, count, output_tokens, model_dir, ServeSettings().max_model_len, None)
    return [item.model_copy(update={"output_tokens": output_tokens}) for item in workload.first(count)]


def summarize(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / mean if len(values) > 1 and mean else 0.0)


def measure(args: argparse.Namespace, work: Path) -> dict:
    model_dir = DEMO_MODEL_DIR
    items = demo_items(model_dir, args.requests, 16, work)
    dataset = write_dataset(items, work / "prompts.jsonl")
    varied = write_dataset([i.model_copy(update={"output_tokens": VARIED_LENGTHS[n % len(VARIED_LENGTHS)]})
                            for n, i in enumerate(items[:FEATURE_REQUESTS])], work / "varied.jsonl")
    results = work / "results"
    results.mkdir()
    runs: list[dict] = []
    with BenchDriver(work / "vllm") as vllm, GuideLLMDriver(work, "guidellm", {}) as guide, \
            GuideLLMDriver(work, "guidellm-1", {"GUIDELLM__MAX_WORKER_PROCESSES": "1"}) as guide1, \
            vllm_server(model_dir, log_path=work / "server.log", settings=ServeSettings(), served_name="baseline") as server:
        assert vllm.process is not None and guide.process is not None and guide1.process is not None
        _wait_for_line(vllm.log_path, VLLM_READY, 1, vllm.process, IMPORT_TIMEOUT_S)
        imports = {VLLM: None, GUIDELLM: guide.wait_ready(), GUIDELLM_1: guide1.wait_ready()}

        def vllm_run(name: str, path: Path, requests: int) -> dict:
            run = PlannedRun(role="baseline", concurrency=args.concurrency, repeat=len(runs), requests=requests)
            argv = bench_argv(run, server, model_dir, path, results, [])
            argv[argv.index("--result-filename") + 1] = f"{name}.json"
            vllm.run([(run, argv)], {"baseline": server}, timeout_s=RUN_TIMEOUT_S)
            result = read_result(results / f"{name}.json")
            return {"duration_s": result.duration, "output_tok_s": result.output_throughput, "completed": result.completed,
                    "failed": result.failed, "ttft_p50_ms": result.p50_ttft_ms, "ttft_p95_ms": result.p95_ttft_ms,
                    "itl_p50_ms": result.p50_itl_ms, "itl_p95_ms": result.p95_itl_ms,
                    "total_output_tokens": result.total_output_tokens}

        def guide_run(driver: GuideLLMDriver, name: str, path: Path, requests: int | None, duration_s: float | None = None) -> dict:
            out = results / f"{name}.json"
            driver.run(name, guidellm_spec(server, model_dir, path, out, args.concurrency, requests, duration_s), server.api_key)
            figures = read_guidellm(out)
            figures["total_output_tokens"] = sum(figures.pop("output_tokens"))
            return figures

        def timed(tool: str, name: str, call, pid: int) -> dict:
            client0, server0, wall0 = cpu_seconds(pid), tree_cpu_seconds(server.process.pid), time.monotonic()
            figures = call()
            wall = time.monotonic() - wall0
            record = {"tool": tool, "name": name, "wall_s": wall, "client_cpu_s": cpu_seconds(pid) - client0,
                      "server_cpu_s": tree_cpu_seconds(server.process.pid) - server0, **figures}
            record["overhead_s"] = wall - record["duration_s"]
            print(f"{name:>22}: {record['output_tok_s']:7.1f} tok/s, {record['duration_s']:5.2f} s run, {wall:5.2f} s wall, "
                  f"client {record['client_cpu_s']:5.2f} CPU s, server {record['server_cpu_s']:5.2f} CPU s", flush=True)
            return record

        tools = {
            VLLM: lambda name, path, n: timed(VLLM, name, lambda: vllm_run(name, path, n), vllm.process.pid),
            GUIDELLM: lambda name, path, n: timed(GUIDELLM, name, lambda: guide_run(guide, name, path, n), guide.process.pid),
            GUIDELLM_1: lambda name, path, n: timed(GUIDELLM_1, name, lambda: guide_run(guide1, name, path, n), guide1.process.pid),
        }
        for tool, call in tools.items():
            call(f"{SHORT[tool]}-warmup", dataset, args.concurrency * 3)
        for round_ in range(args.rounds):
            order = list(tools) if round_ % 2 == 0 else list(reversed(tools))
            for tool in order:
                record = tools[tool](f"{SHORT[tool]}-r{round_}", dataset, args.requests)
                runs.append({**record, "round": round_})
        features = {tool: tools[tool](f"{SHORT[tool]}-varied", varied, FEATURE_REQUESTS) for tool in tools}
        expected = sum(VARIED_LENGTHS[n % len(VARIED_LENGTHS)] for n in range(FEATURE_REQUESTS))
        duration = timed(GUIDELLM_1, "guidellm-duration",
                         lambda: guide_run(guide1, "guidellm-duration", dataset, None, DURATION_CHECK_S), guide1.process.pid)
    return {"runs": runs, "imports_s": imports, "features": features, "varied_expected_tokens": expected,
            "duration_check": duration}


def report(data: dict) -> list[str]:
    runs = data["runs"]
    lines = ["| tool | output tok/s (mean) | CV | client CPU s/run | server CPU s/run | run s | overhead s/run | TTFT p95 ms | import s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for tool in SHORT:
        mine = [r for r in runs if r["tool"] == tool]
        tok, cv = summarize([r["output_tok_s"] for r in mine])
        cells = [statistics.fmean([r[k] for r in mine]) for k in ("client_cpu_s", "server_cpu_s", "duration_s", "overhead_s", "ttft_p95_ms")]
        imported = data["imports_s"][tool]
        lines.append(f"| {tool} | {tok:.1f} | {cv:.1%} | {cells[0]:.2f} | {cells[1]:.2f} | {cells[2]:.2f} | {cells[3]:.2f} | "
                     f"{cells[4]:.0f} | {'-' if imported is None else f'{imported:.1f}'} |")
    lines.append("")
    for tool in (GUIDELLM, GUIDELLM_1):
        ratios = []
        for round_ in sorted({r["round"] for r in runs}):
            pair = {r["tool"]: r["output_tok_s"] for r in runs if r["round"] == round_}
            ratios.append(pair[tool] / pair[VLLM])
        lines.append(f"{tool} / vllm bench tok/s per round: {', '.join(f'{r:.3f}' for r in ratios)} "
                     f"(geometric mean {statistics.geometric_mean(ratios):.3f})")
    for tool, record in data["features"].items():
        lines.append(f"per-prompt output lengths, {tool}: {record['total_output_tokens']} tokens generated, "
                     f"{data['varied_expected_tokens']} asked, {record['completed']} requests")
    check = data["duration_check"]
    lines.append(f"GuideLLM (1 worker) to a fixed {DURATION_CHECK_S:.0f} s: ran {check['duration_s']:.2f} s, {check['completed']} requests, "
                 f"wall {check['wall_s']:.2f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.benchmarks.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--keep", type=Path, help="work in this (new) folder and keep it: datasets, tools' logs and results")
    args = parser.parse_args(argv)
    if not GUIDELLM_PYTHON.is_file():
        print(f"GuideLLM is not installed: this benchmark needs {GUIDELLM_PYTHON.parent.parent.name} (see this module's docstring)",
              file=sys.stderr)
        return 2
    profile = host_profile()
    started = time.monotonic()
    if args.keep:
        args.keep.mkdir(parents=True)
        data = measure(args, args.keep.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="quantgate-loadgen-") as tmp:
            data = measure(args, Path(tmp))
    data["host"] = {"class": profile.host_class, "cpu": profile.cpu_model, "vllm": profile.vllm_version,
                    "guidellm": _guidellm_version(), "wall_s": time.monotonic() - started,
                    "date": time.strftime("%Y-%m-%d")}
    print(f"\nhost {profile.host_class} ({profile.cpu_model}), vLLM {profile.vllm_version}, GuideLLM {data['host']['guidellm']}, "
          f"{data['host']['date']}, {data['host']['wall_s']:.0f} s in all\n")
    print("\n".join(report(data)))
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    return 0


def _guidellm_version() -> str:
    result = subprocess.run([str(GUIDELLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('guidellm'))"],
                            capture_output=True, text=True, check=False)
    return result.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
