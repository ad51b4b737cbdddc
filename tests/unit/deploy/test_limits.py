"""The envelope (the load test's figures at the deployed concurrency) and the limits derived from it, which `quantize watch`
and the deployed alert rules both hold production to."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipelines.deploy.envelope import Envelope
from pipelines.deploy.limits import _at_resolution, itl_bursty, limits
from pipelines.loadtest.config import ProductionSlo, SloTargets
from pipelines.loadtest.results import LevelFigures, ModelFigures, Percentiles
from pipelines.serve.vllm_series import FIRST_LATENCY_BUCKET_S


def _envelope(itl_ms: tuple[float, float, float], tpot_ms: tuple[float, float, float], concurrency: int = 4) -> Envelope:
    def percentiles(values: tuple[float, float, float]) -> Percentiles:
        return Percentiles(p50=values[0], p95=values[1], p99=values[2])

    level = LevelFigures(concurrency=4, runs=1, requests=100, completed=100, failed=0, request_throughput=1.0, output_throughput=10.0,
                         ttft_ms=percentiles((50, 80, 90)), itl_ms=percentiles(itl_ms), tpot_ms=percentiles(tpot_ms))
    figures = ModelFigures(role="candidate", model_dir="candidate", served_by="load test", levels=[level])
    return Envelope(measured_on="cpu:avx2", measured_max_num_seqs=4, figures=figures, concurrency=concurrency,
                    slo=SloTargets(tpot_ms=None), production=ProductionSlo())


def test_an_envelope_holds_a_level_the_load_test_swept():
    assert _envelope((1, 2, 3), (1, 2, 3)).level.concurrency == 4
    with pytest.raises(ValidationError, match="swept no level at concurrency 8"):
        _envelope((1, 2, 3), (1, 2, 3), concurrency=8)


@pytest.mark.parametrize(("itl_ms", "tpot_ms", "bursty", "basis_ms"), [
    ((0.0011, 0.0026, 0.004), (4.0, 6.0, 7.0), True, 6.0),  # measured: a client that read the stream in bursts (CI, 4 December)
    ((3.5, 9.0, 14.0), (4.0, 6.0, 7.0), False, 9.0),  # an honest stream: gaps around the mean TPOT
    ((0.3, 0.5, 400.0), (4.0, 6.0, 7.0), False, 0.5),  # a tenth of the median TPOT and more: not called bursty
])
def test_an_itl_limit_comes_from_tpot_when_the_load_test_read_its_stream_in_bursts(itl_ms, tpot_ms, bursty, basis_ms):
    envelope = _envelope(itl_ms, tpot_ms)
    assert itl_bursty(envelope) is bursty
    itl = next(limit for limit in limits(envelope) if limit.figure == "itl_p95_s")
    assert itl.limit == pytest.approx(max(basis_ms * envelope.production.envelope_tolerance / 1000, FIRST_LATENCY_BUCKET_S["itl"]))
    assert f"p95 {basis_ms:.1f} ms" in itl.source and ("read in bursts" in itl.source) is bursty


@pytest.mark.parametrize(("raw_s", "first", "held_s"), [
    (5.16e-6, 0.01, 0.01),  # a CI run: a 5 us ITL limit against vLLM's first ITL bucket made every light window a breach
    (0.0099, 0.01, 0.01),
    (0.01 - 1e-15, 0.01, 0.01 - 1e-15),  # on the first bound, but for the float's last digit: as written
    (0.2384761, 0.1, 0.2384761),  # inside a later bucket: as written (a policy SLO is never loosened)
    (3.0, 0.1, 3.0),
])
def test_a_latency_limit_below_the_histogram_s_first_bound_is_raised_to_it(raw_s, first, held_s):
    limit = _at_resolution("itl_p95_s", raw_s, first, "load test")
    assert limit.limit == held_s
    assert ("raised to the histogram's first bucket bound" in limit.source) == (held_s != raw_s)


def test_no_target_and_no_gap_measured_leave_the_itl_without_a_limit_not_an_infinite_one():
    # One-token answers: the load test measured no gap between tokens (p95 0 ms), and no SLO or production target is set.
    held = {limit.figure for limit in limits(_envelope((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)))}
    assert "itl_p95_s" not in held and {"ttft_p95_s", "error_rate", "kv_cache_usage"} <= held
