"""A `promtool test rules` file for a deployment's alert rules: input series that must fire each alert and series that must not.

Written beside the rules (alert-rules.test.yml) so the operator can re-run it: `promtool test rules alert-rules.test.yml`.
Traffic is 1,000 requests a minute; the error series are the engine's (finished_reason), latency the TTFT histogram at its
SLO's bucket bound. Cases (times after the series start; a day of healthy traffic first where a long window must see it):

- must fire: a fast burn (after a day at a tenth of the budget, every request fails for 10 min: 1 h over 14.4x, 6 h not
  over 6x), a slow burn (after a day at a tenth of the budget, 8x it: the 6 h window passes 6x after about 4.5 h, not at
  2 h; the 3 d window, holding only 29 h, tickets too), TTFT over its limit for 90% of the requests for 50 min (a 5%
  budget's fast burn needs 72% of an hour's requests slow), one corrupted request, admission rejections (a ticket), a
  server without the NaN check (a ticket);
- must not fire: errors just under the SLO (0.9 x the budget, every window alike), a 5-minute blip of failures after a
  healthy day (the 1 h window does not confirm it), overload alone (rejections answered 503: neither the error page nor the
  error ticket).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelines.deploy.promql import ADMISSION_REJECTIONS, CORRUPTED_REQUESTS, job_name
from pipelines.deploy.slo import BURN_SUFFIX, Slo, slos
from pipelines.deploy.spec import ServedSpec

PER_MINUTE = 1000  # requests a minute in every case
DAY_MIN = 1440
# Rules are evaluated every 5 min over series sampled every minute (a 5-minute window needs two samples): evaluating every minute
# made the day-long cases 5x slower (13 to 33 s each on 2 loaded cores). Every eval_time below is a multiple of it.
EVALUATION_INTERVAL, SAMPLE_INTERVAL = "5m", "1m"
Segments = Sequence[tuple[int, float]]  # (minutes, increase per minute), in order


def counter(segments: Segments) -> str:
    """A counter in promtool's expanding notation, one sample a minute from 0: `a+bxn` is a, a+b, ..., a+n*b."""
    parts, value = ["0"], 0.0
    for minutes, step in segments:
        parts.append(f"{value + step:g}+{step:g}x{minutes - 1}")
        value += step * minutes
    return " ".join(parts)


def _engine(job: str, failing: Segments) -> list[dict[str, str]]:
    """The engine's finished requests: `failing` gives the failures a minute, the rest of PER_MINUTE finish with `stop`."""
    ok = [(minutes, PER_MINUTE - bad) for minutes, bad in failing]
    return [{"series": f'vllm:request_success_total{{job="{job}",finished_reason="stop"}}', "values": counter(ok)},
            {"series": f'vllm:request_success_total{{job="{job}",finished_reason="error"}}', "values": counter(failing)}]


class Expected:
    """The alerts a case expects, labelled and annotated as the rules themselves say (promtool compares both)."""

    def __init__(self, rules: dict[str, Any], job: str):
        self.job = job
        self.rules = {(rule["alert"], rule["labels"]["severity"]): rule for group in rules["groups"] for rule in group["rules"]
                      if "alert" in rule}

    def at(self, name: str, eval_time: str, severities: list[str]) -> dict[str, Any]:
        return {"eval_time": eval_time, "alertname": name, "exp_alerts": [self._alert(name, severity) for severity in severities]}

    def _alert(self, name: str, severity: str) -> dict[str, Any]:
        rule = self.rules[(name, severity)]
        labels = {**rule["labels"], "job": self.job} if name.endswith(BURN_SUFFIX) else rule["labels"]  # kept from the ratios
        return {"exp_labels": labels, "exp_annotations": rule["annotations"]}


def _error_cases(job: str, errors: Slo, expected: Expected) -> list[dict[str, Any]]:
    budget = errors.budget * PER_MINUTE  # failures a minute at exactly the SLO

    def case(name: str, failing: Segments, checks: list[tuple[str, list[str]]]) -> dict[str, Any]:
        return {"name": name, "interval": SAMPLE_INTERVAL, "input_series": _engine(job, failing),
                "alert_rule_test": [expected.at(errors.alert, at, severities) for at, severities in checks]}

    healthy = budget / 10
    return [
        case("must fire: fast burn (every request fails for 10 min after a healthy day)",
             [(DAY_MIN, healthy), (12, PER_MINUTE)], [("1d5m", []), ("1d10m", ["page"])]),
        case("must fire: slow burn (8x the budget after a healthy day; the 6 h window confirms it after about 4.5 h)",
             [(DAY_MIN, healthy), (5 * 60 + 5, 8 * budget)], [("1d2h", []), ("1d5h", ["page", "ticket"])]),
        case("must not fire: errors just under the SLO (0.9 x the budget for 6 h 30 min, every window alike)",
             [(6 * 60 + 35, 0.9 * budget)], [("1h", []), ("6h30m", [])]),
        case("must not fire: a 5-minute blip of failures after a healthy day (the 1 h window does not confirm it)",
             [(DAY_MIN, healthy), (5, PER_MINUTE), (10, healthy)], [("1d5m", []), ("1d10m", []), ("1d15m", [])]),
    ]


