"""Multiwindow, multi-burn-rate SLO alerts (Google SRE Workbook, ch. 5 "Alerting on SLOs", its sixth iteration), derived
from the envelope's SLOs, and the alerts that are not about a budget: corrupted output, overload, the NaN check being off.

The SLOs:
- errors: requests that ended in an engine error or abort, or answered HTTP 5xx other than an admission rejection (overload
  is not failure: pipelines/deploy/promql.py), over the requests answered; objective 1 - production.max_error_rate (99%);
- latency: TTFT, ITL and, when the policy sets production.e2e_p95_ms, end-to-end: the share of requests (ITL: of token gaps,
  which is what vLLM's histogram counts) over the limit `quantize watch` holds (pipelines/deploy/limits.py), objective
  production.latency_slo_target (95%: what a p95 limit means). vLLM's histograms only count per bucket, so the share is read
  at the first bucket bound at or above the limit: a request between the limit and that bound counts as within (each rule's
  description names the bound). A limit above the last finite bound gets no rule: nothing can be counted over it.

A budget burns at rate r when the bad share is r x (1 - objective). Page when r > 14.4 over 1 h and over 5 min, or r > 6 over
6 h and over 30 min; ticket when r > 3 over 1 d and over 2 h, or r > 1 over 3 d and over 6 h. The long window says the burn is
real, the short one that it still goes on, so an alert resolves within minutes of the burn's end. Each SLI's ratio per window is
a recording rule, `quantgate:<sli>:ratio_rate<window>`, labelled with the scrape job.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pipelines.deploy.envelope import Envelope
from pipelines.deploy.limits import limits
from pipelines.deploy.promql import duration, error_ratio, job_name, over_limit_ratio, selector
from pipelines.deploy.spec import ServedSpec
from pipelines.errors import InputError
from pipelines.schema import FrozenModel
from pipelines.serve.serving import NAN_CHECK_ENV
from pipelines.serve.vllm_series import ADMISSION_REJECTIONS, CORRUPTED_REQUESTS, HISTOGRAMS, LATENCY_BUCKETS_S

Severity = Literal["page", "ticket"]


class BurnWindows(FrozenModel):
    """One condition of an alert: the budget burns faster than `factor` over both windows."""

    severity: Severity
    factor: float = Field(gt=0)
    long_s: int = Field(gt=0)
    short_s: int = Field(gt=0)


BURN_WINDOWS = (  # the Workbook's table for a 30-day SLO: the share of the month's budget each spends
    BurnWindows(severity="page", factor=14.4, long_s=3600, short_s=300),  # 2% in 1 h
    BurnWindows(severity="page", factor=6, long_s=6 * 3600, short_s=1800),  # 5% in 6 h
    BurnWindows(severity="ticket", factor=3, long_s=86_400, short_s=2 * 3600),  # 10% in 1 d
    BurnWindows(severity="ticket", factor=1, long_s=3 * 86_400, short_s=6 * 3600),  # 10% in 3 d
)
WINDOWS_S = sorted({seconds for pair in BURN_WINDOWS for seconds in (pair.long_s, pair.short_s)})
_LATENCIES = {"ttft_p95_s": ("Ttft", "ttft", "time to first token"), "itl_p95_s": ("Itl", "itl", "inter-token latency"),
              "e2e_p95_s": ("E2e", "e2e", "end-to-end latency")}
SLO_FIGURES = ("error_rate", *_LATENCIES)
HEALTH_FIGURES = ("corrupted_requests",)  # watched figures whose rules are health_rules
BURN_SUFFIX = "BudgetBurn"


class Slo(FrozenModel):
    """One SLO of a deployment: what is bad, the share of it the objective allows (the budget), and where both came from."""

    figure: str = Field(description="the watched figure it stands for (pipelines/deploy/limits.py)")
    name: str = Field(description="in the alert's name: Vllm<name>BudgetBurn")
    sli: str = Field(description="the recording rules' prefix: <sli>:ratio_rate<window>")
    budget: float = Field(ge=0, lt=1, description="1 - objective: the share of bad requests the SLO allows")
    histogram: str | None = Field(default=None, description="latency SLOs: the vLLM histogram")
    bound_s: float | None = Field(default=None, description="latency SLOs: the bucket bound requests are counted over")
    description: str

    @property
    def alert(self) -> str:
        return f"Vllm{self.name}{BURN_SUFFIX}"

    def record(self, window_s: int) -> str:
        return f"{self.sli}:ratio_rate{duration(window_s)}"

    def ratio(self, spec: ServedSpec, window_s: int) -> str:
        if self.histogram is None or self.bound_s is None:
            return error_ratio(spec, window_s)
        return over_limit_ratio(spec, self.histogram, self.bound_s, window_s)


def slos(spec: ServedSpec) -> list[Slo]:
    """The deployment's SLOs, each checked that its fastest burn can be told apart from a total outage."""
    envelope = spec.require_envelope()
    production = envelope.production
    found = [Slo(figure="error_rate", name="ErrorRate", sli="quantgate:request_errors", budget=production.max_error_rate,
                 description=f"errors (engine error or abort; HTTP 5xx but admission rejections) over requests answered; objective "
                             f"{1 - production.max_error_rate:.4g} from policy production.max_error_rate {production.max_error_rate:g}")]
    for limit in limits(envelope):
        if limit.figure not in _LATENCIES:
            continue
        name, kind, words = _LATENCIES[limit.figure]
        bound = next((b for b in LATENCY_BUCKETS_S[kind] if b >= limit.limit - 1e-12), None)
        if bound is None:
            continue
        counted = "token gaps" if kind == "itl" else "requests"
        found.append(Slo(
            figure=limit.figure, name=name, sli=f"quantgate:{kind}_over_limit", budget=1 - production.latency_slo_target,
            histogram=HISTOGRAMS[kind], bound_s=bound,
            description=f"{counted} with {words} over {bound:g} s (vLLM's bucket bound at or above the limit {limit.limit:.4g} s: "
                        f"{limit.source}); objective {production.latency_slo_target:g} from policy production.latency_slo_target"))
    for slo in found:
        _require_reachable(slo, envelope)
    return found


