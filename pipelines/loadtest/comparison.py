"""The paired, interleaved comparison at the deployment's concurrency: a load test that concludes.

    comparison, results = PairedComparison(runner, settings, concurrency=16, deadline=...).run()

Both servers are up side by side. First a warm-up run per model (discarded: it fills the prefix cache with the
comparison's prompts and takes oneDNN's and the allocator's first-call costs), which also measures each model's pace.
Every measured run then sends the same `requests_per_run` prompts (the workload's first ones, cycled), enough for the
faster model to run `min_run_s` seconds and at least `min_run_requests` and 8 x concurrency requests, so that the
ramp-up and drain of a run are a small part of it. Runs come in pairs, one per model, in an order drawn per pair; after
each pair the throughput ratio's interval is recomputed (pipelines/loadtest/sequential.py), and the comparison stops
when it is within `margin` of its estimate (from `min_pairs` on), when the next pair would overrun `budget_s`, or at
`max_pairs`. Its result says faster, slower, no difference or inconclusive, with the interval, the pairs and the
seconds spent.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from collections.abc import Callable

from pipelines.console.output import progress
from pipelines.console.progress import duration, track
from pipelines.loadtest import sequential
from pipelines.loadtest.bench import BenchResult, PlannedRun
from pipelines.loadtest.config import ComparisonSettings
from pipelines.loadtest.results import ComparisonPair, Role, RunFigures, SpeedComparison, SpeedConclusion, Stop

MAX_RUN_REQUESTS = 20_000
RAMP_FACTOR = 8  # requests per run at least this many times the concurrency
ROLES: tuple[Role, Role] = ("baseline", "candidate")

# Runs a batch of planned runs against the servers and returns their results (stage.py binds the tool's process).
BatchRunner = Callable[[list[PlannedRun]], dict[PlannedRun, BenchResult]]


def requests_per_run(settings: ComparisonSettings, concurrency: int, rates: list[float]) -> int:
    """Enough requests for the faster model's run to last min_run_s, and at least min_run_requests and 8 x concurrency."""
    floor = max(settings.min_run_requests, RAMP_FACTOR * concurrency)
    fastest = max(rates) if rates else 0.0
    return min(MAX_RUN_REQUESTS, max(floor, math.ceil(settings.min_run_s * fastest)))


def pilot_requests(settings: ComparisonSettings, concurrency: int) -> int:
    """The warm-up's size, which is also the number of distinct prompts the comparison cycles through."""
    return requests_per_run(settings, concurrency, [])


def _conclusion(metric: str, candidate: list[float], baseline: list[float], margin: float, higher_is_faster: bool) -> SpeedConclusion:
    interval = sequential.ratio_interval(candidate, baseline)  # None where a run has no such figure (zero)
    return SpeedConclusion(metric=metric, interval=interval, outcome=sequential.outcome(interval, margin, higher_is_faster=higher_is_faster))


def conclusions(pairs: list[ComparisonPair], margin: float) -> tuple[SpeedConclusion, SpeedConclusion, SpeedConclusion]:
    """Throughput (what the comparison stops on), p95 TTFT and median TPOT, each candidate / baseline over the pairs."""
    return (
        _conclusion("output tokens/s, candidate / baseline", [p.candidate.output_throughput for p in pairs],
                    [p.baseline.output_throughput for p in pairs], margin, True),
        _conclusion("p95 time to first token, candidate / baseline", [p.candidate.p95_ttft_ms for p in pairs],
                    [p.baseline.p95_ttft_ms for p in pairs], margin, False),
        _conclusion("median time per output token, candidate / baseline", [p.candidate.p50_tpot_ms for p in pairs],
                    [p.baseline.p50_tpot_ms for p in pairs], margin, False),
    )


def _figures(result: BenchResult) -> RunFigures:
    return RunFigures(output_throughput=result.output_throughput, p95_ttft_ms=result.p95_ttft_ms, p50_tpot_ms=result.p50_tpot_ms,
                      duration_s=result.duration)


