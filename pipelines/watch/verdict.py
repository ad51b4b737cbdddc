"""Each window's figures beside the envelope the version was promoted on, with a verdict per figure.

A limit is the tighter of the policy's production SLO (performance.production, defaulting to the load test's own SLO
targets) and the load test's own figure at the deployed concurrency times `envelope_tolerance` (docs/watch.md has the table).
A latency limit below the first bound of vLLM's histogram is raised to it (`_at_resolution`). A figure without data in the
window (no request finished) gets no verdict; it is never a breach. The same limits are
written into the deployed alert rules (pipelines/deploy/files.py), so `watch` and Prometheus judge alike.
"""

from __future__ import annotations

from typing import Literal

from pipelines.deploy.spec import Envelope
from pipelines.schema import StrictModel
from pipelines.watch.figures import Figures
from pipelines.watch.series import FIRST_LATENCY_BUCKET_S

Verdict = Literal["within", "breach", "no data"]


class FigureLimit(StrictModel):
    """One figure's limit, in the figure's unit, and where it came from."""

    figure: str
    limit: float
    source: str


class FigureVerdict(FigureLimit):
    value: float | None
    verdict: Verdict


def limits(envelope: Envelope) -> list[FigureLimit]:
    """The figures `watch` holds a version to, each with its limit (the alert rules use the same)."""
    production = envelope.production
    tolerance = production.envelope_tolerance
    found = [
        _at_resolution("ttft_p95_s", envelope.ttft_p95_limit_ms / 1000, FIRST_LATENCY_BUCKET_S["ttft"],
                       _latency_source("TTFT", envelope.ttft_ms.p95, production.ttft_p95_ms or envelope.slo.ttft_ms, tolerance,
                                       envelope.concurrency, "production.ttft_p95_ms" if production.ttft_p95_ms else "slo.ttft_ms")),
        _at_resolution("itl_p95_s", envelope.itl_p95_limit_ms / 1000, FIRST_LATENCY_BUCKET_S["itl"],
                       _latency_source("TPOT (the load test's ITL was read in bursts)" if envelope.itl_bursty else "ITL",
                                       envelope.itl_basis_ms, production.itl_p95_ms or envelope.slo.tpot_ms, tolerance,
                                       envelope.concurrency, "production.itl_p95_ms" if production.itl_p95_ms else "slo.tpot_ms")),
        FigureLimit(figure="error_rate", limit=production.max_error_rate,
                    source=f"policy production.max_error_rate (the load test had {envelope.failed} failed of {envelope.requests})"),
        FigureLimit(figure="corrupted_requests", limit=0.0,
                    source="any request with NaN logits (vllm:corrupted_requests, counted with VLLM_COMPUTE_NANS_IN_LOGITS=1)"),
        FigureLimit(figure="kv_cache_usage", limit=production.max_kv_cache_usage, source="policy production.max_kv_cache_usage"),
        FigureLimit(figure="preemptions", limit=float(production.max_preemptions), source="policy production.max_preemptions"),
        FigureLimit(figure="waiting_p95", limit=float(envelope.max_waiting),
                    source="policy production.max_waiting" if production.max_waiting is not None
                    else f"the measured max_num_seqs ({envelope.max_waiting}): a queue longer than one full batch"),
    ]
    if production.e2e_p95_ms is not None:
        found.append(_at_resolution("e2e_p95_s", production.e2e_p95_ms / 1000, FIRST_LATENCY_BUCKET_S["e2e"],
                                    f"policy production.e2e_p95_ms {production.e2e_p95_ms:g} ms"))
    if envelope.memory_limit_bytes is not None and envelope.peak_memory_bytes is not None:
        found.append(FigureLimit(figure="memory_bytes", limit=float(envelope.memory_limit_bytes),
                                 source=f"load test's memory watermark {envelope.peak_memory_bytes / 2**20:.0f} MiB x {tolerance:g} "
                                        "(the watched figure is the API server process's RSS only)"))
    return found


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


def judge(figures: Figures, envelope_limits: list[FigureLimit]) -> list[FigureVerdict]:
    verdicts = []
    for limit in envelope_limits:
        value = getattr(figures, limit.figure)
        verdict: Verdict = "no data" if value is None else ("breach" if value > limit.limit + 1e-12 else "within")
        verdicts.append(FigureVerdict(**limit.model_dump(), value=value, verdict=verdict))
    return verdicts


def breached(verdicts: list[FigureVerdict]) -> list[str]:
    return [verdict.figure for verdict in verdicts if verdict.verdict == "breach"]
