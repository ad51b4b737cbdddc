"""The figures of one window, from its raw measurements (pipelines/watch/series.py WindowData).

Percentiles come from the histograms' bucket increases over the window, interpolated linearly inside the bucket that holds
the rank, exactly as Prometheus' histogram_quantile does (so `quantize watch` and the deployed alert rules agree); a rank in
the +Inf bucket is reported as the largest finite bound. Rates divide a counter's increase by the window's length. Gauges are
sampled during the window: their peak, mean and 95th percentile over the samples. A figure without data (no request
finished in the window) is None, never 0.

The error rate is the larger of two rates: the engine's (requests that finished with finished_reason `error` or `abort`,
over every finished request) and the HTTP layer's (5xx answers of the /v1/ API over its answers that were not a client's
4xx). One failure is often counted by both; the larger rate is what the alert rule tests too.
"""

from __future__ import annotations

import math
import statistics

from pipelines.schema import StrictModel
from pipelines.watch.series import Histogram, WindowData

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "itl", "e2e")


class Figures(StrictModel):
    """One window's figures; seconds, fractions (0..1), tokens, requests and bytes. None: no data in the window."""

    requests: float
    requests_per_s: float
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    itl_p99_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p95_s: float | None = None
    e2e_p99_s: float | None = None
    tpot_p95_s: float | None = None
    queue_time_p95_s: float | None = None
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    errors: float
    aborts: float
    http_5xx: float
    error_rate: float | None = None
    admission_rejections: float = 0.0
    corrupted_requests: float = 0.0
    kv_cache_usage: float | None = None
    kv_cache_usage_mean: float | None = None
    prefix_cache_hit_rate: float | None = None
    preemptions: float
    running_mean: float | None = None
    running_max: float | None = None
    waiting_mean: float | None = None
    waiting_p95: float | None = None
    waiting_max: float | None = None
    batch_tokens_p50: float | None = None
    batch_tokens_p95: float | None = None
    memory_bytes: float | None = None


def histogram_quantile(q: float, histogram: Histogram | None) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts; None when the histogram counted nothing."""
    if histogram is None or not histogram.buckets:
        return None
    bounds = histogram.upper_bounds()
    counts = [count for _, count in histogram.buckets]
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, count in enumerate(counts) if count >= rank)
    if bounds[index] == math.inf:
        return bounds[-2] if len(bounds) > 1 else None
    lower, below = (bounds[index - 1], counts[index - 1]) if index > 0 else (0.0, 0.0)
    if bounds[index] <= 0 and index == 0:
        return bounds[0]
    inside = counts[index] - below
    return lower + (bounds[index] - lower) * ((rank - below) / inside if inside > 0 else 1.0)


def window_figures(window: WindowData) -> Figures:
    counters, histograms = window.counters, window.histograms
    finished = sum(value for key, value in counters.items() if key.startswith("finished:"))
    answered = sum(value for key, value in counters.items() if key.startswith("http:") and key != "http:4xx")
    errors, aborts = counters.get("finished:error", 0.0), counters.get("finished:abort", 0.0)
    http_5xx, rejected = counters.get("http:5xx", 0.0), counters.get("admission_rejections", 0.0)
    # an admission refused by a queue limit is answered 503 and is overload, not failure (as in the deployed error SLO)
    failed, admitted = max(0.0, http_5xx - rejected), answered - rejected
    rates = [bad / total for bad, total in ((errors + aborts, finished), (failed, admitted)) if total > 0]
    figures: dict[str, float | None] = {}
    for key in LATENCIES:
        for p in PERCENTILES:
            figures[f"{key}_p{p}_s"] = histogram_quantile(p / 100, histograms.get(key))
    queries = counters.get("prefix_cache_queries", 0.0)
    return Figures(
        requests=finished, requests_per_s=finished / window.duration_s,
        tpot_p95_s=histogram_quantile(0.95, histograms.get("tpot")), queue_time_p95_s=histogram_quantile(0.95, histograms.get("queue")),
        generation_tokens_per_s=counters.get("generation_tokens", 0.0) / window.duration_s,
        prompt_tokens_per_s=counters.get("prompt_tokens", 0.0) / window.duration_s,
        errors=errors, aborts=aborts, http_5xx=http_5xx, error_rate=max(rates) if rates else None, admission_rejections=rejected,
        corrupted_requests=counters.get("corrupted_requests", 0.0),
        kv_cache_usage=_peak(window, "kv_cache_usage"), kv_cache_usage_mean=_mean(window, "kv_cache_usage"),
        prefix_cache_hit_rate=counters.get("prefix_cache_hits", 0.0) / queries if queries > 0 else None,
        preemptions=counters.get("preemptions", 0.0),
        running_mean=_mean(window, "running"), running_max=_peak(window, "running"),
        waiting_mean=_mean(window, "waiting"), waiting_p95=_percentile(window, "waiting", 95), waiting_max=_peak(window, "waiting"),
        batch_tokens_p50=histogram_quantile(0.5, histograms.get("batch_tokens")),
        batch_tokens_p95=histogram_quantile(0.95, histograms.get("batch_tokens")),
        memory_bytes=_peak(window, "memory"), **figures,
    )


def _values(window: WindowData, key: str) -> list[float]:
    return [value for _, value in window.gauges.get(key, [])]


def _peak(window: WindowData, key: str) -> float | None:
    values = _values(window, key)
    return max(values) if values else None


def _mean(window: WindowData, key: str) -> float | None:
    values = _values(window, key)
    return statistics.fmean(values) if values else None


def _percentile(window: WindowData, key: str, p: int) -> float | None:
    values = sorted(_values(window, key))
    if not values:
        return None
    position = (len(values) - 1) * p / 100  # linear, as numpy's default
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)
