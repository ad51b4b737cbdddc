"""Driving the field tool, `vllm bench serve`, and reading its result files.

Why vLLM's benchmark and not GuideLLM: it is part of the vLLM already installed in the serve environment
(no third environment: GuideLLM is not installed and pins its own dependencies), it reads a JSONL of our own
prompts with a per-prompt output length (`--dataset-name custom`, `output_tokens`), it bounds concurrency
(`--max-concurrency`), reports TTFT/TPOT/ITL at the percentiles asked and goodput under SLOs (`--goodput`),
and writes one JSON result per run (`--save-result`). Neither tool gives a verdict or compares two models:
that part is ours (figures, verdict).

The whole sweep runs in one process of the serve environment (vllm_bench_driver.py: the tool's own parser
and `main`, run after run), which pays vLLM's import once. Its output goes to a log file; the product's
progress bar follows the driver's one line per finished run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.console.progress import Bar
from pipelines.errors import LoadTestError
from pipelines.loadtest.config import sweep_levels  # noqa: F401 - re-exported: the levels are part of the plan (config)
from pipelines.loadtest.vllm_bench_driver import DONE_PREFIX  # stdlib only at import: it never imports vllm here
from pipelines.schema import FrozenModel
from pipelines.serve.reclaim import die_with_parent
from pipelines.serve.serving import RunningServer, log_tail
from pipelines.settings import current as current_settings

DRIVER = Path(__file__).with_name("vllm_bench_driver.py")
TOOL_NAME = "vllm bench serve"
TOOL_MODULE = "vllm.benchmarks.serve"
PERCENTILES = (50, 95, 99)
PERCENTILE_METRICS = ("ttft", "tpot", "itl")
Role = Literal["baseline", "candidate"]
CLIENT_NICE = -10  # the tool's scheduling priority: raised over the servers' (see BenchDriver)
POLL_S = 0.1  # how often a batch's progress is read from the tool's log (a pair of runs lasts seconds)
EXIT_WAIT_S = 5.0  # after its stdin closes, the tool's time to exit before it is killed


class BenchResult(BaseModel):
    """The figures of one `vllm bench serve --save-result` file this project reads (the file holds more)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    completed: int = Field(ge=0)
    failed: int = Field(ge=0)
    duration: float = Field(gt=0)
    max_concurrency: int | None = None
    total_input_tokens: int = Field(ge=0)
    total_output_tokens: int = Field(ge=0)
    request_throughput: float = Field(ge=0)
    output_throughput: float = Field(ge=0)
    request_goodput: float | None = Field(default=None, ge=0)
    p50_ttft_ms: float = Field(ge=0)
    p95_ttft_ms: float = Field(ge=0)
    p99_ttft_ms: float = Field(ge=0)
    p50_tpot_ms: float = Field(ge=0)
    p95_tpot_ms: float = Field(ge=0)
    p99_tpot_ms: float = Field(ge=0)
    p50_itl_ms: float = Field(ge=0)
    p95_itl_ms: float = Field(ge=0)
    p99_itl_ms: float = Field(ge=0)

    @property
    def good_requests(self) -> int | None:
        """Requests that met every SLO target: the tool reports them as a rate over the run's duration."""
        return None if self.request_goodput is None else round(self.request_goodput * self.duration)


def read_result(path: Path) -> BenchResult:
    """One result file; a missing, malformed or incomplete one is a LoadTestError naming it and the field."""
    try:
        return BenchResult.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise LoadTestError("vLLM bench serve wrote no result file", file=path) from None
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise LoadTestError(f"unreadable vLLM bench serve result: {first['msg']}", file=path, field=field) from None


class PlannedRun(FrozenModel):
    """One invocation of the tool: a model at a concurrency, the n-th repeat (a warm-up is not measured)."""

    role: Role
    concurrency: int = Field(ge=1)
    repeat: int = Field(ge=0)
    requests: int = Field(ge=1)
    warmup: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}-warmup-c{self.concurrency}" if self.warmup else f"{self.role}-c{self.concurrency}-r{self.repeat}"

    @property
    def result_file(self) -> str:
        return f"{self.name}.json"


