"""The table's cells and the two conclusions: the smallest passing row, and the fastest only when the load test decided it."""

from __future__ import annotations

import pytest

from pipelines.bakeoff.records import BackendRecord, BakeoffRow, SetBound, SpeedRecord
from pipelines.bakeoff.rows import speed_record
from pipelines.bakeoff.table import cells, fastest_passing, smallest_passing
from pipelines.bounds import MiB
from pipelines.loadtest.results import PerformanceSummary


def row(index: int, status: str = "passed", *, weight: int | None = 2 * MiB, speed: SpeedRecord | None = None, **extra) -> BakeoffRow:
    return BakeoffRow(index=index, recipe=f"r{index}", recipe_name=f"r{index}", backend=BackendRecord(name="gptqmodel"), status=status,
                      weight_bytes=weight, speed=speed or SpeedRecord(), wall_s=1.0, **extra)


def faster(ratio: float, low: float, high: float) -> SpeedRecord:
    return SpeedRecord(throughput_ratio=ratio, interval=[low, high], outcome="faster", pairs=6)


def summary(ratio: float, interval: list[float] | None, outcome: str) -> PerformanceSummary:
    return PerformanceSummary(enforced=False, passed=True, target="cpu", deployment_concurrency=8, throughput_ratio=ratio,
                              throughput_interval=interval, speed=outcome, pairs=1 if interval is None else 6,  # type: ignore[arg-type]
                              ttft_p95_ratio=None, measured_max_num_seqs=None)


def test_none_is_named_fastest_when_no_passing_interval_decides() -> None:
    rows = [row(1, speed=SpeedRecord(throughput_ratio=1.08, interval=[0.97, 1.2], outcome="inconclusive", pairs=4)),
            row(2, speed=SpeedRecord(throughput_ratio=1.01, interval=[0.98, 1.03], outcome="no difference", pairs=6)),
            row(3, "rejected", speed=faster(1.9, 1.8, 2.0))]  # a rejected row never wins
    name, sentence = fastest_passing(rows)
    assert name is None
    assert sentence.startswith("fastest passing: none is proven faster than the 16-bit model (")
    assert "r1 on gptqmodel: inconclusive 1.080 [0.970, 1.200]" in sentence and "r2 on gptqmodel: no difference" in sentence
    assert "r3" not in sentence


def test_the_fastest_is_named_when_its_interval_is_above_16_bit_and_every_other_row() -> None:
    rows = [row(1, speed=faster(1.2, 1.1, 1.3)), row(2, speed=faster(1.6, 1.4, 1.8)), row(3)]
    assert fastest_passing(rows) == ("r2 on gptqmodel", "fastest passing: r2 on gptqmodel (throughput 1.600 [1.400, 1.800] x the 16-bit "
                                                        "model's, faster)")


def test_overlapping_faster_rows_are_not_told_apart() -> None:
    name, sentence = fastest_passing([row(1, speed=faster(1.2, 1.1, 1.45)), row(2, speed=faster(1.3, 1.15, 1.5))])
    assert name is None and sentence.startswith("fastest passing: not decided between r2 on gptqmodel, r1 on gptqmodel")


def test_an_inconclusive_row_whose_interval_reaches_the_best_leaves_the_fastest_undecided() -> None:
    wide = SpeedRecord(throughput_ratio=1.3, interval=[0.9, 1.9], outcome="inconclusive", pairs=4)
    name, sentence = fastest_passing([row(1, speed=faster(1.6, 1.4, 1.8)), row(2, speed=wide)])
    assert name is None and sentence.startswith("fastest passing: not decided between r1 on gptqmodel, r2 on gptqmodel")
    assert "proven faster than the 16-bit model: r1 on gptqmodel)" in sentence
    below = SpeedRecord(throughput_ratio=1.0, interval=[0.9, 1.1], outcome="inconclusive", pairs=4)
    assert fastest_passing([row(1, speed=faster(1.6, 1.4, 1.8)), row(2, speed=below)])[0] == "r1 on gptqmodel"


def test_nothing_passed_names_no_winner() -> None:
    rows = [row(1, "rejected"), row(2, "refused", weight=None)]
    assert smallest_passing(rows) == (None, "smallest passing: none (no row passed the quality gate)")
    assert fastest_passing(rows) == (None, "fastest passing: none (no row passed the quality gate)")


def test_the_smallest_passing_row_ignores_smaller_rejected_ones() -> None:
    rows = [row(1, weight=3 * MiB), row(2, "rejected", weight=MiB), row(3, weight=2 * MiB, bytes_ratio=0.27), row(4, weight=2 * MiB)]
    assert smallest_passing(rows) == ("r3 on gptqmodel", "smallest passing: r3 on gptqmodel (2.00 MiB of weights, 0.27x the 16-bit model's)")


@pytest.mark.parametrize(
    ("ratio", "interval", "said", "recorded"),
    [
        (1.3, None, "faster", "inconclusive"),  # one pair: no interval, nothing decided
        (1.3, [0.99, 1.6], "faster", "inconclusive"),  # an interval that reaches 1 cannot say faster
        (0.7, [0.6, 1.01], "slower", "inconclusive"),
        (1.3, [1.1, 1.6], "faster", "faster"),
        (1.0, [0.98, 1.02], "no difference", "no difference"),
    ],
)
def test_a_speed_the_interval_cannot_decide_is_inconclusive(ratio, interval, said, recorded) -> None:
    assert speed_record(summary(ratio, interval, said)).outcome == recorded
    assert speed_record(None).outcome == "not measured"


def test_cells_show_bounds_against_tolerances_cached_times_and_peak_bounds() -> None:
    bounds = [SetBound(eval_set="orders", unit="points", worst_bound=1.234, tolerance=2.0, passed=True),
              SetBound(eval_set="dates", unit="points", worst_bound=6.5, tolerance=5.0, passed=False)]
    shown = cells(row(1, "rejected", sets=bounds, quantize_s=70.64, quantize_reused=True, peak_memory_bytes=1500 * MiB,
                      peak_memory_upper_bound=True, bytes_ratio=0.26, reason="dates: worse by at most 6.5 > 5.0"))
    assert shown[4] == "2.00 (0.26x)" and shown[5] == "-" and shown[6] == "not measured"
    assert shown[7] == "orders +1.23 / 2 points; dates +6.50 / 5 points (failed)"
    assert shown[8:] == ["70.6 (cached)", "<= 1500", "dates: worse by at most 6.5 > 5.0"]
    one_pair = cells(row(2, speed=SpeedRecord(throughput_ratio=1.1, outcome="inconclusive", pairs=1)))
    assert one_pair[5] == "1.100 (one pair: no interval)" and one_pair[6] == "inconclusive, 1 pair"
