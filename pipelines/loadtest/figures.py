"""From the tool's result files to figures per model and level, and candidate/baseline ratios with an interval.

Per model and level, each figure is the median over the repeated runs of what the tool reported for a run
(its own percentiles of TTFT, TPOT and ITL over the run's requests); the good fraction pools the runs' good
and completed requests.

Ratios come from the same runs: run r of the candidate is paired with run r of the baseline at the same level (run
back to back; at the deployment's concurrency these are the paired comparison's pairs, pipelines/loadtest/comparison.py).
The estimate and interval are pipelines/loadtest/sequential.py's; one pair has no interval.
"""

from __future__ import annotations

import statistics

from pipelines.loadtest.bench import BenchResult, PlannedRun
from pipelines.loadtest.results import LevelFigures, LevelRatio, Percentiles
from pipelines.loadtest.sequential import ratio_interval

Results = dict[PlannedRun, BenchResult]


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _percentiles(results: list[BenchResult], metric: str) -> Percentiles:
    return Percentiles(**{f"p{p}": _median([getattr(r, f"p{p}_{metric}_ms") for r in results]) for p in (50, 95, 99)})


def level_figures(concurrency: int, results: list[BenchResult], with_slo: bool) -> LevelFigures:
    """One model at one level, from its repeated runs."""
    completed = sum(r.completed for r in results)
    good = [r.good_requests for r in results]
    fraction = None
    if with_slo and completed and None not in good:
        fraction = min(1.0, sum(good) / completed)  # type: ignore[arg-type]
    return LevelFigures(
        concurrency=concurrency, runs=len(results), requests=sum(r.completed + r.failed for r in results),
        completed=completed, failed=sum(r.failed for r in results),
        request_throughput=_median([r.request_throughput for r in results]),
        output_throughput=_median([r.output_throughput for r in results]),
        ttft_ms=_percentiles(results, "ttft"), tpot_ms=_percentiles(results, "tpot"), itl_ms=_percentiles(results, "itl"),
        goodput=_median([r.request_goodput for r in results]) if with_slo and None not in good else None,  # type: ignore[misc]
        good_fraction=fraction,
    )


def by_level(results: Results, role: str) -> dict[int, list[tuple[int, BenchResult]]]:
    """{level: [(repeat, result), ...]} of one model's measured runs (warm-ups left out), in repeat order."""
    levels: dict[int, list[tuple[int, BenchResult]]] = {}
    for run, result in results.items():
        if run.role == role and not run.warmup:
            levels.setdefault(run.concurrency, []).append((run.repeat, result))
    return {level: sorted(runs, key=lambda item: item[0]) for level, runs in sorted(levels.items())}


def model_levels(results: Results, role: str, with_slo: bool) -> list[LevelFigures]:
    return [level_figures(level, [r for _, r in runs], with_slo) for level, runs in by_level(results, role).items()]


def level_ratios(results: Results) -> list[LevelRatio]:
    """candidate / baseline per level, pairing repeat r with repeat r."""
    baseline, candidate = by_level(results, "baseline"), by_level(results, "candidate")
    ratios = []
    for level in sorted(set(baseline) & set(candidate)):
        base, cand = dict(baseline[level]), dict(candidate[level])
        repeats = sorted(set(base) & set(cand))
        ratios.append(LevelRatio(
            concurrency=level,
            throughput=ratio_interval([cand[r].output_throughput for r in repeats], [base[r].output_throughput for r in repeats]),
            ttft_p95=ratio_interval([cand[r].p95_ttft_ms for r in repeats], [base[r].p95_ttft_ms for r in repeats]),
        ))
    return ratios
