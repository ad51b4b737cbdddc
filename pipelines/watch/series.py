"""What `quantize watch` reads of vLLM's metrics, and one window of it: counter increases, histogram bucket increases and
gauge samples. Both sources (a server's /metrics, scraped live: pipelines/watch/exposition.py; Prometheus' HTTP API over a
range: pipelines/watch/prometheus.py) produce the same `WindowData`, so every figure is computed by one piece of code
(pipelines/watch/figures.py).

vLLM 0.32's series (measured on its CPU build; a server started with --disable-log-stats exports none of the vllm:* ones):
the histograms vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds,
vllm:request_time_per_output_token_seconds, vllm:request_queue_time_seconds, vllm:iteration_tokens_total (tokens per engine
step: the batch size in tokens); the counters vllm:generation_tokens_total, vllm:prompt_tokens_total,
vllm:num_preemptions_total, vllm:prefix_cache_queries_total / _hits_total, vllm:request_success_total by finished_reason
(stop, length, abort, error, repetition) and the HTTP layer's http_requests_total by status class (2xx, 4xx, 5xx); the gauges
vllm:kv_cache_usage_perc (a fraction, 0..1), vllm:num_requests_running / _waiting, process_resident_memory_bytes (the API
server process only: the engine core is a process of its own), and vllm:cache_config_info, whose labels say the KV cache's
size in tokens and blocks.
"""

from __future__ import annotations

import math

from pydantic import Field

from pipelines.schema import StrictModel

# figure key -> sample name of a counter summed over every series
COUNTERS = {
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    # admissions refused by a queue limit (answered 503: overload, left out of the error rate) and requests with NaN logits
    # (exported only by a server started with VLLM_COMPUTE_NANS_IN_LOGITS=1)
    "admission_rejections": "vllm:admission_rejections_total",
    "corrupted_requests": "vllm:corrupted_requests_total",
}
# key prefix -> (sample name, the label a counter is split by): `finished:stop`, `http:5xx`
GROUPED_COUNTERS = {
    "finished": ("vllm:request_success_total", "finished_reason"),
    "http": ("http_requests_total", "status"),
}
# figure key -> histogram base name (samples NAME_bucket{le}, NAME_sum, NAME_count)
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "batch_tokens": "vllm:iteration_tokens_total",
}
# The bucket bounds (seconds) of the latency histograms a limit is held against: vLLM's defaults (vllm/v1/metrics/buckets.py
# of the pinned vLLM; a server started with --custom-histogram-buckets has others). Below the first bound a p95 cannot be told
# apart from zero: pipelines/watch/verdict.py raises a limit there to that bound. The burn-rate alert rules count the requests
# over the first bound at or above each limit (pipelines/deploy/slo.py).
LATENCY_BUCKETS_S = {
    "ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
             640.0, 2560.0),
    "itl": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "e2e": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
            7680.0),
}
FIRST_LATENCY_BUCKET_S = {key: bounds[0] for key, bounds in LATENCY_BUCKETS_S.items()}
# figure key -> gauge sample name, summed over series at each sample time
GAUGES = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "memory": "process_resident_memory_bytes",
}
CACHE_INFO = "vllm:cache_config_info"
# http_requests_total counts every handler, /metrics and /health included (a watcher's own reads): only the API's are requests.
API_HANDLER_PREFIX = "/v1/"
VLLM_PREFIX = "vllm:"


def counter_key(prefix: str, label_value: str) -> str:
    return f"{prefix}:{label_value}"


class Histogram(StrictModel):
    """Cumulative bucket counts by upper bound (the last is +Inf, kept as None: JSON has no infinity), sum and count."""

    buckets: list[tuple[float | None, float]]
    sum: float
    count: float

    def upper_bounds(self) -> list[float]:
        return [math.inf if bound is None else bound for bound, _ in self.buckets]


class KvCacheInfo(StrictModel):
    """vllm:cache_config_info's labels: the KV cache vLLM allocated."""

    block_size: int | None = None
    num_blocks: int | None = None
    size_tokens: int | None = None
    max_concurrency: float | None = Field(default=None, description="KV tokens / max_model_len, as vLLM logs it")
    memory_bytes: int | None = None

    @property
    def max_model_len(self) -> int | None:
        if self.size_tokens and self.max_concurrency:
            return round(self.size_tokens / self.max_concurrency)
        return None


class WindowData(StrictModel):
    """One window's raw measurements, whichever source they came from."""

    index: int = Field(ge=1)
    start: float = Field(description="epoch seconds")
    end: float
    counters: dict[str, float] = Field(default_factory=dict, description="increase over the window")
    histograms: dict[str, Histogram] = Field(default_factory=dict, description="bucket increases over the window")
    gauges: dict[str, list[tuple[float, float]]] = Field(default_factory=dict, description="(epoch s, value) samples in the window")
    kv: KvCacheInfo | None = None

    @property
    def duration_s(self) -> float:
        return max(self.end - self.start, 1e-9)


def merged(windows: list[WindowData]) -> WindowData:
    """All windows as one (their counters and buckets added, their samples together): the whole session's figures."""
    counters: dict[str, float] = {}
    histograms: dict[str, Histogram] = {}
    gauges: dict[str, list[tuple[float, float]]] = {}
    for window in windows:
        for key, value in window.counters.items():
            counters[key] = counters.get(key, 0.0) + value
        for key, histogram in window.histograms.items():
            histograms[key] = _added(histograms.get(key), histogram)
        for key, samples in window.gauges.items():
            gauges.setdefault(key, []).extend(samples)
    kv = next((window.kv for window in reversed(windows) if window.kv is not None), None)
    return WindowData(index=1, start=windows[0].start, end=windows[-1].end, counters=counters, histograms=histograms, gauges=gauges,
                      kv=kv)


def _added(total: Histogram | None, more: Histogram) -> Histogram:
    if total is None:
        return more
    if [b for b, _ in total.buckets] != [b for b, _ in more.buckets]:
        return total  # bucket bounds changed (a restarted server of another version): keep the first layout
    buckets = [(bound, count + other) for (bound, count), (_, other) in zip(total.buckets, more.buckets, strict=True)]
    return Histogram(buckets=buckets, sum=total.sum + more.sum, count=total.count + more.count)
