"""Figures no server can produce. A window whose measurements hold one (a KV cache more than full, a negative gauge, a
resident memory of an exabyte, a latency of years, 1e12 preemptions in a minute) is INVALID: it is reported with the
reasons, never judged (no breach, no rollback). A broken exporter, a proxy that rewrites pages or a forged Prometheus must
not be able to move an alias.

The bounds are far beyond any real deployment (each names why), so a real server's window is never refused by them.
"""

from __future__ import annotations

from pipelines.bounds import MAX_CONCURRENCY
from pipelines.watch.figures import LATENCIES, PERCENTILES, Figures
from pipelines.watch.series import WindowData

MAX_KV_USAGE = 1.0 + 1e-6  # vllm:kv_cache_usage_perc is a fraction of the blocks
MAX_MEMORY_BYTES = 2.0**50  # 1 PiB of resident memory in one process
MAX_QUEUE = float(MAX_CONCURRENCY)  # requests running or waiting at once
MAX_LATENCY_S = 1e6  # 11.6 days for one request (or one token, or a queue wait)
MAX_COUNT_PER_S = 1e8  # tokens, requests or preemptions per second: a hundred times the largest serving clusters


def implausible(window: WindowData, figures: Figures) -> list[str]:
    """Why no server could have produced `window` (each reason one short phrase); empty when it could."""
    reasons: list[str] = []
    for key, samples in window.gauges.items():
        if any(value < 0 for _, value in samples):
            reasons.append(f"gauge {key} is negative")
    ceilings = {"kv_cache_usage": MAX_KV_USAGE, "memory_bytes": MAX_MEMORY_BYTES, "running_max": MAX_QUEUE, "waiting_max": MAX_QUEUE}
    for key, ceiling in ceilings.items():
        value = getattr(figures, key)
        if value is not None and value > ceiling:
            reasons.append(f"{key} {value:.3g} is above {ceiling:.3g}")
    for key in (*(f"{name}_p{p}_s" for name in LATENCIES for p in PERCENTILES), "tpot_p95_s", "queue_time_p95_s"):
        value = getattr(figures, key)
        if value is not None and value > MAX_LATENCY_S:
            reasons.append(f"{key} {value:.3g} s is above {MAX_LATENCY_S:.3g} s")
    most = MAX_COUNT_PER_S * window.duration_s
    for key, value in window.counters.items():
        if value > most:
            reasons.append(f"counter {key} rose by {value:.3g} in {window.duration_s:.3g} s (more than {MAX_COUNT_PER_S:.3g} per s)")
    for key, histogram in window.histograms.items():
        if histogram.count > most:
            reasons.append(f"histogram {key} counted {histogram.count:.3g} in {window.duration_s:.3g} s (more than {MAX_COUNT_PER_S:.3g} per s)")
    return reasons
