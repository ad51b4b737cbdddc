"""PromQL over one deployment's series: its scrape job's selector, windows as Prometheus durations, the error ratio.

Series names are vLLM 0.32's (vllm/v1/metrics/loggers.py of the serve environment) and the HTTP layer's
(prometheus-fastapi-instrumentator: `http_requests_total` by handler and grouped status, 2xx ... 5xx).
"""

from __future__ import annotations

from pipelines.deploy.spec import ServedSpec
from pipelines.watch.series import API_HANDLER_PREFIX

# Admissions refused by a queue limit (--max-num-queued-reqs / --max-num-queued-tokens), by `reason`: vLLM answers them
# HTTP 503 (QueueOverflowError, MaxQueuedTokensError in vllm/exceptions.py), so the HTTP layer's 5xx count holds them too.
ADMISSION_REJECTIONS = "vllm:admission_rejections_total"
# Requests with a NaN in their logits; the series exists only on a server started with VLLM_COMPUTE_NANS_IN_LOGITS=1.
CORRUPTED_REQUESTS = "vllm:corrupted_requests_total"
_UNITS = (("d", 86_400), ("h", 3600), ("m", 60))


def job_name(spec: ServedSpec) -> str:
    return f"quantgate-{spec.model}"


def duration(seconds: float) -> str:
    """A Prometheus duration in the largest unit that divides it: 300 -> 5m, 86400 -> 1d, 90 -> 90s."""
    whole = int(seconds)
    for unit, size in _UNITS:
        if whole >= size and whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def selector(spec: ServedSpec, extra: str = "") -> str:
    return "{" + f'job="{job_name(spec)}"' + (f",{extra}" if extra else "") + "}"


def error_rates(spec: ServedSpec, window_s: int) -> tuple[str, str]:
    """The engine's and the HTTP layer's error ratios over one window; the error rate is the larger (pipelines/watch/figures.py).
    Admission rejections are overload, not failure: they leave the HTTP layer's 5xx and its answered requests alike."""
    w, sel = duration(window_s), selector(spec)
    api = f'handler=~"{API_HANDLER_PREFIX}.*"'
    failed, server_error, not_client_error = 'finished_reason=~"error|abort"', f'{api},status="5xx"', f'{api},status!="4xx"'
    rejected = f"(sum(rate({ADMISSION_REJECTIONS}{sel}[{w}])) or vector(0))"
    engine = (f"sum(rate(vllm:request_success_total{selector(spec, failed)}[{w}]))"
              f" / sum(rate(vllm:request_success_total{sel}[{w}]))")
    http = (f"clamp_min(sum(rate(http_requests_total{selector(spec, server_error)}[{w}])) - {rejected}, 0)"
            f" / (sum(rate(http_requests_total{selector(spec, not_client_error)}[{w}])) - {rejected})")
    return engine, http


def error_ratio(spec: ServedSpec, window_s: int) -> str:
    """One series: the larger of the two error ratios (either alone where the other has no requests)."""
    engine, http = error_rates(spec, window_s)
    return (f'max(label_replace({engine}, "layer", "engine", "", "")'
            f' or label_replace({http}, "layer", "http", "", ""))')


def le_matcher(bound_s: float) -> str:
    """A label matcher for one bucket bound, as the Prometheus client writes it (1.0, 0.25) and as Prometheus 3 normalises it (1)."""
    spellings = dict.fromkeys([repr(float(bound_s)), repr(float(bound_s)).removesuffix(".0")])
    return 'le=~"' + "|".join(spelling.replace(".", "\\\\.") for spelling in spellings) + '"'


def over_limit_ratio(spec: ServedSpec, histogram: str, bound_s: float, window_s: int) -> str:
    """The share of a histogram's observations over one of its bucket bounds, over one window."""
    w = duration(window_s)
    within = f"sum(rate({histogram}_bucket{selector(spec, le_matcher(bound_s))}[{w}]))"
    return f"1 - {within} / sum(rate({histogram}_count{selector(spec)}[{w}]))"
