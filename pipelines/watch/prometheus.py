"""The same windows from Prometheus' HTTP API, over a range that has already happened.

For N windows of W seconds ending now, every counter and every histogram bucket is asked as `increase(...[W s])`
evaluated at each window's end (one /api/v1/query_range per series, step W), which Prometheus computes across counter
resets (a restarted server does not break a window here, as it does for the live reader); gauges are asked as their sum
over the range with a step of at least 1 s. Series are selected by the target's `instance` label (HOST:PORT of --url, as
a scrape config that names the target writes it).

Every answer is bounded: MAX_ANSWER_BYTES per answer, MAX_SERIES per answer, `timeout_s` per request (a Prometheus that
answers slowly is one line, exit 2), and a value that is not a finite non-negative number is refused, naming the query.
"""

from __future__ import annotations

import json
import math

import httpx

from pipelines.bounds import MiB
from pipelines.console.redact import without_credentials
from pipelines.console.urls import checked_url
from pipelines.deploy.promql import duration
from pipelines.errors import InputError
from pipelines.serve.bounded_http import get_bounded, short
from pipelines.serve.vllm_series import API_HANDLER_PREFIX, CACHE_INFO, COUNTERS, GAUGES, GROUPED_COUNTERS, HISTOGRAMS, VLLM_PREFIX
from pipelines.watch.exposition import kv_info
from pipelines.watch.series import Histogram, KvCacheInfo, WindowData, counter_key

MAX_ANSWER_BYTES = 16 * MiB
MAX_SERIES = 10_000
QUERY_TIMEOUT_S = 10.0
MAX_GAUGE_POINTS = 1000
FIELD = "--prometheus"


def instance_of(url: str) -> str:
    """The `instance` label Prometheus gives the target at `url` (HOST:PORT, the scheme's default port when none)."""
    parsed = checked_url(url, "--url")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    assert parsed.hostname is not None  # checked_url refuses a URL without a host
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{host}:{port}"


class PrometheusWindows:
    """Windows of one target's vLLM series, read from a Prometheus server."""

    def __init__(self, client: httpx.Client, base_url: str, instance: str, *, timeout_s: float = QUERY_TIMEOUT_S):
        checked_url(base_url, FIELD)
        self.client, self.base = client, base_url.rstrip("/")
        self.shown = without_credentials(self.base)
        self.selector = f'instance="{_escape(instance)}"'
        self.instance, self.timeout_s = instance, timeout_s

    def windows(self, end: float, window_s: float, count: int) -> list[WindowData]:
        """The `count` windows of `window_s` seconds that end at `end` (epoch seconds), oldest first."""
        self._require_series(end)
        ends = [end - (count - 1 - i) * window_s for i in range(count)]
        counters: list[dict[str, float]] = [{} for _ in ends]
        for key, name in COUNTERS.items():
            self._fill(counters, ends, window_s, f"sum(increase({name}{{{self.selector}}}[{duration(window_s)}]))", lambda _, k=key: k)
        for prefix, (name, label) in GROUPED_COUNTERS.items():
            extra = f',handler=~"{API_HANDLER_PREFIX}.*"' if prefix == "http" else ""
            query = f"sum by ({label}) (increase({name}{{{self.selector}{extra}}}[{duration(window_s)}]))"
            self._fill(counters, ends, window_s, query, lambda metric, p=prefix, lab=label: counter_key(p, str(metric.get(lab, ""))[:64]))
        histograms = self._histograms(ends, window_s)
        gauges = self._gauges(ends[0] - window_s, end, window_s, count)
        kv = self._kv_info(end)
        per_window = _gauges_by_window(gauges, ends, window_s)
        return [
            WindowData(index=i + 1, start=window_end - window_s, end=window_end, counters=counters[i], histograms=histograms[i],
                       gauges=per_window[i], kv=kv)
            for i, window_end in enumerate(ends)
        ]

    # --- queries -------------------------------------------------------------------------------------------

    def _require_series(self, at: float) -> None:
        result = self._query("/api/v1/query", {"query": f'count({{__name__=~"{VLLM_PREFIX}.+",{self.selector}}})', "time": _time(at)})
        value = result[0].get("value") if result else None
        count = value[1] if isinstance(value, list) and len(value) == 2 else "0"
        if _float(count, f"count of {VLLM_PREFIX}* series") <= 0:
            raise InputError(f"Prometheus holds no {VLLM_PREFIX}* series with instance={self.instance!r} now: is it scraping that vLLM server "
                             "(and was the server started without --disable-log-stats)?", file=self.shown, field=FIELD)

    def _range(self, query: str, start: float, end: float, step: float) -> list[dict]:
        return self._query("/api/v1/query_range", {"query": query, "start": _time(start), "end": _time(end), "step": duration(step)})

    def _fill(self, into: list[dict[str, float]], ends: list[float], window_s: float, query: str, key_of) -> None:
        for series in self._range(query, ends[0], ends[-1], window_s):
            key = key_of(_metric(series, query))
            for at, value in _points(series, query):
                index = _nearest(ends, at, window_s)
                if index is not None:
                    into[index][key] = into[index].get(key, 0.0) + value

    def _histograms(self, ends: list[float], window_s: float) -> list[dict[str, Histogram]]:
        found: list[dict[str, Histogram]] = [{} for _ in ends]
        for key, base in HISTOGRAMS.items():
            buckets: list[dict[float, float]] = [{} for _ in ends]
            totals: list[dict[str, float]] = [{} for _ in ends]
            rng = duration(window_s)
            for series in self._range(f"sum by (le) (increase({base}_bucket{{{self.selector}}}[{rng}]))", ends[0], ends[-1], window_s):
                bound = _bound(_metric(series, base).get("le"), base, self.shown)
                for at, value in _points(series, base):
                    index = _nearest(ends, at, window_s)
                    if index is not None:
                        buckets[index][bound] = value
            self._fill(totals, ends, window_s, f"sum(increase({base}_sum{{{self.selector}}}[{rng}]))", lambda _: "sum")
            self._fill(totals, ends, window_s, f"sum(increase({base}_count{{{self.selector}}}[{rng}]))", lambda _: "count")
            for index, per_bound in enumerate(buckets):
                if per_bound and max(per_bound) == math.inf:
                    bounds = sorted(per_bound)
                    cumulative = _monotone([per_bound[b] for b in bounds])  # extrapolated increases can wobble by rounding
                    found[index][key] = Histogram(
                        buckets=[(None if b == math.inf else b, c) for b, c in zip(bounds, cumulative, strict=True)],
                        sum=totals[index].get("sum", 0.0), count=totals[index].get("count", cumulative[-1]))
        return found

    def _gauges(self, start: float, end: float, window_s: float, count: int) -> dict[str, list[tuple[float, float]]]:
        step = max(1.0, window_s * count / MAX_GAUGE_POINTS)
        gauges: dict[str, list[tuple[float, float]]] = {}
        for key, name in GAUGES.items():
            for series in self._range(f"sum({name}{{{self.selector}}})", start, end, step):
                gauges[key] = _points(series, name)
        return gauges

    def _kv_info(self, at: float) -> KvCacheInfo | None:
        result = self._query("/api/v1/query", {"query": f"{CACHE_INFO}{{{self.selector}}}", "time": _time(at)})
        if not result:
            return None
        return kv_info({str(k): str(v) for k, v in _metric(result[0], CACHE_INFO).items()})

    def _query(self, path: str, params: dict[str, str]) -> list[dict]:
        url = self.base + path
        shown = self.shown + path
        body = get_bounded(self.client, url, field=FIELD, max_bytes=MAX_ANSWER_BYTES, timeout_s=self.timeout_s, params=params,
                           what="answer")
        try:
            answer = json.loads(body)
        except (ValueError, RecursionError):
            raise InputError(f"answered something that is not JSON to {params['query']!r}", file=shown, field=FIELD) from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            error = answer.get("error") if isinstance(answer, dict) else None
            raise InputError(f"refused {short(params['query'])!r}: {short(str(error or answer))}", file=shown, field=FIELD)
        result = (answer.get("data") or {}).get("result") if isinstance(answer.get("data"), dict) else None
        if not isinstance(result, list) or not all(isinstance(series, dict) for series in result):
            raise InputError(f"answered {short(params['query'])!r} with no list of series", file=shown, field=FIELD)
        if len(result) > MAX_SERIES:
            raise InputError(f"answered {short(params['query'])!r} with {len(result)} series (at most {MAX_SERIES})", file=shown, field=FIELD)
        return result


