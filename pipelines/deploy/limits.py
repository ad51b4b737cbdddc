"""The limits production is held to, each derived from a version's envelope (pipelines/deploy/envelope.py) in this one
place: `quantize watch` judges each window against them (pipelines/watch/verdict.py), and the deployed SLOs, alert rules
and dashboard carry the same (pipelines/deploy/slo.py, files.py), so `watch` and Prometheus judge alike.

A latency limit is the tighter of the policy's production SLO (performance.production, defaulting to the load test's own
SLO targets) and the load test's own figure at the deployed concurrency times `envelope_tolerance` (docs/watch.md has the
table). A latency limit below the first bound of vLLM's histogram is raised to it (`_at_resolution`).
"""

from __future__ import annotations

from pipelines.bounds import MiB
from pipelines.deploy.envelope import Envelope
from pipelines.schema import StrictModel
from pipelines.serve.serving import NAN_CHECK_ENV
from pipelines.serve.vllm_series import CORRUPTED_REQUESTS, FIRST_LATENCY_BUCKET_S

BURST_FACTOR = 10.0  # an ITL p95 this many times below the median TPOT is a client that read the stream in bursts


class FigureLimit(StrictModel):
    """One figure's limit, in the figure's unit, and where it came from."""

    figure: str
    limit: float
    source: str


def limits(envelope: Envelope) -> list[FigureLimit]:
    """The figures production is held to, each with its limit."""
    production, level = envelope.production, envelope.level
    latencies = [
        _latency("ttft_p95_s", "TTFT", level.ttft_ms.p95, envelope, production.ttft_p95_ms, "ttft_p95_ms", envelope.slo.ttft_ms,
                 "ttft_ms"),
        _latency("itl_p95_s", "TPOT (the load test's ITL was read in bursts)" if itl_bursty(envelope) else "ITL",
                 level.tpot_ms.p95 if itl_bursty(envelope) else level.itl_ms.p95, envelope, production.itl_p95_ms, "itl_p95_ms",
                 envelope.slo.tpot_ms, "tpot_ms"),
    ]
    found = [limit for limit in latencies if limit is not None] + [
        FigureLimit(figure="error_rate", limit=production.max_error_rate,
                    source=f"policy production.max_error_rate (the load test had {level.failed} failed of {level.requests})"),
        FigureLimit(figure="corrupted_requests", limit=0.0,
                    source=f"any request with NaN logits ({CORRUPTED_REQUESTS}, counted with {NAN_CHECK_ENV}=1)"),
        FigureLimit(figure="kv_cache_usage", limit=production.max_kv_cache_usage, source="policy production.max_kv_cache_usage"),
        FigureLimit(figure="preemptions", limit=float(production.max_preemptions), source="policy production.max_preemptions"),
        _waiting(envelope),
    ]
    if production.e2e_p95_ms is not None:
        found.append(_at_resolution("e2e_p95_s", production.e2e_p95_ms / 1000, FIRST_LATENCY_BUCKET_S["e2e"],
                                    f"policy production.e2e_p95_ms {production.e2e_p95_ms:g} ms"))
    peak = envelope.figures.peak_memory_bytes
    if peak:
        tolerance = production.envelope_tolerance
        found.append(FigureLimit(figure="memory_bytes", limit=float(int(peak * tolerance)),
                                 source=f"load test's memory watermark {peak / MiB:.0f} MiB x {tolerance:g} "
                                        "(the watched figure is the API server process's RSS only)"))
    return found


def itl_bursty(envelope: Envelope) -> bool:
    """The load test's ITL p95 is a tenth of its own median TPOT or less: 95% of the gaps between tokens hold almost none of
    a request's time: its client read the stream in bursts (a read of several tokens makes gaps of about 0; measured: ITL
    p95 2.6 us beside a TPOT of milliseconds, on 2 loaded cores), and its ITL figures measure the client. The ITL limit is
    then derived from the TPOT p95 (per request: the time between its first and last token over its tokens, which no read
    pattern changes)."""
    return envelope.level.itl_ms.p95 * BURST_FACTOR < envelope.level.tpot_ms.p50


def _latency(figure: str, name: str, measured_ms: float, envelope: Envelope, production_ms: float | None, production_field: str,
             slo_ms: float | None, slo_field: str) -> FigureLimit | None:
    """The tighter of the production SLO (default: the load test's own SLO target) and the envelope's p95 x tolerance;
    None where neither holds anything (no target set and a p95 of 0 measured: no limit, rather than an infinite one)."""
    tolerance = envelope.production.envelope_tolerance
    target_ms, target_field = (production_ms, f"production.{production_field}") if production_ms else (slo_ms, f"slo.{slo_field}")
    kind = figure.removesuffix("_p95_s")
    source = _latency_source(name, measured_ms, target_ms, tolerance, envelope.concurrency, target_field)
    limit_ms = _tighter(target_ms, measured_ms * tolerance)
    return None if limit_ms is None else _at_resolution(figure, limit_ms / 1000, FIRST_LATENCY_BUCKET_S[kind], source)


def _waiting(envelope: Envelope) -> FigureLimit:
    if envelope.production.max_waiting is not None:
        return FigureLimit(figure="waiting_p95", limit=float(envelope.production.max_waiting), source="policy production.max_waiting")
    batch = envelope.measured_max_num_seqs or envelope.concurrency
    return FigureLimit(figure="waiting_p95", limit=float(batch),
                       source=f"the measured max_num_seqs ({batch}): a queue longer than one full batch")


def _tighter(slo: float | None, envelope: float) -> float | None:
    # A load test on an idle machine can measure an ITL p95 of a few ms: the SLO, when set, is a floor for the envelope's
    # tolerance only where the envelope is the looser (min); an envelope of 0 ms (no gaps measured) leaves the SLO alone.
    if envelope <= 0:
        return slo
    return min(slo, envelope) if slo is not None else envelope


def _at_resolution(figure: str, limit_s: float, first: float, source: str) -> FigureLimit:
    """A p95 read from a histogram is interpolated inside the bucket that holds it; below the first bucket's bound that is a
    straight line from zero, which says nothing about a limit there: such a limit is raised to that bound (a 5 us ITL limit,
    from a load test whose client read the stream in bursts, against vLLM's first ITL bucket of 10 ms made every window a
    breach). A limit at or above the first bound stands, as written (Prometheus' histogram_quantile reads it alike); one
    above the last finite bound can never be breached, since both cap the estimate there."""
    if limit_s >= first - 1e-12:
        return FigureLimit(figure=figure, limit=limit_s, source=source)
    return FigureLimit(figure=figure, limit=first, source=f"{source}; {limit_s * 1000:.3g} ms raised to the histogram's first bucket bound "
                                                          f"{first * 1000:g} ms (vLLM's buckets: nothing below it can be told apart)")


def _latency_source(name: str, measured_ms: float, slo_ms: float | None, tolerance: float, concurrency: int, slo_field: str) -> str:
    envelope = f"load test {name} p95 {measured_ms:.1f} ms at concurrency {concurrency} x {tolerance:g} = {measured_ms * tolerance:.1f} ms"
    if slo_ms is None:
        return envelope
    tighter = "SLO" if slo_ms <= measured_ms * tolerance or measured_ms <= 0 else "envelope"
    return f"{envelope}; policy {slo_field} {slo_ms:g} ms; the {tighter} is tighter"
