"""The load test's parts without a server: policy block, the tool's result file, sweep plan and arguments,
figures and ratio intervals, checks and enforcement, tuning, workload, KV and memory, report sections, plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from fakes import make_eval_set
from scipy import stats

from pipelines.errors import InputError, LoadTestError
from pipelines.evaluation.evaluate import Prompt
from pipelines.gate.policy import DEFAULT_POLICY, load_policy
from pipelines.loadtest import bench, figures, memory, render, sequential, tuning, verdict
from pipelines.loadtest.bench import BenchResult, PlannedRun
from pipelines.loadtest.config import ComparisonSettings, LoadSettings, PerformanceOverrides, PerformancePolicy
from pipelines.loadtest.plots import write_plots
from pipelines.loadtest.results import (
    Check,
    ComparisonPair,
    LevelFigures,
    LevelRatio,
    MemoryGain,
    ModelFigures,
    Percentiles,
    PerformanceReport,
    RatioInterval,
    RunFigures,
    SpeedComparison,
    SpeedConclusion,
)
from pipelines.loadtest.workload import Workload, WorkloadItem, answer_limit, select_prompts, write_dataset
from pipelines.paths import DEMO_MODEL_DIR
from pipelines.serve.serving import ServeSettings

DATA = Path(__file__).resolve().parents[2] / "data" / "loadtest"
RESULT = DATA / "vllm-bench-serve-result.json"  # a real `vllm bench serve --save-result` file (demo model, concurrency 16)


# --------------------------------------------------------------------------------- the policy block


def write_policy(tmp_path: Path, performance: str) -> Path:
    text = DEFAULT_POLICY.read_text().split("\nperformance:")[0]  # the shipped rules, our own performance block
    path = tmp_path / "policy.yaml"
    path.write_text(text + "\n" + performance)
    return path


def test_the_shipped_policy_has_a_performance_block_with_a_recipe_override():
    policy = load_policy(DEFAULT_POLICY)
    assert policy.performance.enabled and policy.performance.enforce == "auto"
    assert policy.performance_for("w8a8") == policy.performance


@pytest.mark.parametrize("field, value", [
    ("min_throughput_ratio", "0"), ("min_throughput_ratio", "-0.5"), ("max_ttft_p95_ratio", "0"),
    ("slo.ttft_ms", "0"), ("slo.tpot_ms", "-1"), ("slo.min_good_fraction", "0"), ("slo.min_good_fraction", "1.5"),
    ("load.repeats", "0"), ("load.min_requests", "-3"), ("load.output_tokens", "0"), ("min_throughput_ratio", ".nan"),
    ("comparison.budget_s", "-60"), ("comparison.budget_s", ".inf"), ("comparison.budget_s", ".nan"), ("comparison.budget_s", "soon"),
    ("comparison.budget_s", "5"), ("min_throughput_ratio", "fast"), ("min_throughput_ratio", ".inf"), ("comparison.min_run_s", "0"),
])
def test_a_value_no_measurement_can_meet_is_refused_naming_file_and_field(tmp_path, field, value):
    outer, _, inner = field.rpartition(".")
    block = f"performance:\n  {outer}:\n    {inner}: {value}\n" if outer else f"performance:\n  {inner}: {value}\n"
    path = write_policy(tmp_path, block)
    with pytest.raises(InputError) as caught:
        load_policy(path)
    assert caught.value.file == str(path) and caught.value.field == f"performance.{field}"


def test_a_recipe_override_names_only_what_it_changes_nested_blocks_included(tmp_path):
    path = write_policy(tmp_path, "performance:\n  slo: {ttft_ms: 500}\n")
    override = "    performance: {min_throughput_ratio: null, slo: {tpot_ms: 50}, enforce: always}\n"
    path.write_text(path.read_text().replace("recipes:\n  w4a16:\n", "recipes:\n  w4a16:\n" + override))
    policy = load_policy(path)
    w4a16, w8a8 = policy.performance_for("w4a16"), policy.performance_for("w8a8")
    assert (w8a8.slo.ttft_ms, w8a8.slo.tpot_ms, w8a8.min_throughput_ratio, w8a8.enforce) == (500, 200, 0.9, "auto")
    assert (w4a16.slo.ttft_ms, w4a16.slo.tpot_ms, w4a16.min_throughput_ratio, w4a16.enforce) == (500, 50, None, "always")
    assert policy.for_set("w4a16", "x").max_kl == 0.2  # the quality rules of the same override still apply


def test_an_override_cannot_null_what_is_not_a_threshold():
    with pytest.raises(ValueError, match="repeats cannot be null"):
        PerformanceOverrides.model_validate({"load": {"repeats": None}})
    assert PerformancePolicy().merged(PerformanceOverrides.model_validate({"max_ttft_p95_ratio": None})).max_ttft_p95_ratio is None


def test_a_bad_performance_block_is_exit_2_before_any_work(tmp_path, capsys):
    from pipelines.cli import main

    path = write_policy(tmp_path, "performance:\n  slo:\n    ttft_ms: -5\n")
    code = main(["loadtest", "--model", str(DEMO_MODEL_DIR), "--policy", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"quantize: error: {path}: performance.slo.ttft_ms: ") and "greater than 0" in err[0]


# --------------------------------------------------------------------------------- the tool's result file


def test_a_real_result_file_is_read_and_sane():
    result = bench.read_result(RESULT)
    assert (result.completed, result.failed, result.max_concurrency) == (32, 0, 16)
    assert result.request_throughput > 0 and result.output_throughput > 0
    for metric in ("ttft", "tpot", "itl"):
        p50, p95, p99 = (getattr(result, f"p{p}_{metric}_ms") for p in (50, 95, 99))
        assert 0 <= p50 <= p95 <= p99, metric
    assert result.good_requests == 32  # request_goodput x duration: every request met the SLO of that run


@pytest.mark.parametrize("damage, field", [("p95_ttft_ms", "p95_ttft_ms"), ("completed", "completed")])
def test_a_result_file_missing_a_figure_is_an_error_naming_it(tmp_path, damage, field):
    data = json.loads(RESULT.read_text())
    del data[damage]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(LoadTestError) as caught:
        bench.read_result(path)
    assert caught.value.file == str(path) and caught.value.field == field


def test_no_result_file_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(LoadTestError, match="wrote no result file"):
        bench.read_result(tmp_path / "missing.json")


# --------------------------------------------------------------------------------- sweep, plan, arguments


@pytest.mark.parametrize("top, levels", [(1, [1]), (2, [1, 2]), (12, [1, 2, 4, 8, 12]), (16, [1, 2, 4, 8, 16])])
def test_the_sweep_doubles_up_to_the_top(top, levels):
    assert bench.sweep_levels(top) == levels


def test_repeats_alternate_which_model_goes_first_after_one_warm_up_each():
    runs = bench.plan_runs([1, 2], ["baseline", "candidate"], 3, LoadSettings().requests_at)
    assert [(r.role, r.warmup) for r in runs[:2]] == [("baseline", True), ("candidate", True)]
    level_one = [(r.repeat, r.role) for r in runs[2:] if r.concurrency == 1]
    assert level_one == [(0, "baseline"), (0, "candidate"), (1, "candidate"), (1, "baseline"), (2, "baseline"), (2, "candidate")]
    assert {r.requests for r in runs if r.concurrency == 2 and not r.warmup} == {8}
    assert LoadSettings().requests_at(16) == 32 and len({r.result_file for r in runs}) == len(runs)


def test_the_tool_gets_our_prompts_lengths_and_slos_and_never_a_key(tmp_path):
    server = type("S", (), {"base_url": "http://127.0.0.1:9/v1", "served_name": "candidate", "api_key": "secret-key"})()
    run = PlannedRun(role="candidate", concurrency=4, repeat=1, requests=8)
    argv = bench.bench_argv(run, server, Path("/m"), tmp_path / "w.jsonl", tmp_path, ["ttft:2000", "tpot:200"])
    text = " ".join(argv)
    for expected in ("--dataset-name custom", "--custom-output-len -1", "--max-concurrency 4", "--num-prompts 8", "--ignore-eos",
                     "--percentile-metrics ttft,tpot,itl", "--metric-percentiles 50,95,99", "--goodput ttft:2000 tpot:200",
                     "--save-result", "--result-filename candidate-c4-r1.json", "--base-url http://127.0.0.1:9 "):
        assert expected in text, expected
    assert "secret-key" not in text and bench.key_variable("candidate") == "QUANTGATE_BENCH_KEY_CANDIDATE"


# --------------------------------------------------------------------------------- figures and ratios


def result(throughput: float, ttft_p95: float, *, good: int | None = 8, failed: int = 0) -> BenchResult:
    data = json.loads(RESULT.read_text())
    data.update(output_throughput=throughput, p50_ttft_ms=ttft_p95 / 2, p95_ttft_ms=ttft_p95, p99_ttft_ms=ttft_p95 * 1.1,
                completed=8 - failed, failed=failed,
                duration=1.0, request_goodput=None if good is None else float(good))
    return BenchResult.model_validate(data)


def test_the_ratio_is_the_geometric_mean_of_paired_runs_with_a_t_interval_on_the_logs():
    candidate, baseline = [110.0, 121.0, 99.0], [100.0, 110.0, 100.0]
    ratio = sequential.ratio_interval(candidate, baseline)
    logs = [math.log(c / b) for c, b in zip(candidate, baseline, strict=True)]
    mean, sd = sum(logs) / 3, stats.tstd(logs)
    half = stats.t.ppf(0.99, 2) * sd / math.sqrt(3)  # the sequential rule's critical value (sequential.py)
    assert ratio.estimate == pytest.approx(math.exp(mean))
    assert (ratio.low, ratio.high) == (pytest.approx(math.exp(mean - half)), pytest.approx(math.exp(mean + half)))
    assert ratio.low < ratio.estimate < ratio.high and ratio.pairs == 3
    single = sequential.ratio_interval([2.0], [1.0])
    assert (single.estimate, single.low, single.high) == (2.0, None, None)
    assert sequential.ratio_interval([0.0], [1.0]) is None


def test_levels_take_the_median_of_repeats_and_pool_the_good_requests():
    level = figures.level_figures(4, [result(100, 50, good=8), result(300, 70, good=4), result(200, 60, good=6, failed=1)], with_slo=True)
    assert (level.output_throughput, level.ttft_ms.p95, level.runs, level.requests, level.failed) == (200, 60, 3, 24, 1)
    assert level.good_fraction == pytest.approx(18 / 23)
    assert level.ttft_ms.p50 <= level.ttft_ms.p95 <= level.ttft_ms.p99
    assert figures.level_figures(4, [result(1, 1, good=None)], with_slo=False).good_fraction is None


def test_ratios_pair_repeat_r_of_the_candidate_with_repeat_r_of_the_baseline():
    results = {}
    for repeat, (base, cand) in enumerate([(100, 50), (200, 100), (400, 200)]):
        results[PlannedRun(role="baseline", concurrency=2, repeat=repeat, requests=8)] = result(base, 10)
        results[PlannedRun(role="candidate", concurrency=2, repeat=repeat, requests=8)] = result(cand, 30)
    results[PlannedRun(role="candidate", concurrency=2, repeat=0, requests=8, warmup=True)] = result(1, 1000)
    (ratio,) = figures.level_ratios(results)
    assert ratio.throughput.estimate == pytest.approx(0.5) and ratio.throughput.high == pytest.approx(0.5)
    assert ratio.ttft_p95.estimate == pytest.approx(3.0)


# --------------------------------------------------------------------------------- checks, enforcement, verdict


def level(concurrency: int, *, good: float | None = 1.0, failed: int = 0, throughput: float = 100.0) -> LevelFigures:
    ms = Percentiles(p50=10, p95=20, p99=30)
    return LevelFigures(concurrency=concurrency, runs=3, requests=24, completed=24 - failed, failed=failed, request_throughput=1,
                        output_throughput=throughput, ttft_ms=ms, tpot_ms=ms, itl_ms=ms, goodput=1, good_fraction=good)


@pytest.mark.parametrize("target, enforce, enforced", [
    ("cpu", "auto", False), ("cuda:9.0", "auto", True), ("cpu", "always", True), ("cuda:8.9", "never", False),
])
def test_auto_enforces_on_a_gpu_target_and_reports_only_on_a_cpu_target(target, enforce, enforced):
    applies, sentence = verdict.enforcement(PerformancePolicy(enforce=enforce), target)
    assert applies is enforced and ("enforced" if enforced else "report-only") in sentence and enforce in sentence


def speed(throughput: RatioInterval, ttft: RatioInterval | None = None, *, concurrency: int = 16) -> SpeedComparison:
    """A paired comparison's result with these intervals (the pairs' own figures are not read by the checks)."""
    figures_ = RunFigures(output_throughput=100.0, p95_ttft_ms=20.0, duration_s=2.0)
    pairs = [ComparisonPair(index=i, first="baseline", baseline=figures_, candidate=figures_, throughput_ratio=1.0, ttft_p95_ratio=1.0)
             for i in range(throughput.pairs)]
    return SpeedComparison(
        concurrency=concurrency, requests_per_run=128, warmup_rates={"baseline": 50.0, "candidate": 45.0}, pairs=pairs,
        throughput=SpeedConclusion(metric="t", interval=throughput, outcome=sequential.outcome(throughput, 0.1)),
        ttft_p95=SpeedConclusion(metric="f", interval=ttft, outcome=sequential.outcome(ttft, 0.1, higher_is_faster=False)),
        stopped="precise", seconds=30.0, settings=ComparisonSettings(), order_seed=7, method=sequential.METHOD,
    )


def test_an_impossible_slo_rejects_on_a_gpu_target_and_only_warns_on_a_cpu_target():
    policy = PerformancePolicy.model_validate({"slo": {"ttft_ms": 0.001}})
    compared = speed(RatioInterval(estimate=1.2, low=1.1, high=1.3, pairs=4), RatioInterval(estimate=0.9, low=0.8, high=1.0, pairs=4))
    found = verdict.checks(policy, 16, level(16, good=0.0), compared)
    assert [(c.name, c.status) for c in found] == [
        ("throughput_ratio", "passed"), ("ttft_p95_ratio", "passed"), ("slo_good_fraction", "failed"), ("errors", "passed")]
    from pipelines.gate.schema import GateResult, StatsSettings

    promoted = GateResult(recipe="w8a8", verdict="promoted", sets=[], fit=None, reasons=[], warnings=[], settings=StatsSettings())
    reasons, warnings = verdict.outcome(found, *verdict.enforcement(policy, "cuda:9.0")[:1], "cuda:9.0")
    judged = verdict.apply_to_gate(promoted, reasons, warnings)
    assert judged.verdict == "rejected" and judged.exit_code == 1
    assert judged.reasons == [
        "performance: 0.0% of requests met the SLO (ttft <= 0.001 ms, tpot <= 200 ms) at concurrency 16 < min_good_fraction 0.9"]
    reasons, warnings = verdict.outcome(found, *verdict.enforcement(policy, "cpu")[:1], "cpu")
    on_cpu = verdict.apply_to_gate(promoted, reasons, warnings)
    assert on_cpu.verdict == "promoted" and on_cpu.warnings[0].startswith("performance (report-only on cpu): 0.0% of requests")


def test_a_ratio_is_judged_on_its_whole_interval_and_an_interval_across_the_limit_is_inconclusive_never_passed():
    slower = speed(RatioInterval(estimate=0.8, low=0.7, high=0.85, pairs=4), RatioInterval(estimate=1.4, low=1.3, high=1.5, pairs=4))
    found = verdict.checks(PerformancePolicy(), 8, level(8, failed=2), slower)
    assert {c.name: c.text for c in found if c.status == "failed"} == {
        "throughput_ratio": "output throughput ratio 0.800 [95% CI 0.700, 0.850] at concurrency 8 < min_throughput_ratio 0.9",
        "ttft_p95_ratio": "TTFT p95 ratio 1.400 [95% CI 1.300, 1.500] at concurrency 8 > max_ttft_p95_ratio 1.25",
        "errors": "2 of 24 requests failed at concurrency 8",
    }
    across = speed(RatioInterval(estimate=0.95, low=0.6, high=1.5, pairs=30), RatioInterval(estimate=1.0, low=0.7, high=1.4, pairs=30))
    found = verdict.checks(PerformancePolicy(), 8, level(8), across)
    assert [(c.name, c.status) for c in found][:2] == [("throughput_ratio", "inconclusive"), ("ttft_p95_ratio", "inconclusive")]
    assert not any(c.passed for c in found[:2]) and "undecided against min_throughput_ratio 0.9" in found[0].text
    reasons, warnings = verdict.outcome(found, False, "cpu")
    assert reasons == [] and warnings[0].startswith("performance inconclusive: output throughput ratio 0.950")


def test_an_inconclusive_check_under_an_enforced_policy_is_an_error_naming_the_budget(tmp_path):
    performance = report(tmp_path, speed(RatioInterval(estimate=0.95, low=0.6, high=1.5, pairs=9)), enforce="always")
    error = verdict.inconclusive_error(performance)
    assert error is not None and error.exit_code == 2 and error.field == "performance.comparison.budget_s"
    assert "raise performance.comparison.budget_s (now 30 s)" in str(error) and "9 pairs in 30 s" in str(error)
    assert verdict.inconclusive_error(report(tmp_path, speed(RatioInterval(estimate=0.95, low=0.6, high=1.5, pairs=9)))) is None
    assert verdict.inconclusive_error(report(tmp_path, enforce="always")) is None  # decided: the verdict speaks


def test_enforce_true_and_false_are_always_and_never(tmp_path):
    assert PerformancePolicy.model_validate({"enforce": True}).enforce == "always"
    assert PerformancePolicy.model_validate({"enforce": False}).enforce == "never"
    with pytest.raises(ValueError, match="auto, always"):
        PerformancePolicy.model_validate({"enforce": "sometimes"})


def test_a_policy_without_thresholds_checks_only_errors():
    policy = PerformancePolicy.model_validate({"min_throughput_ratio": None, "max_ttft_p95_ratio": None})
    found = verdict.checks(policy, 4, level(4, good=None), speed(RatioInterval(estimate=1.0, low=0.9, high=1.1, pairs=4)))
    assert [c.name for c in found] == ["errors"]


def test_a_check_written_before_statuses_reads_back():
    check = Check.model_validate({"name": "errors", "value": 0, "limit": 0, "passed": False, "text": "t"})
    assert check.status == "failed" and check.model_dump()["passed"] is False
    assert Check.model_validate(check.model_dump()) == check


# --------------------------------------------------------------------------------- tuning


def model(levels: list[LevelFigures], role: str = "candidate") -> ModelFigures:
    return ModelFigures(role=role, model_dir="/m", served_by="quality gate", levels=levels)


def test_measured_max_num_seqs_is_the_top_of_the_passing_levels_from_one_up():
    policy = PerformancePolicy()
    assert tuning.measured_max_num_seqs(model([level(1), level(2), level(4, good=0.5), level(8)]), policy) == 2
    assert tuning.measured_max_num_seqs(model([level(1, failed=1), level(2)]), policy) is None
    assert tuning.measured_max_num_seqs(model([level(1, good=None), level(2, good=None)]), policy) == 2


def test_tuning_without_a_plan_deploys_with_the_servers_utilization(tmp_path):
    measured = tuning.measured_tuning(model([level(1), level(2)]), PerformancePolicy(), ServeSettings(), swept_up_to=2,
                                      limited_by="the servers' max_num_seqs", plan=None, artifact_dir=tmp_path, target="cpu")
    assert measured.measured_max_num_seqs == 2 and measured.gpu_memory_utilization == ServeSettings().memory_fraction
    assert measured.vllm_args == "--max-num-seqs 2 --max-model-len 512 --gpu-memory-utilization 0.20"
    assert "share of host memory" in measured.basis


def test_tuning_with_a_plan_asks_the_planner_for_the_measured_concurrency():
    from pipelines.gate.policy import FitRequirement
    from pipelines.loadtest.stage import plan_for

    plan = plan_for(FitRequirement(gpu="L4-24GB", max_model_len=512, concurrency=16), DEMO_MODEL_DIR)
    measured = tuning.measured_tuning(model([level(1), level(2), level(4)]), PerformancePolicy(), ServeSettings(), swept_up_to=4,
                                      limited_by=None, plan=plan, artifact_dir=DEMO_MODEL_DIR, target="cuda:8.9")
    assert measured.planner_max_num_seqs == 16 and measured.measured_max_num_seqs == 4
    assert measured.vllm_args.startswith("--max-num-seqs 4 --max-model-len 512 --gpu-memory-utilization ")
    assert "--max-num-batched-tokens" in measured.vllm_args and "L4" in measured.basis


# --------------------------------------------------------------------------------- workload


def test_prompts_are_taken_in_turn_from_each_set_in_a_seeded_order():
    prompts = {"b": [Prompt(doc_id=i, text=f"b{i}") for i in range(5)], "a": [Prompt(doc_id=i, text=f"a{i}") for i in range(2)]}
    chosen = select_prompts(prompts, 6)
    assert [name for name, _ in chosen] == ["a", "b", "a", "b", "b", "b"]
    assert chosen == select_prompts(prompts, 6) and len({p.text for _, p in chosen}) == 6
    assert len(select_prompts(prompts, 50)) == 7


def test_answer_limits_follow_the_sets_own_generation_settings(tmp_path):
    class Tokenizer:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": text.split()}

    generate = make_eval_set(tmp_path, "orders")
    assert answer_limit(generate, Tokenizer()).model_dump() == {"max_tokens": 256, "stop": ["\n\n"]}
    choice = generate.model_copy(update={"output_type": "multiple_choice", "config": {"doc_to_choice": ["a b c", "d"]}})
    assert answer_limit(choice, Tokenizer()).model_dump() == {"max_tokens": 3, "stop": ["\n"]}
    evalsets = __import__("pipelines.evaluation.evalsets", fromlist=["discover_eval_sets"])
    demo = [s for s in evalsets.discover_eval_sets() if s.name == "payment_reference"]
    if demo:
        assert answer_limit(demo[0], Tokenizer()).model_dump() == {"max_tokens": 24, "stop": ["\n"]}


def test_the_dataset_is_what_vllm_bench_custom_reads_and_cycles_when_short(tmp_path):
    items = [WorkloadItem(eval_set="a", doc_id=i, prompt=f"p{i}\n", prompt_tokens=3, output_tokens=i + 1) for i in range(3)]
    workload = Workload(items=items, output_tokens="baseline answers")
    path = write_dataset(workload.first(5), tmp_path / "w.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"prompt": f"p{i % 3}\n", "output_tokens": i % 3 + 1} for i in range(5)]
    assert workload.summary()["output_tokens"] == {"min": 1, "median": 2, "max": 3}


# --------------------------------------------------------------------------------- KV capacity and memory


def test_the_kv_line_vllm_logs_is_read_and_the_planner_predicts_it(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 524,288 tokens, "
                   "Maximum concurrency for 512 tokens per request: 1024.00x\n")
    assert memory.measured_kv(log) == (524_288, 1024.0)
    assert memory.predicted_kv(DEMO_MODEL_DIR, ServeSettings(), "cpu", log) == 524_288
    log.write_text("nothing\n")
    assert memory.measured_kv(log) == (None, None) and memory.predicted_kv(DEMO_MODEL_DIR, ServeSettings(), "cuda:9.0", log) is None


def test_the_memory_of_a_process_group_is_sampled():
    group = os.getpgid(0)
    with memory.MemorySampler({group}, interval_s=0.05) as sampler:
        blob = bytearray(64 * 1024 * 1024)
    value, method = sampler.peak[group]
    assert value > len(blob) and method in ("PSS", "RSS")


# --------------------------------------------------------------------------------- report sections and plots


def report(tmp_path: Path, compared: SpeedComparison | None = None, enforce: str = "auto") -> PerformanceReport:
    models = [model([level(1, throughput=100), level(2, throughput=180)], "baseline"),
              model([level(1, throughput=110), level(2, throughput=150)], "candidate")]
    compared = compared or speed(RatioInterval(estimate=0.83, low=0.78, high=0.88, pairs=5), concurrency=2)
    ratios = [LevelRatio(concurrency=1, throughput=RatioInterval(estimate=1.1, pairs=1), ttft_p95=None),
              LevelRatio(concurrency=2, throughput=compared.throughput.interval, ttft_p95=None)]
    plots = write_plots(models, tmp_path, "w8a8 against 16-bit")
    policy = PerformancePolicy(enforce=enforce)
    found = verdict.checks(policy, 2, models[1].levels[-1], compared)
    gain = MemoryGain(baseline_weight_bytes=8 * 2**20, candidate_weight_bytes=4 * 2**20, baseline_kv_tokens=1000, candidate_kv_tokens=1000)
    return PerformanceReport(
        tool={"name": "vllm bench serve", "module": "vllm.benchmarks.serve", "vllm": "0.32.0"}, target="cpu:avx512bf16",
        enforced=verdict.enforcement(policy, "cpu")[0], enforcement=verdict.enforcement(policy, "cpu")[1], policy=policy,
        workload={"prompts": 4, "eval_sets": {"a": 4}, "output_tokens_from": "baseline answers"}, levels=[1, 2],
        deployment_concurrency=2, models=models, ratios=ratios, interval_method=sequential.METHOD, checks=found, plots=plots,
        comparison=compared, memory=gain, buys=render.buys(compared, gain, "cpu:avx512bf16"),
    )


def test_plots_are_pngs_in_the_run_folder_and_report_md_links_them(tmp_path):
    from pipelines.gate.report import performance_markdown

    performance = report(tmp_path)
    assert performance.plots == {"throughput": "loadtest-throughput.png", "ttft_p95": "loadtest-ttft-p95.png"}
    for name in performance.plots.values():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = performance_markdown(performance)
    assert "](loadtest-throughput.png)" in text and "](loadtest-ttft-p95.png)" in text
    assert "| 2 | 0.830 [95% CI 0.780, 0.880] | - |" in text and "report-only" in text
    assert "failed: output throughput ratio 0.830 [95% CI 0.780, 0.880] at concurrency 2 < min_throughput_ratio 0.9" in text
    assert "**The candidate buys memory, not speed, on cpu:avx512bf16: throughput 0.83x [0.78, 0.88] (weights 4.0 MiB vs 8.0 MiB" in text
    assert "Performance failed (not enforced)" in text and "passed" not in text.split("### Checks")[0].split("Performance ")[1][:10]


@pytest.mark.parametrize("interval, words", [
    (RatioInterval(estimate=0.87, low=0.83, high=0.91, pairs=6), "buys memory, not speed, on cpu:avx512bf16: throughput 0.87x [0.83, 0.91]"),
    (RatioInterval(estimate=1.5, low=1.3, high=1.7, pairs=6), "buys memory and speed on cpu:avx512bf16: throughput 1.50x [1.30, 1.70]"),
    (RatioInterval(estimate=1.0, low=0.95, high=1.04, pairs=6), "buys memory, and speed is unchanged within 10% on cpu:avx512bf16"),
    (RatioInterval(estimate=1.0, low=0.7, high=1.4, pairs=6), "buys memory; speed on cpu:avx512bf16 is inconclusive after 6 pairs in 30 s"),
])
def test_what_the_candidate_buys_names_memory_always_and_speed_only_where_concluded(interval, words):
    gain = MemoryGain(baseline_weight_bytes=100, candidate_weight_bytes=50, baseline_kv_tokens=None, candidate_kv_tokens=None)
    assert render.buys(speed(interval), gain, "cpu:avx512bf16").startswith(words)


def test_the_summary_carries_the_comparisons_conclusion(tmp_path):
    summary = render.summary(report(tmp_path)).model_dump()
    assert summary == {"enforced": False, "passed": False, "target": "cpu:avx512bf16", "deployment_concurrency": 2, "throughput_ratio": 0.83,
                       "throughput_interval": [0.78, 0.88], "speed": "slower", "pairs": 5, "ttft_p95_ratio": None,
                       "measured_max_num_seqs": None, "buys": report(tmp_path).buys}


def test_gate_json_stays_schema_2_and_reads_back_with_or_without_performance(tmp_path):
    from pipelines.gate.schema import GateReport, GateResult, StatsSettings

    gate = GateResult(recipe="w8a8", verdict="promoted", sets=[], fit=None, reasons=[], warnings=[], settings=StatsSettings())
    with_it = GateReport(gate=gate, performance=report(tmp_path))
    back = GateReport.model_validate_json(with_it.model_dump_json())
    assert back.schema_version == 2 and back.performance == with_it.performance
    assert GateReport.model_validate({"gate": gate.model_dump()}).performance is None


def test_the_driver_module_imports_without_vllm():
    import importlib
    import sys

    module = importlib.import_module("pipelines.loadtest.vllm_bench_driver")
    assert module.DONE_PREFIX == bench.DONE_PREFIX and "vllm" not in sys.modules  # it runs in the serve environment only


def test_the_cost_benchmark_splits_stage_times_and_summarises_a_run(tmp_path):
    from pipelines.benchmarks.loadtest_cost import stage_cost, summary
    from pipelines.gate.schema import GateReport, GateResult, StatsSettings

    stages = {"quantize_s": 5.0, "baseline_serve_start_s": 25.0, "baseline_scoring_s": 60.0, "candidate_serve_start_s": 24.0,
              "candidate_scoring_s": 50.0, "gate_s": 1.0, "loadtest_baseline_serve_start_s": 26.0, "loadtest_s": 30.0}
    assert stage_cost(stages) == (160.0, 56.0)
    gate = GateResult(recipe="w8a8", verdict="promoted", sets=[], fit=None, reasons=[], warnings=[], settings=StatsSettings())
    lines = summary(GateReport(gate=gate, stages=stages, performance=report(tmp_path)))
    assert lines[1] == "quality gate 160.0 s, load test 56.0 s (0.35 x the quality gate)"
    assert "| 2 | 0.830 [95% CI 0.780, 0.880] | - |" in lines


@pytest.mark.parametrize("interval, words", [
    (RatioInterval(estimate=1.3, low=1.2, high=1.4, pairs=5), "measured faster: it agrees"),
    (RatioInterval(estimate=0.8, low=0.7, high=0.85, pairs=5), "measured slower: it disagrees"),
    (RatioInterval(estimate=1.0, low=0.5, high=2.0, pairs=5), "measured inconclusive: it cannot be checked against it"),
])
def test_the_shape_probes_prediction_is_set_beside_the_measurement(tmp_path, interval, words):
    from pipelines.hardware.prediction import WorkloadPrediction

    predicted = WorkloadPrediction(prompt_tokens=3200, output_tokens=512, concurrency=16, decode_batch=16, linear_time_ratio=0.7,
                                   throughput_ratio=1.43, direction="faster", prefill_share=0.6)
    performance = report(tmp_path, speed(interval)).model_copy(update={"predicted": predicted})
    line = render.predicted_line(performance)
    assert line.startswith("Shape probe predicted faster (1.43x") and line.endswith(words + ".")
    assert "quantize doctor --model" in render.predicted_line(performance.model_copy(update={"predicted": None}))
