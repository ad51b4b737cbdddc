"""A vLLM server's /metrics page, read with bounds, and the window between two reads.

Everything a page can do to the reader is bounded before it is parsed: its size (MAX_PAGE_BYTES, read in chunks against
one deadline, so a server that trickles bytes is cut off in time), each line's length (MAX_LINE_CHARS: a huge label value),
and the number of series kept (MAX_SERIES: only the series `quantize watch` reads are kept, so millions of other series cost
one pass over their lines and nothing else). What is kept is parsed by the Prometheus client's own parser of the text
exposition format. A page without any vllm:* series is not vLLM's (or comes from a server started with --disable-log-stats);
a counter or bucket that is NaN, infinite or negative, a histogram whose buckets are not cumulative, or a counter that went
down between two reads (the server restarted: a counter reset) cannot be measured: each is one line naming the series.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable
from urllib.parse import urlunsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field

from pipelines.bounds import MiB
from pipelines.console.redact import without_credentials
from pipelines.console.urls import checked_url
from pipelines.errors import InputError
from pipelines.schema import StrictModel
from pipelines.serve.bounded_http import get_bounded
from pipelines.serve.bounded_http import short as _short
from pipelines.serve.vllm_series import API_HANDLER_PREFIX, CACHE_INFO, COUNTERS, GAUGES, GROUPED_COUNTERS, HISTOGRAMS, VLLM_PREFIX
from pipelines.watch.series import Histogram, KvCacheInfo, WindowData, counter_key

MAX_PAGE_BYTES = 32 * MiB  # vLLM's own page is about 50 KB
MAX_LINE_CHARS = 64 * 1024
MAX_SERIES = 100_000  # series kept (the ones read), after the others are dropped unparsed
SCRAPE_TIMEOUT_S = 10.0
START_TIME = "process_start_time_seconds"
MAX_MODEL_NAMES = 16
METRICS_PATH = "/metrics"
BASE_PATHS = ("", "/v1")  # a server's root and its OpenAI base URL: both mean the server, whose page is METRICS_PATH

_BUCKET_NAMES = {f"{base}_bucket": key for key, base in HISTOGRAMS.items()}
_SUM_NAMES = {f"{base}_sum": key for key, base in HISTOGRAMS.items()}
_COUNT_NAMES = {f"{base}_count": key for key, base in HISTOGRAMS.items()}
_COUNTER_NAMES = {name: key for key, name in COUNTERS.items()}
_GROUPED_NAMES = {name: (prefix, label) for prefix, (name, label) in GROUPED_COUNTERS.items()}
_GAUGE_NAMES = {name: key for key, name in GAUGES.items()}
WANTED = {*_BUCKET_NAMES, *_SUM_NAMES, *_COUNT_NAMES, *_COUNTER_NAMES, *_GROUPED_NAMES, *_GAUGE_NAMES, CACHE_INFO, START_TIME}


class Scrape(StrictModel):
    """One read of the page: cumulative counters and histograms, gauges summed over their series."""

    at: float = Field(description="epoch seconds")
    counters: dict[str, float]
    histograms: dict[str, Histogram]
    gauges: dict[str, float]
    kv: KvCacheInfo | None = None
    started: float | None = Field(default=None, description="process_start_time_seconds: a change means a restart")
    model_names: list[str] = Field(default_factory=list, description="the model_name labels of the vllm:* series (the served names)")


def metrics_url(url: str, field: str = "--url") -> str:
    """The metrics page of `url`. A server's base URL (http://HOST:PORT, with or without a trailing slash, or its OpenAI base
    URL ending in /v1) means its /metrics; a path ending in /metrics is read without a trailing slash; any other path is read
    as given (a page there that is not a metrics page is refused by `parse_page`, a 404 by `fetch_page`, each with one line)."""
    parts = checked_url(url.strip(), field)
    path = parts.path.rstrip("/")
    if path in BASE_PATHS:
        path = METRICS_PATH
    elif not path.endswith(METRICS_PATH):
        path = parts.path
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def fetch_page(client: httpx.Client, url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> bytes:
    return get_bounded(client, url, field="--url", max_bytes=MAX_PAGE_BYTES, timeout_s=timeout_s, what="metrics page")


def scrape(client: httpx.Client, url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> Scrape:
    at = time.time()
    return parse_page(fetch_page(client, url, timeout_s), without_credentials(url), at)


def parse_page(data: bytes, source: str, at: float) -> Scrape:
    """The series `quantize watch` reads, from a text exposition page (see the module docstring for the bounds)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"the metrics page is not UTF-8 (byte {error.start})", file=source, field="--url") from None
    kept = _kept_lines(text.split("\n"), source)
    try:
        families = list(text_string_to_metric_families("\n".join(kept) + "\n"))
    except (ValueError, TypeError, IndexError) as error:
        raise InputError(f"malformed metrics exposition ({_short(str(error))})", file=source, field="--url") from None
    return _collect((sample for family in families for sample in family.samples), source, at)


