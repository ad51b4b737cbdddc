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

from pipelines.deploy.promql import duration, job_name
from pipelines.deploy.slo import BURN_SUFFIX, Slo, slos
from pipelines.deploy.spec import ServedSpec
from pipelines.serve.vllm_series import ADMISSION_REJECTIONS, CORRUPTED_REQUESTS, HTTP_REQUESTS, REQUEST_SUCCESS

PER_MINUTE = 1000  # requests a minute in every case
DAY_MIN = 1440
# Rules are evaluated every 5 min over series sampled every minute (a 5-minute window needs two samples): evaluating every minute
# made the day-long cases 5x slower (13 to 33 s each on 2 loaded cores). Every eval_time below is a multiple of it.
EVALUATION_S, SAMPLE_INTERVAL = 300, "1m"
Segments = Sequence[tuple[int, float]]  # (samples, increase per sample), in order; one sample a minute but where a case says


def counter(segments: Segments) -> str:
    """A counter in promtool's expanding notation from 0: `a+bxn` is a, a+b, ..., a+n*b."""
    parts, value = ["0"], 0.0
    for minutes, step in segments:
        parts.append(f"{value + step:g}+{step:g}x{minutes - 1}")
        value += step * minutes
    return " ".join(parts)


def _engine(job: str, failing: Segments) -> list[dict[str, str]]:
    """The engine's finished requests: `failing` gives the failures a minute, the rest of PER_MINUTE finish with `stop`."""
    ok = [(minutes, PER_MINUTE - bad) for minutes, bad in failing]
    return [{"series": f'{REQUEST_SUCCESS}{{job="{job}",finished_reason="stop"}}', "values": counter(ok)},
            {"series": f'{REQUEST_SUCCESS}{{job="{job}",finished_reason="error"}}', "values": counter(failing)}]


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
        case("must fire: fast burn (every request fails for 12 min after a healthy day)",
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


def _corruption_and_overload(job: str, served_name: str, error_alert: str, expected: Expected, window_s: int,
                             alert_for_s: int) -> list[dict[str, Any]]:
    """Cases timed by the rules' window and `for`: sampled four times a window (at most a minute apart), each change placed just
    before an evaluation so that any window of two samples or more sees it."""
    step = max(1, min(60, window_s // 4))
    per_sample = PER_MINUTE * step / 60
    corrupted_at = 2 * EVALUATION_S
    rejected_from = EVALUATION_S
    overloaded_at = _tick_after(rejected_from + 2 * step) + _tick_after(alert_for_s) + EVALUATION_S
    unchecked_at = _tick_after(window_s) + 2 * EVALUATION_S
    rejected: Segments = [(rejected_from // step, 0), ((overloaded_at - rejected_from) // step, per_sample / 10)]
    answered: Segments = [(overloaded_at // step, per_sample)]
    http, engine = f'job="{job}",handler="/v1/completions"', f'engine="0",model_name="{served_name}"'

    def case(name: str, series: list[dict[str, str]], checks: list[dict[str, Any]]) -> dict[str, Any]:
        return {"name": name, "interval": f"{step}s", "input_series": series, "alert_rule_test": checks}

    return [
        case("must fire: one corrupted request (NaN logits)",
             [{"series": f'{CORRUPTED_REQUESTS}{{job="{job}",{engine}}}', "values": f"0x{corrupted_at // step - 2} 1x2"},
              {"series": f'up{{job="{job}"}}', "values": f"1x{corrupted_at // step + 1}"}],
             [expected.at("VllmCorruptedRequests", duration(EVALUATION_S), []),
              expected.at("VllmCorruptedRequests", duration(corrupted_at), ["page"]),
              expected.at("VllmNanCheckOff", duration(corrupted_at), [])]),
        case("must fire: the overload ticket; must not fire: the error SLO's alerts on overload alone (503s that are rejections)",
             [{"series": f'{REQUEST_SUCCESS}{{job="{job}",finished_reason="stop"}}', "values": counter(answered)},
              {"series": f'{ADMISSION_REJECTIONS}{{job="{job}",model_name="{served_name}",reason="max_num_queued_reqs"}}',
               "values": counter(rejected)},
              {"series": f'{HTTP_REQUESTS}{{{http},status="2xx"}}', "values": counter(answered)},
              {"series": f'{HTTP_REQUESTS}{{{http},status="5xx"}}', "values": counter(rejected)}],
             [expected.at("VllmOverloaded", duration(overloaded_at), ["ticket"]), expected.at(error_alert, duration(overloaded_at), [])]),
        case("must fire: a server scraped without the NaN check (no corrupted-requests series)",
             [{"series": f'up{{job="{job}"}}', "values": f"1x{unchecked_at // step}"}],
             [expected.at("VllmNanCheckOff", duration(unchecked_at), ["ticket"])]),
    ]


def _tick_after(seconds: int) -> int:
    """The first evaluation at or after `seconds`."""
    return -(-seconds // EVALUATION_S) * EVALUATION_S


def rule_tests(spec: ServedSpec, rules: dict[str, Any], rules_file: str, *, window_s: int, alert_for_s: int) -> dict[str, Any]:
    """The test document for `rules` (written as `rules_file`, a path relative to the test file), whose window and `for` are
    `window_s` and `alert_for_s`."""
    job, found = job_name(spec), {slo.figure: slo for slo in slos(spec)}
    expected = Expected(rules, job)
    tests = _error_cases(job, found["error_rate"], expected)
    if "ttft_p95_s" in found:
        tests.append(_latency_case(job, found["ttft_p95_s"], expected))
    tests += _corruption_and_overload(job, spec.served_name, found["error_rate"].alert, expected, window_s, alert_for_s)
    return {"rule_files": [rules_file], "evaluation_interval": duration(EVALUATION_S), "tests": tests}
