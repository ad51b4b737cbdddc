"""The load test on the demo model with real vLLM on the CPU and the real `vllm bench serve`.

Most checks read what the session's w8a8 run (tests/integration/conftest.py) left: no server is started for
them. That run is cold (it scores the baseline), so the load test ran on the two servers the quality gate had
started. One test runs `quantize loadtest` on its own, on the 16-bit model alone with a short sweep: one more
server start, about a minute on this 2-core machine.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from helpers import HOST
from scipy import stats

from pipelines.loadtest.bench import DONE_PREFIX, read_result
from pipelines.paths import DEMO_MODEL_DIR

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(w8a8_run) -> tuple[Path, dict]:
    assert w8a8_run.code == 0, w8a8_run.describe()
    run_dir = Path(w8a8_run.json["run_dir"])
    return run_dir, json.loads((run_dir / "gate.json").read_text())


def test_the_promoted_run_was_load_tested_report_only_on_the_cpu_target(run, w8a8_run):
    _, report = run
    performance = report["performance"]
    assert performance is not None and report["gate"]["verdict"] == "promoted"
    assert performance["target"] == str(HOST) and performance["target"].startswith("cpu:") and performance["enforced"] is False
    probed = performance["probed"]  # the kernel probe's ratios for the candidate on this host class, beside the measured ones
    assert probed["host_class"] == str(HOST) and probed["slowest"].startswith("w8i-") and probed["decode_ratio"] > 0
    assert "report-only" in performance["enforcement"] and "CPU target" in performance["enforcement"]
    assert performance["reasons"] == [], "report-only: a failed check is a warning, never a reason"
    failed = [c["text"] for c in performance["checks"] if not c["passed"]]
    assert all(any(text in w for w in report["gate"]["warnings"]) for text in failed)
    assert performance["tool"]["name"] == "vllm bench serve" and performance["tool"]["vllm"] == "0.32.0"
    assert w8a8_run.json["performance"]["deployment_concurrency"] == performance["deployment_concurrency"] == 16


def test_the_load_test_reused_the_quality_gates_servers(run):
    run_dir, report = run
    assert [m["served_by"] for m in report["performance"]["models"]] == ["quality gate", "quality gate"]
    assert not list(run_dir.glob("loadtest-*-server.log"))
    assert report["stages"]["loadtest_s"] > 0 and not [name for name in report["stages"] if name.endswith("_serve_start_s") and "loadtest" in name]


def test_every_figure_is_present_and_sane(run):
    _, report = run
    performance = report["performance"]
    assert performance["levels"] == [1, 2, 4, 8, 16]
    for model in performance["models"]:
        assert [level["concurrency"] for level in model["levels"]] == performance["levels"]
        for level in model["levels"]:
            where = f"{model['role']} at {level['concurrency']}"
            assert level["failed"] == 0 and level["completed"] == level["requests"] > 0, where
            assert level["request_throughput"] > 0 and level["output_throughput"] > 0, where
            for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
                values = level[metric]
                assert 0 <= values["p50"] <= values["p95"] <= values["p99"], (where, metric, values)
            assert 0 <= level["good_fraction"] <= 1 and level["goodput"] >= 0, where
        assert model["peak_memory_bytes"] > 100 * 2**20


def test_ratios_come_from_the_same_runs_the_tool_wrote(run):
    """The comparison's pairs and interval recomputed from the tool's own result files, independently of the product's code."""
    run_dir, report = run
    performance = report["performance"]
    speed = performance["comparison"]
    top, pairs = speed["concurrency"], len(speed["pairs"])
    assert top == performance["deployment_concurrency"] == 16 and pairs >= 2
    logs = []
    for index, pair in enumerate(speed["pairs"]):
        base = read_result(run_dir / "loadtest" / f"baseline-c{top}-r{index}.json")
        cand = read_result(run_dir / "loadtest" / f"candidate-c{top}-r{index}.json")
        assert base.completed == cand.completed == speed["requests_per_run"] and base.max_concurrency == cand.max_concurrency == top
        assert pair["throughput_ratio"] == pytest.approx(cand.output_throughput / base.output_throughput, rel=1e-9)
        logs.append(math.log(cand.output_throughput / base.output_throughput))
    mean, half = statistics.fmean(logs), stats.t.ppf(0.99, pairs - 1) * statistics.stdev(logs) / math.sqrt(pairs)
    interval = speed["throughput"]["interval"]
    assert interval["estimate"] == pytest.approx(math.exp(mean), rel=1e-9) and interval["pairs"] == pairs
    assert (interval["low"], interval["high"]) == (pytest.approx(math.exp(mean - half), rel=1e-9), pytest.approx(math.exp(mean + half), rel=1e-9))
    assert performance["ratios"][-1]["throughput"] == interval
    low, high = interval["low"], interval["high"]
    expected = ("no difference" if low >= 1 / 1.1 and high <= 1.1 else "slower" if high < 1 else "faster" if low > 1 else "inconclusive")
    assert speed["throughput"]["outcome"] == expected
    assert speed["stopped"] in ("precise", "budget", "max_pairs") and speed["seconds"] <= speed["settings"]["budget_s"] + 5
    assert {p["first"] for p in speed["pairs"]} <= {"baseline", "candidate"}
    for level in performance["levels"][:-1]:  # the sweep below the top: one run per model, a ratio without an interval
        ratio = next(r for r in performance["ratios"] if r["concurrency"] == level)
        assert ratio["throughput"]["pairs"] == 1 and ratio["throughput"]["low"] is None
    log = (run_dir / "loadtest" / "vllm-bench.log").read_text()
    assert sum(line.startswith(DONE_PREFIX) for line in log.splitlines()) == 2 + 2 * pairs + 2 * (len(performance["levels"]) - 1)