def _kept_lines(lines: list[str], source: str) -> list[str]:
    kept: list[str] = []
    vllm = False
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_LINE_CHARS:
            raise InputError(f"line {number} of the metrics page is {len(line)} characters long (at most {MAX_LINE_CHARS}): "
                             f"{_short(line)}", file=source, field="--url")
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].strip()
        vllm = vllm or name.startswith(VLLM_PREFIX)
        if name in WANTED:
            kept.append(line)
            if len(kept) > MAX_SERIES:
                raise InputError(f"the metrics page has more than {MAX_SERIES} series of the metrics watched (a label that "
                                 f"takes unbounded values?)", file=source, field="--url")
    if not vllm:
        raise InputError(f"no {VLLM_PREFIX}* series: not a vLLM server's /metrics page (a vLLM started with --disable-log-stats exports "
                         "none of them)", file=source, field="--url")
    return kept


def _collect(samples: Iterable, source: str, at: float) -> Scrape:
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    kv, started = None, None
    names: set[str] = set()
    for sample in samples:
        name, labels, value = sample.name, sample.labels, float(sample.value)
        if "model_name" in labels and len(names) < MAX_MODEL_NAMES:
            names.add(labels["model_name"][:200])
        if not math.isfinite(value):
            raise InputError(f"{name}{_labels(labels)} is {value}: not a measurement", file=source, field="--url")
        if name in _GAUGE_NAMES:
            gauges[_GAUGE_NAMES[name]] = gauges.get(_GAUGE_NAMES[name], 0.0) + value
            continue
        if name == CACHE_INFO:
            kv = kv_info(labels)
            continue
        if name == START_TIME:
            started = value
            continue
        if value < 0:
            raise InputError(f"{name}{_labels(labels)} is {value:g}: a counter cannot be negative", file=source, field="--url")
        if name in _COUNTER_NAMES:
            key = _COUNTER_NAMES[name]
        elif name in _GROUPED_NAMES:
            prefix, label = _GROUPED_NAMES[name]
            if prefix == "http" and not labels.get("handler", "").startswith(API_HANDLER_PREFIX):
                continue
            key = counter_key(prefix, labels.get(label, "")[:64])
        elif name in _BUCKET_NAMES:
            bound = _bound(labels.get("le"), name, source)
            per_bound = buckets.setdefault(_BUCKET_NAMES[name], {})
            per_bound[bound] = per_bound.get(bound, 0.0) + value
            continue
        elif name in _SUM_NAMES:
            sums[_SUM_NAMES[name]] = sums.get(_SUM_NAMES[name], 0.0) + value
            continue
        else:
            counts[_COUNT_NAMES[name]] = counts.get(_COUNT_NAMES[name], 0.0) + value
            continue
        counters[key] = counters.get(key, 0.0) + value
    histograms = {key: _histogram(key, per_bound, sums.get(key, 0.0), counts.get(key), source) for key, per_bound in buckets.items()}
    return Scrape(at=at, counters=counters, histograms=histograms, gauges=gauges, kv=kv, started=started, model_names=sorted(names))