def plan_runs(levels: list[int], roles: list[Role], repeats: int, requests_at, *, warmup: bool = True) -> list[PlannedRun]:
    """A warm-up per model (unless the caller warmed the servers), then each level `repeats` times per model; the model
    that goes first alternates from one repeat to the next, so that a drift of the machine's speed falls on both alike."""
    runs = [PlannedRun(role=role, concurrency=min(levels[-1], 4), repeat=0, requests=requests_at(1), warmup=True)
            for role in roles] if warmup and levels else []
    for level in levels:
        for repeat in range(repeats):
            order = roles if repeat % 2 == 0 else list(reversed(roles))
            runs += [PlannedRun(role=role, concurrency=level, repeat=repeat, requests=requests_at(level)) for role in order]
    return runs


def key_variable(role: Role) -> str:
    return f"QUANTGATE_BENCH_KEY_{role.upper()}"


def bench_argv(run: PlannedRun, server: RunningServer, tokenizer_dir: Path, dataset: Path, result_dir: Path, goodput: list[str]) -> list[str]:
    """`vllm bench serve` arguments for one run: our prompts and output lengths, exactly that many tokens generated
    (--ignore-eos: both models do the same work), greedy, bounded concurrency, percentiles, goodput, result file."""
    argv = [
        "--backend", "openai",
        "--base-url", server.base_url.removesuffix("/v1"),
        "--endpoint", "/v1/completions",
        "--model", server.served_name,
        "--tokenizer", str(tokenizer_dir),
        "--dataset-name", "custom",
        "--dataset-path", str(dataset),
        "--custom-output-len", "-1",  # each line's output_tokens
        "--skip-chat-template",  # the prompts are already what lm-eval sends (templated where the set asks)
        "--disable-shuffle",
        "--num-prompts", str(run.requests),
        "--max-concurrency", str(run.concurrency),
        "--ignore-eos",
        "--temperature", "0",
        "--seed", "0",
        "--percentile-metrics", ",".join(PERCENTILE_METRICS),
        "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", run.result_file,
        "--label", run.name,
        "--disable-tqdm",
    ]
    return argv + (["--goodput", *goodput] if goodput else [])