def _pair(index: int, first: Role, base: BenchResult, cand: BenchResult) -> ComparisonPair:
    ttft = cand.p95_ttft_ms / base.p95_ttft_ms if base.p95_ttft_ms > 0 and cand.p95_ttft_ms > 0 else None
    throughput = cand.output_throughput / base.output_throughput if base.output_throughput > 0 else 0.0
    return ComparisonPair(index=index, first=first, baseline=_figures(base), candidate=_figures(cand),
                          throughput_ratio=throughput, ttft_p95_ratio=ttft)


class PairedComparison:
    """One comparison; `run_batch` runs planned runs in order (the tool's process) and returns their results."""

    def __init__(self, run_batch: BatchRunner, settings: ComparisonSettings, *, concurrency: int,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None):
        self._run_batch, self.settings, self.concurrency, self._clock = run_batch, settings, concurrency, clock
        self.seed = secrets.randbits(32) if seed is None else seed
        self._order = random.Random(self.seed)
        self.results: dict[PlannedRun, BenchResult] = {}

    def run(self) -> SpeedComparison:
        started = self._clock()
        settings, level = self.settings, self.concurrency
        pilot = pilot_requests(settings, level)
        pairs: list[ComparisonPair] = []
        stopped: Stop = "max_pairs"
        # The bar counts the budget's seconds, warm-ups included (its time left is the budget's); each pair's line gives the
        # count and the ratio so far.
        with track("load test: paired comparison", total=round(settings.budget_s), unit="second") as bar:
            warmups = self._batch([PlannedRun(role=role, concurrency=level, repeat=0, requests=pilot, warmup=True) for role in ROLES])
            rates = {run.role: result.completed / result.duration for run, result in warmups.items()}
            size = requests_per_run(settings, level, list(rates.values()))
            while len(pairs) < settings.max_pairs:
                bar.update(completed=min(round(settings.budget_s), round(self._clock() - started)))
                if self._over_budget(started, pairs, size, rates):
                    stopped = "budget"
                    break
                pairs.append(self._one_pair(len(pairs), size))
                throughput = conclusions(pairs, settings.margin)[0]
                self._say(pairs, throughput, started)
                if len(pairs) >= settings.min_pairs and sequential.precise(throughput.interval, settings.margin):
                    stopped = "precise"
                    break
        throughput, ttft, tpot = conclusions(pairs, settings.margin)
        return SpeedComparison(
            concurrency=level, requests_per_run=size, warmup_rates={role: round(rate, 4) for role, rate in rates.items()},
            pairs=pairs, throughput=throughput, ttft_p95=ttft, tpot_p50=tpot, stopped=stopped, seconds=round(self._clock() - started, 2),
            settings=settings, order_seed=self.seed, method=sequential.METHOD,
        )

    def _batch(self, runs: list[PlannedRun]) -> dict[PlannedRun, BenchResult]:
        results = self._run_batch(runs)
        self.results.update(results)
        return results

    def _one_pair(self, index: int, size: int) -> ComparisonPair:
        order = list(ROLES)
        self._order.shuffle(order)
        results = self._batch([PlannedRun(role=role, concurrency=self.concurrency, repeat=index, requests=size) for role in order])
        by_role = {run.role: result for run, result in results.items()}
        return _pair(index, order[0], by_role["baseline"], by_role["candidate"])

    def _over_budget(self, started: float, pairs: list[ComparisonPair], size: int, rates: dict[Role, float]) -> bool:
        """Would the next pair end past the budget? Its length: the last pair's, else the warm-ups' pace at this size."""
        if pairs:
            last = pairs[-1]
            expected = last.baseline.duration_s + last.candidate.duration_s
        else:
            expected = sum(size / rate for rate in rates.values() if rate > 0)
        return self._clock() - started + expected > self.settings.budget_s

    def _say(self, pairs: list[ComparisonPair], throughput: SpeedConclusion, started: float) -> None:
        interval = throughput.interval
        shown = "-" if interval is None else f"{interval.estimate:.3f}" + (
            f" [{interval.low:.3f}, {interval.high:.3f}]" if interval.low is not None and interval.high is not None else "")
        left = max(0.0, self.settings.budget_s - (self._clock() - started))
        progress(f"load test: pair {len(pairs)}: throughput ratio {shown} ({throughput.outcome} so far; {duration(left)} of the budget left)")