def _labels(labels: dict[str, str]) -> str:
    return _short("{" + ",".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}") if labels else ""


def _bound(text: str | None, name: str, source: str) -> float:
    try:
        bound = float(text) if text is not None else math.nan
    except ValueError:
        bound = math.nan
    if math.isnan(bound):
        raise InputError(f"{name} has a bucket without a numeric le label ({_short(str(text))})", file=source, field="--url")
    return bound


def _histogram(key: str, per_bound: dict[float, float], total: float, count: float | None, source: str) -> Histogram:
    bounds = sorted(per_bound)
    cumulative = [per_bound[bound] for bound in bounds]
    name = HISTOGRAMS[key]
    if not bounds or bounds[-1] != math.inf:
        raise InputError(f"{name} has no +Inf bucket", file=source, field="--url")
    if any(later < earlier for earlier, later in itertools.pairwise(cumulative)):
        raise InputError(f"{name}'s buckets are not cumulative (a count falls as le grows)", file=source, field="--url")
    return Histogram(buckets=[(None if bound == math.inf else bound, value) for bound, value in zip(bounds, cumulative, strict=True)],
                     sum=total, count=count if count is not None else cumulative[-1])


def kv_info(labels: dict[str, str]) -> KvCacheInfo:
    def number(key: str, kind: type) -> int | float | None:
        try:
            value = kind(float(labels[key]))
        except (KeyError, ValueError, OverflowError):
            return None
        return value if math.isfinite(value) and value >= 0 else None

    return KvCacheInfo(block_size=number("block_size", int), num_blocks=number("num_gpu_blocks", int),
                       size_tokens=number("kv_cache_size_tokens", int), max_concurrency=number("kv_cache_max_concurrency", float),
                       memory_bytes=number("kv_cache_memory_bytes", int))


# --- a window between two reads ---------------------------------------------------------------------------


def window_between(index: int, first: Scrape, last: Scrape, samples: list[Scrape], source: str) -> WindowData:
    """Counters and buckets as increases from `first` to `last`, gauges as sampled by `samples` (which end with `last`)."""
    if first.started is not None and last.started is not None and abs(last.started - first.started) > 1e-3:
        raise InputError(f"the server restarted during window {index} (process start time moved): its counters reset, the window "
                         "cannot be measured; watch again", file=source, field="--url")
    counters = {key: _increase(key, first.counters.get(key, 0.0), value, index, source) for key, value in last.counters.items()}
    histograms = {}
    for key, histogram in last.histograms.items():
        before = first.histograms.get(key)
        histograms[key] = _histogram_increase(key, before, histogram, index, source) if before is not None else histogram
    gauges: dict[str, list[tuple[float, float]]] = {}
    for scrape_ in samples:
        for key, value in scrape_.gauges.items():
            gauges.setdefault(key, []).append((scrape_.at, value))
    return WindowData(index=index, start=first.at, end=last.at, counters=counters, histograms=histograms, gauges=gauges, kv=last.kv)


def _increase(key: str, before: float, after: float, index: int, source: str) -> float:
    if after < before:
        raise InputError(f"counter {key} went down from {before:g} to {after:g} in window {index}: the server restarted (a counter "
                         "reset); the window cannot be measured, watch again", file=source, field="--url")
    return after - before


def _histogram_increase(key: str, before: Histogram, after: Histogram, index: int, source: str) -> Histogram:
    if [b for b, _ in before.buckets] != [b for b, _ in after.buckets]:
        raise InputError(f"{HISTOGRAMS[key]} changed its buckets in window {index} (another server answered?)", file=source, field="--url")
    buckets = [(bound, _increase(HISTOGRAMS[key], old, new, index, source))
               for (bound, old), (_, new) in zip(before.buckets, after.buckets, strict=True)]
    count = _increase(HISTOGRAMS[key], before.count, after.count, index, source)
    return Histogram(buckets=buckets, sum=max(after.sum - before.sum, 0.0), count=count)