def _require_reachable(slo: Slo, envelope: Envelope) -> None:
    fastest = max(pair.factor for pair in BURN_WINDOWS)
    if 0 < fastest * slo.budget < 1:
        return
    field = "max_error_rate" if slo.figure == "error_rate" else "latency_slo_target"
    value = getattr(envelope.production, field)
    why = ("leaves no budget to burn: any bad request would page" if slo.budget == 0 else
           f"leaves a budget of {slo.budget:.3g}: a {fastest:g}x burn of it is over 100% of requests, so the fast page could never fire")
    raise InputError(f"{value:g} {why}; burn-rate alerts need a budget above 0 and under {1 / fastest:.4f}", file=envelope.gate_path,
                     field=f"performance.production.{field}")


def slo_rules(spec: ServedSpec, labels: dict[str, str]) -> list[dict[str, Any]]:
    """The recording rules (every SLI over every window), then a page and a ticket alert per SLO."""
    found, job = slos(spec), job_name(spec)
    records = [{"record": slo.record(window), "expr": slo.ratio(spec, window), "labels": {"job": job}}
               for slo in found for window in WINDOWS_S]
    alerts = [_burn_alert(spec, slo, severity, labels) for slo in found for severity in ("page", "ticket")]
    return records + alerts


def _burn_alert(spec: ServedSpec, slo: Slo, severity: Severity, labels: dict[str, str]) -> dict[str, Any]:
    pairs = [pair for pair in BURN_WINDOWS if pair.severity == severity]
    job = "{" + f'job="{job_name(spec)}"' + "}"

    def over(window_s: int, factor: float) -> str:
        return f"{slo.record(window_s)}{job} > ({factor:g} * {slo.budget:.6g})"

    expr = " or ".join(f"({over(pair.long_s, pair.factor)} and {over(pair.short_s, pair.factor)})" for pair in pairs)
    windows = ", or ".join(f"{pair.factor:g}x over {duration(pair.long_s)} and {duration(pair.short_s)}" for pair in pairs)
    return {
        "alert": slo.alert, "expr": expr,
        "labels": {**labels, "severity": severity, "figure": slo.figure},
        "annotations": {
            "summary": f"{spec.model} v{spec.version}: the {slo.figure} SLO's error budget ({slo.budget:.4g}) burns too fast: {windows}",
            "description": f"bad: {slo.description}",
        },
    }


def health_rules(spec: ServedSpec, window_s: int, alert_for_s: int, labels: dict[str, str]) -> list[dict[str, Any]]:
    """Not budgets: a page on any corrupted request, a ticket on overload (admission rejections: the server is full, not
    failing), and a ticket when the server does not count corrupted requests at all (started without NAN_CHECK_ENV)."""
    sel, w, who = selector(spec), duration(window_s), f"{spec.model} v{spec.version}"
    return [
        {"alert": "VllmCorruptedRequests", "expr": f"sum(increase({CORRUPTED_REQUESTS}{sel}[{w}])) > 0",
         "labels": {**labels, "severity": "page", "figure": "corrupted_requests"},
         "annotations": {"summary": f"{who}: requests with NaN logits in the last {w} (garbage answered with 200 OK)",
                         "description": f"{CORRUPTED_REQUESTS} increased; the server counts them with {NAN_CHECK_ENV}=1"}},
        {"alert": "VllmOverloaded", "expr": f"sum(increase({ADMISSION_REJECTIONS}{sel}[{w}])) > 0", "for": duration(alert_for_s),
         "labels": {**labels, "severity": "ticket", "figure": "admission_rejections"},
         "annotations": {"summary": f"{who}: admissions refused by a queue limit in the last {w} (overload: HTTP 503, not failure)",
                         "description": f"{ADMISSION_REJECTIONS} increased; these requests are left out of the error-rate SLO"}},
        {"alert": "VllmNanCheckOff", "expr": f"max(up{sel}) == 1 unless count({CORRUPTED_REQUESTS}{sel})", "for": w,
         "labels": {**labels, "severity": "ticket", "figure": "corrupted_requests"},
         "annotations": {"summary": f"{who}: the server does not count corrupted requests",
                         "description": f"no {CORRUPTED_REQUESTS} series: start vLLM with {NAN_CHECK_ENV}=1 (serve.sh does)"}},
    ]
