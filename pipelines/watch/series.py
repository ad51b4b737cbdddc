"""What `quantize watch` reads of vLLM's metrics, and one window of it: counter increases, histogram bucket increases and
gauge samples. Both sources (a server's /metrics, scraped live: pipelines/watch/exposition.py; Prometheus' HTTP API over a
range: pipelines/watch/prometheus.py) produce the same `WindowData`, so every figure is computed by one piece of code
(pipelines/watch/figures.py). The series read are vLLM's, named in pipelines/serve/vllm_series.py.
"""

from __future__ import annotations

import math

from pydantic import Field

from pipelines.schema import StrictModel


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