def driver_environment() -> dict[str, str]:
    """The driver's environment: offline, nothing of the project environment, no OpenAI key of the user's."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "OPENAI_API_KEY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


class BenchDriver:
    """The tool's process (vllm_bench_driver.py), started before the servers are ready so that vLLM's import
    overlaps their start and scoring; each `run` hands it one batch of runs and the servers' keys (on its stdin: never
    on a command line or in a file) and waits for that batch, so that a caller can decide the next batch from the last
    one's results (the paired comparison). Its output goes to `<work_dir>/vllm-bench.log` (removed again when it was
    never used). It ends when the block ends (its stdin closed, then killed), and gets SIGKILL if this process dies
    (parent-death signal). A driver that cannot start is an error only when it is asked to run.

        with BenchDriver(work_dir) as driver:
            ... start servers, write datasets ...
            driver.run(runs, servers, timeout_s=..., bar=bar)     # as many batches as needed
    """

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.log_path = work_dir / "vllm-bench.log"
        self.process: subprocess.Popen | None = None
        self.start_error: OSError | None = None
        self.used = False
        self.batches = 0
        self.finished = 0  # runs the tool has finished, over every batch
        self.in_flight = False  # a batch was handed over and not seen through
        self.priority = "not started"

    def __enter__(self) -> BenchDriver:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        python = current_settings().serve_python
        try:
            with self.log_path.open("w") as log:
                self.process = subprocess.Popen(
                    [str(python), str(DRIVER)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True,
                    env=driver_environment(), cwd=self.work_dir, preexec_fn=die_with_parent(signal.SIGKILL),
                )
        except OSError as error:  # no serve environment: said when the load test needs it
            self.start_error = error
            return self
        self.priority = _raise_priority(self.process.pid)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        process = self.process
        if process is not None and process.poll() is None and (exc_type is not None or self.in_flight):
            process.kill()  # an error or Ctrl-C, or a batch left running: no reason to let it finish
        if process is not None and process.stdin is not None:
            try:
                process.stdin.close()  # no more batches: the tool exits by itself
            except OSError:
                pass
        if process is not None and process.poll() is None:
            try:
                process.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if not self.used:  # started early for a load test that did not run: leave nothing behind
            self.log_path.unlink(missing_ok=True)
            try:
                self.work_dir.rmdir()
            except OSError:
                pass

    def run(self, runs: list[tuple[PlannedRun, list[str]]], servers: dict[Role, RunningServer], *, timeout_s: float,
            bar: Bar | None = None) -> None:
        """One batch of runs, in order; returns when the tool has finished them. A failing tool, a server that dies or
        the time limit is an error (exit 2)."""
        self.used = True
        process = self.process
        if process is None or process.stdin is None:
            raise LoadTestError(f"could not start vLLM bench serve from the serve environment ({self.start_error})",
                                file=current_settings().serve_python)
        self.batches += 1
        plan = self.work_dir / f"bench-plan-{self.batches}.json"
        plan.write_text(json.dumps({"runs": [{"name": run.name, "argv": argv, "key_env": key_variable(run.role)} for run, argv in runs]}, indent=1))
        order = {"plan": str(plan), "keys": {key_variable(role): server.api_key or "" for role, server in servers.items()}}
        try:
            process.stdin.write(json.dumps(order) + "\n")
            process.stdin.flush()
        except OSError:  # it died while importing: its log says why (below)
            pass
        target = self.finished + len(runs)
        self.in_flight = True
        _watch(process, servers, self.log_path, Batch(offset=self.finished, target=target, deadline=time.monotonic() + timeout_s,
                                                      timeout_s=timeout_s), bar)
        self.finished, self.in_flight = target, False


class Batch(FrozenModel):
    offset: int  # runs finished before this batch
    target: int  # runs finished once it is done
    deadline: float
    timeout_s: float


def _raise_priority(pid: int) -> str:
    """The tool runs at nice CLIENT_NICE where this process may set it (root), else at the default, and says which.

    On a 2-core host the tool shares the cores with the servers it measures (API server, engine core, worker). Starved,
    it sends requests and reads their streams late: measured with the demo model at concurrency 16, half the runs fell
    into a regime where every request's tokens arrived in one burst at its end and the run took 3-4 times as long (an
    A/A test's pair ratios 0.21-4.9); at nice -10 one run in ten did. A load generator must not be the bottleneck of
    what it measures."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, CLIENT_NICE)
    except OSError as error:
        return f"default (raising it was refused: {error.strerror or error})"
    return f"nice {CLIENT_NICE}"


def _watch(process: subprocess.Popen, servers: dict[Role, RunningServer], log_path: Path, batch: Batch, bar: Bar | None) -> None:
    while (done := finished_runs(log_path)) < batch.target:
        if process.poll() is not None:
            raise LoadTestError(f"vLLM bench serve failed (exit code {process.returncode}): {log_tail(log_path, 3)}", file=log_path)
        for server in servers.values():
            if server.process.poll() is not None:
                process.kill()
                server.check_alive()
        if time.monotonic() > batch.deadline:
            process.kill()
            raise LoadTestError(f"vLLM bench serve did not finish within {batch.timeout_s:.0f} s (performance.load.timeout_s)", file=log_path)
        if bar is not None:
            bar.update(completed=done - batch.offset)
        time.sleep(POLL_S)
    if bar is not None:
        bar.update(completed=batch.target - batch.offset)


def finished_runs(log_path: Path) -> int:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if line.startswith(DONE_PREFIX))