def _latency_case(job: str, latency: Slo, expected: Expected) -> dict[str, Any]:
    assert latency.histogram is not None and latency.bound_s is not None
    within = f'{latency.histogram}_bucket{{job="{job}",le="{latency.bound_s!r}"}}'
    slow = 0.9  # 14.4 x a 5% budget is 72% of an hour's requests: 90% slow for 50 min passes it, for 30 min does not
    return {
        "name": f"must fire: {latency.figure} over its limit for {slow:.0%} of the requests for 50 min after a healthy day "
                f"(counted at the bucket bound {latency.bound_s:g} s)",
        "interval": SAMPLE_INTERVAL,
        "input_series": [
            {"series": within, "values": counter([(DAY_MIN, PER_MINUTE), (55, PER_MINUTE * (1 - slow))])},
            {"series": f'{latency.histogram}_count{{job="{job}"}}', "values": counter([(DAY_MIN + 55, PER_MINUTE)])},
        ],
        "alert_rule_test": [expected.at(latency.alert, at, severities) for at, severities in (("1d30m", []), ("1d50m", ["page"]))],
    }


def _corruption_and_overload(job: str, served_name: str, error_alert: str, expected: Expected) -> list[dict[str, Any]]:
    engine = f'engine="0",model_name="{served_name}"'
    rejected: Segments = [(30, 0), (20, 100)]  # 10% of the minute's requests refused for 20 min after a quiet half hour
    http = f'job="{job}",handler="/v1/completions"'
    return [
        {"name": "must fire: one corrupted request (NaN logits)", "interval": SAMPLE_INTERVAL,
         "input_series": [{"series": f'{CORRUPTED_REQUESTS}{{job="{job}",{engine}}}', "values": "0x6 1x10"},
                          {"series": f'up{{job="{job}"}}', "values": "1x16"}],
         "alert_rule_test": [expected.at("VllmCorruptedRequests", "5m", []),
                             expected.at("VllmCorruptedRequests", "10m", ["page"]),
                             expected.at("VllmNanCheckOff", "15m", [])]},
        {"name": "must fire: the overload ticket; must not fire: the error SLO's alerts on overload alone (503s that are rejections)",
         "interval": SAMPLE_INTERVAL,
         "input_series": [
             *_engine(job, [(50, 0)]),
             {"series": f'{ADMISSION_REJECTIONS}{{job="{job}",model_name="{served_name}",reason="max_num_queued_reqs"}}',
              "values": counter(rejected)},
             {"series": f'http_requests_total{{{http},status="2xx"}}', "values": counter([(50, PER_MINUTE)])},
             {"series": f'http_requests_total{{{http},status="5xx"}}', "values": counter(rejected)},
         ],
         "alert_rule_test": [expected.at("VllmOverloaded", "45m", ["ticket"]),
                             expected.at(error_alert, "45m", [])]},
        {"name": "must fire: a server scraped without the NaN check (no corrupted-requests series)", "interval": SAMPLE_INTERVAL,
         "input_series": [{"series": f'up{{job="{job}"}}', "values": "1x20"}],
         "alert_rule_test": [expected.at("VllmNanCheckOff", "15m", ["ticket"])]},
    ]


def rule_tests(spec: ServedSpec, rules: dict[str, Any], rules_file: str) -> dict[str, Any]:
    """The test document for `rules` (written as `rules_file`, a path relative to the test file)."""
    job, found = job_name(spec), {slo.figure: slo for slo in slos(spec)}
    expected = Expected(rules, job)
    tests = _error_cases(job, found["error_rate"], expected)
    if "ttft_p95_s" in found:
        tests.append(_latency_case(job, found["ttft_p95_s"], expected))
    tests += _corruption_and_overload(job, spec.served_name, found["error_rate"].alert, expected)
    return {"rule_files": [rules_file], "evaluation_interval": EVALUATION_INTERVAL, "tests": tests}