def test_the_verdict_says_what_the_candidate_buys_here(run, w8a8_run):
    run_dir, report = run
    performance = report["performance"]
    buys = performance["buys"]
    assert buys.startswith(("buys memory", "buys no memory")) and str(HOST) in buys and "weights" in buys
    outcome = performance["comparison"]["throughput"]["outcome"]
    assert {"slower": "not speed", "faster": "and speed", "no difference": "unchanged", "inconclusive": "inconclusive"}[outcome] in buys
    assert performance["memory"]["candidate_weight_bytes"] < performance["memory"]["baseline_weight_bytes"]
    assert f"**The candidate {buys}.**" in (run_dir / "report.md").read_text()
    assert w8a8_run.json["performance"]["buys"] == buys and w8a8_run.json["performance"]["speed"] == outcome
    if outcome == "inconclusive":
        assert all(check["status"] != "passed" for check in performance["checks"] if check["name"] == "throughput_ratio")


def test_vllm_measured_the_kv_capacity_the_planner_predicted(run):
    _, report = run
    # 1 GiB of KV at 2 KiB a token in bfloat16; 4 KiB a token where the host serves float32 (docs/hardware.md)
    expected = 524_288 if report["inputs"]["serve"]["dtype"] == "bfloat16" else 262_144
    for model in report["performance"]["models"]:
        assert model["kv_capacity_tokens"] == model["kv_capacity_tokens_predicted"] == expected, model["role"]


def test_measured_tuning_and_the_planners_recommendation_are_side_by_side(run):
    _, report = run
    tuning = report["performance"]["tuning"]
    assert tuning["swept_up_to"] == 16 and tuning["planner_max_num_seqs"] == 16
    if tuning["measured_max_num_seqs"] is not None:
        assert tuning["vllm_args"].startswith(f"--max-num-seqs {tuning['measured_max_num_seqs']} --max-model-len 512")


def test_the_report_shows_both_models_curves_and_the_ratios(run):
    run_dir, report = run
    text = (run_dir / "report.md").read_text()
    assert "## Performance (load test)" in text and "### Candidate / baseline" in text
    for name in report["performance"]["plots"].values():
        assert f"]({name})" in text and (run_dir / name).read_bytes()[:4] == b"\x89PNG"


def test_quantize_loadtest_measures_one_model_on_its_own(workspace, smallest_set, no_process_left):
    result = workspace.quantize("loadtest", "--model", str(DEMO_MODEL_DIR), "--eval-sets", smallest_set,
                                "--concurrency", "2", "--repeats", "1", "--json")
    assert result.code == 0, result.describe()
    document = result.json
    run_dir, performance = Path(document["run_dir"]), document["performance"]
    (model,) = performance["models"]
    assert model["role"] == "baseline" and model["served_by"] == "load test" and performance["ratios"] == []
    assert [level["concurrency"] for level in model["levels"]] == [1, 2]
    assert all(level["output_throughput"] > 0 and level["failed"] == 0 for level in model["levels"])
    assert model["kv_capacity_tokens"] == model["kv_capacity_tokens_predicted"]
    for name in ("loadtest.json", "loadtest.md", "loadtest-throughput.png", "loadtest-baseline-server.log"):
        assert (run_dir / name).is_file(), name
    no_process_left(result)
