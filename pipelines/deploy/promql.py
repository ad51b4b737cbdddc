"""PromQL over one deployment's series: its scrape job's selector, windows as Prometheus durations, the error ratio.

Every series is named in pipelines/serve/vllm_series.py (vLLM's and the HTTP layer's); nothing here spells one out.
"""

from __future__ import annotations

from pipelines.deploy.spec import ServedSpec
from pipelines.serve.vllm_series import ADMISSION_REJECTIONS, API_HANDLER_PREFIX, HTTP_REQUESTS, REQUEST_SUCCESS

_UNITS = (("d", 86_400), ("h", 3600), ("m", 60))


def job_name(spec: ServedSpec) -> str:
    return f"quantgate-{spec.model}"


def duration(seconds: float) -> str:
    """A Prometheus duration (whole seconds, in the largest unit that divides them): 300 -> 5m, 86400 -> 1d, 90 -> 90s; a
    positive duration under a second is 1s (a range or step of 0 is refused by Prometheus)."""
    whole = max(round(seconds), 1 if seconds > 0 else 0)
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
    engine = (f"sum(rate({REQUEST_SUCCESS}{selector(spec, failed)}[{w}]))"
              f" / sum(rate({REQUEST_SUCCESS}{sel}[{w}]))")
    http = (f"clamp_min(sum(rate({HTTP_REQUESTS}{selector(spec, server_error)}[{w}])) - {rejected}, 0)"
            f" / (sum(rate({HTTP_REQUESTS}{selector(spec, not_client_error)}[{w}])) - {rejected})")
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
