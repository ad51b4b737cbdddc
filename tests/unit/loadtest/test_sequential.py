"""The paired comparison: its statistics against known answers and by simulation, and its loop against a fake tool
whose true ratio and noise are known (order drawn per pair, run sizing, the stopping rule, the budget)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pipelines.loadtest import sequential
from pipelines.loadtest.bench import BenchResult, PlannedRun
from pipelines.loadtest.comparison import PairedComparison, pilot_requests, requests_per_run
from pipelines.loadtest.config import ComparisonSettings, PerformancePolicy
from pipelines.loadtest.results import RatioInterval

RESULT = Path(__file__).resolve().parents[2] / "data" / "loadtest" / "vllm-bench-serve-result.json"


# --------------------------------------------------------------------------------- the rule's error rate


@pytest.mark.parametrize("sd", [0.02, 0.08, 0.15, 0.2, 0.3])
def test_the_interval_at_the_stopping_time_misses_the_true_ratio_at_most_5_percent(sd):
    # 40,000 simulated comparisons: the miss rate's standard error is about 0.11 points
    assert sequential.sequential_miss_rate(sd, trials=40_000, seed=1) <= 0.053


def test_the_plain_95_percent_critical_value_would_break_that_promise():
    """Why the critical value is raised: stopping when the spread happens to be small undercovers."""
    assert sequential.sequential_miss_rate(0.15, confidence=0.95, trials=40_000, seed=2) > 0.07


def test_with_a_fixed_number_of_pairs_the_interval_is_the_textbook_one():
    # no stopping (margin never reached): 30 pairs, a t-interval at 98%, misses about 2%
    assert sequential.sequential_miss_rate(1.0, min_pairs=30, max_pairs=30, trials=40_000, seed=3) == pytest.approx(0.02, abs=0.003)


# --------------------------------------------------------------------------------- known answers


@pytest.mark.parametrize("low, high, throughput, ttft", [
    (0.83, 0.91, "slower", "faster"),
    (1.2, 1.5, "faster", "slower"),
    (0.95, 1.05, "no difference", "no difference"),
    (1 / 1.1, 1.1, "no difference", "no difference"),
    (1.02, 1.08, "no difference", "no difference"),  # above 1, but not by more than the margin
    (0.85, 1.2, "inconclusive", "inconclusive"),
    (0.95, 1.15, "inconclusive", "inconclusive"),
])
def test_outcomes(low, high, throughput, ttft):
    interval = RatioInterval(estimate=math.sqrt(low * high), low=low, high=high, pairs=5)
    assert sequential.outcome(interval, 0.1) == throughput
    assert sequential.outcome(interval, 0.1, higher_is_faster=False) == ttft
    assert sequential.outcome(RatioInterval(estimate=0.5, pairs=1), 0.1) == "inconclusive"
    assert sequential.outcome(None, 0.1) == "inconclusive"


def test_a_limit_is_passed_by_the_whole_interval_failed_by_none_of_it_and_otherwise_undecided():
    def interval(low, high):
        return RatioInterval(estimate=math.sqrt(low * high), low=low, high=high, pairs=4)

    assert sequential.against_limit(interval(0.92, 1.1), 0.9, at_least=True) == "passed"
    assert sequential.against_limit(interval(0.8, 0.88), 0.9, at_least=True) == "failed"
    assert sequential.against_limit(interval(0.85, 0.95), 0.9, at_least=True) == "inconclusive"
    assert sequential.against_limit(interval(1.0, 1.2), 1.25, at_least=False) == "passed"  # a TTFT ratio at most 1.25
    assert sequential.against_limit(interval(1.3, 1.5), 1.25, at_least=False) == "failed"
    assert sequential.against_limit(interval(1.1, 1.4), 1.25, at_least=False) == "inconclusive"


def test_precise_means_within_the_margin_of_the_estimate_in_logs():
    assert sequential.precise(RatioInterval(estimate=1.0, low=1 / 1.1, high=1.1, pairs=4), 0.1)
    assert not sequential.precise(RatioInterval(estimate=1.0, low=1 / 1.11, high=1.11, pairs=4), 0.1)
    assert not sequential.precise(RatioInterval(estimate=1.0, pairs=1), 0.1)


# --------------------------------------------------------------------------------- the loop against a fake tool


class FakeTool:
    """Serves runs at `rates` requests/s (baseline, candidate) with multiplicative noise; the clock advances by each run."""

    def __init__(self, ratio: float, noise: float, *, rate: float = 100.0, seed: int = 0, tokens_per_request: float = 16.0):
        self.rates = {"baseline": rate, "candidate": rate * ratio}
        self.noise, self.tokens = noise, tokens_per_request
        self.rng = np.random.default_rng(seed)
        self.now = 0.0
        self.batches: list[list[PlannedRun]] = []
        self.template = json.loads(RESULT.read_text())

    def clock(self) -> float:
        return self.now

    def __call__(self, runs: list[PlannedRun]) -> dict[PlannedRun, BenchResult]:
        self.batches.append(runs)
        results = {}
        for run in runs:
            rate = self.rates[run.role] * math.exp(self.rng.normal(0.0, self.noise))
            seconds = run.requests / rate
            self.now += seconds + 0.3  # the tool's own start per run
            data = {**self.template, "completed": run.requests, "failed": 0, "duration": seconds, "request_throughput": rate,
                    "output_throughput": rate * self.tokens, "p95_ttft_ms": 1000.0 / rate, "max_concurrency": run.concurrency}
            results[run] = BenchResult.model_validate(data)
        return results


def compare(tool: FakeTool, **settings) -> tuple[PairedComparison, object]:
    compared = PairedComparison(tool, ComparisonSettings(**settings), concurrency=8, clock=tool.clock, seed=11)
    return compared, compared.run()


def test_a_quiet_slower_candidate_is_called_slower_after_the_minimum_pairs():
    tool = FakeTool(ratio=0.87, noise=0.02)
    compared, result = compare(tool)
    assert result.stopped == "precise" and len(result.pairs) == 4 and result.throughput.outcome == "slower"
    interval = result.throughput.interval
    assert interval.low < 0.87 < interval.high < 1 and result.ttft_p95.outcome == "slower"
    assert [run.warmup for run in tool.batches[0]] == [True, True], "a warm-up per model first, discarded"
    assert all(len(batch) == 2 and {r.role for r in batch} == {"baseline", "candidate"} for batch in tool.batches[1:])
    assert len(compared.results) == 2 + 2 * 4


def test_the_order_within_a_pair_is_drawn_and_recorded():
    tool = FakeTool(ratio=1.0, noise=0.3, seed=4)
    _, result = compare(tool, budget_s=3600, max_pairs=20)
    firsts = [pair.first for pair in result.pairs]
    assert {"baseline", "candidate"} <= set(firsts)
    assert firsts == [batch[0].role for batch in tool.batches[1:]]
    again = PairedComparison(FakeTool(ratio=1.0, noise=0.3, seed=4), ComparisonSettings(budget_s=3600, max_pairs=20), concurrency=8,
                             clock=tool.clock, seed=result.order_seed)
    assert again.seed == result.order_seed


def test_runs_are_sized_by_the_faster_models_pace_so_each_lasts_min_run_s():
    settings = ComparisonSettings(min_run_s=3.0, min_run_requests=32)
    assert pilot_requests(settings, 8) == 64  # 8 x concurrency beats 32
    assert requests_per_run(settings, 8, [100.0, 50.0]) == 300
    assert requests_per_run(settings, 8, [5.0, 4.0]) == 64
    tool = FakeTool(ratio=0.5, noise=0.01, rate=100.0)
    _, result = compare(tool, min_run_s=3.0)
    assert result.requests_per_run == pytest.approx(300, abs=15)
    assert all(pair.baseline.duration_s >= 2.5 for pair in result.pairs)


def test_a_noisy_comparison_stops_at_the_budget_and_says_inconclusive():
    tool = FakeTool(ratio=0.97, noise=0.4)
    _, result = compare(tool, budget_s=40)
    assert result.stopped == "budget" and result.throughput.outcome == "inconclusive"
    assert result.seconds <= 40 + 1e-9 and 2 <= len(result.pairs) < 30


def test_max_pairs_ends_a_comparison_the_budget_would_let_run():
    _, result = compare(FakeTool(ratio=1.0, noise=0.5), budget_s=10_000, max_pairs=6)
    assert result.stopped == "max_pairs" and len(result.pairs) == 6


def test_an_equal_candidate_is_called_no_difference():
    _, result = compare(FakeTool(ratio=1.0, noise=0.02))
    assert result.throughput.outcome == "no difference"


@pytest.mark.slow
def test_the_whole_loop_calls_the_wrong_direction_rarely_by_simulation():
    """200 comparisons of a candidate truly 0.95x (noise sd 0.08 per run: about 0.11 per pair): it is called faster at most
    a few percent of the time, and the interval covers 0.95 at least about 95% of the time."""
    wrong = covered = 0
    for seed in range(200):
        tool = FakeTool(ratio=0.95, noise=0.08, seed=seed)
        result = PairedComparison(tool, ComparisonSettings(budget_s=3600), concurrency=8, clock=tool.clock, seed=seed).run()
        interval = result.throughput.interval
        wrong += result.throughput.outcome == "faster"
        covered += interval.low <= 0.95 <= interval.high
    assert wrong <= 6 and covered >= 182


# --------------------------------------------------------------------------------- the policy block


@pytest.mark.parametrize("block, message", [
    ({"budget_s": -5}, "greater than 0"),
    ({"budget_s": float("nan")}, "finite"),
    ({"budget_s": "soon"}, "must be a number"),
    ({"budget_s": 10}, "too small for a warm-up and 4 pairs"),
    ({"min_pairs": 8, "max_pairs": 5}, "max_pairs 5 is below min_pairs 8"),
    ({"margin": 0}, "greater than 0"),
])
def test_a_comparison_block_that_cannot_work_is_refused(block, message):
    with pytest.raises(ValueError, match=message):
        PerformancePolicy.model_validate({"comparison": block})