def _metric(series: dict, what: str) -> dict:
    metric = series.get("metric", {})
    if not isinstance(metric, dict):
        raise InputError(f"Prometheus answered a series whose labels are not an object for {short(what)}", field=FIELD)
    return metric


def _points(series: dict, what: str) -> list[tuple[float, float]]:
    """A range series' [time, value] pairs: each time a finite number, each value a finite non-negative one."""
    values = series.get("values", [])
    if not isinstance(values, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in values):
        raise InputError(f"Prometheus answered {short(what)} with values that are not [time, value] pairs", field=FIELD)
    points = []
    for at, value in values:
        try:
            moment = float(at)
        except (TypeError, ValueError):
            moment = math.nan
        if not math.isfinite(moment):
            raise InputError(f"Prometheus answered the time {short(str(at), 40)!r} for {short(what)}: not a finite number", field=FIELD)
        points.append((moment, _float(value, what)))
    return points


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _time(epoch: float) -> str:
    return f"{epoch:.3f}"


def _nearest(ends: list[float], at: float, window_s: float) -> int | None:
    """The window ending nearest `at` (ends are `window_s` apart), if within half a window: O(1) a point, so an answer of
    half a million points against 10,000 windows costs half a million steps, not 5e9."""
    if not math.isfinite(at):
        return None
    index = min(max(round((at - ends[0]) / window_s), 0), len(ends) - 1)
    return index if abs(ends[index] - at) <= window_s / 2 else None


def _gauges_by_window(gauges: dict[str, list[tuple[float, float]]], ends: list[float],
                      window_s: float) -> list[dict[str, list[tuple[float, float]]]]:
    """Each gauge sample in the window (end - window_s, end] that holds it, found by arithmetic (one step a sample)."""
    found: list[dict[str, list[tuple[float, float]]]] = [{key: [] for key in gauges} for _ in ends]
    for key, samples in gauges.items():
        for at, value in samples:
            if not math.isfinite(at):
                continue
            guess = math.ceil((at - ends[0]) / window_s)  # (end_i - w, end_i] holds at when guess == i (give or take rounding)
            index = next((i for i in (guess, guess - 1) if 0 <= i < len(ends) and ends[i] - window_s < at <= ends[i]), None)
            if index is not None:
                found[index][key].append((at, value))
    return found


def _float(value: object, what: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise InputError(f"Prometheus answered {short(str(value), 40)!r} for {short(what)}: not a finite non-negative number", field=FIELD)
    return number


def _bound(text: object, name: str, source: str) -> float:
    try:
        bound = float(str(text))
    except ValueError:
        bound = math.nan
    if math.isnan(bound):
        raise InputError(f"{name} has a bucket without a numeric le label ({short(str(text), 40)})", file=source, field=FIELD)
    return bound


def _monotone(values: list[float]) -> list[float]:
    out, highest = [], 0.0
    for value in values:
        highest = max(highest, value)
        out.append(highest)
    return out
