"""The performance checks, whether they are enforced, and what they do to the gate's verdict.

Checks, at the deployment's concurrency (the top of the sweep):
- throughput_ratio: candidate / baseline output tokens per second >= min_throughput_ratio;
- ttft_p95_ratio: candidate / baseline p95 time to first token <= max_ttft_p95_ratio;
- slo_good_fraction: the candidate's share of requests meeting the SLO targets >= slo.min_good_fraction;
- errors: no request of the candidate failed.
A ratio is read on its whole 95% interval from the paired comparison (pipelines/loadtest/sequential.py): passed when
all of it meets the limit, failed when none of it does, inconclusive when the limit lies inside it. An inconclusive
check is never called passed.

Enforcement (`enforce`): `auto` enforces on a GPU (cuda) target and only reports on a CPU target; `always` (true) and
`never` (false) say so outright. Enforced, a failed check is a reason (the candidate is rejected, exit 1) and an
inconclusive one is an error (exit 2: the comparison's budget was too small to decide, and a speed requirement cannot
be waved through). Report-only, both are warnings and the verdict stands.
"""

from __future__ import annotations

from pipelines.errors import LoadTestError
from pipelines.loadtest.config import PerformancePolicy
from pipelines.loadtest.results import Check, LevelFigures, PerformanceReport, RatioInterval, SpeedComparison
from pipelines.loadtest.sequential import against_limit


def ratio_text(ratio: RatioInterval | None) -> str:
    if ratio is None:
        return "-"
    interval = f" [95% CI {ratio.low:.3f}, {ratio.high:.3f}]" if ratio.low is not None and ratio.high is not None else " (one pair, no interval)"
    return f"{ratio.estimate:.3f}{interval}"

_EPS = 1e-9


def enforcement(policy: PerformancePolicy, target: str) -> tuple[bool, str]:
    """(enforced, the sentence the report shows)."""
    if policy.enforce == "always":
        return True, f"enforced (performance.enforce: always; serve target {target})"
    if policy.enforce == "never":
        return False, f"report-only (performance.enforce: never; serve target {target})"
    if target.split(":")[0] == "cpu":
        return False, ("report-only (performance.enforce: auto on a CPU target; set performance.enforce: true where this host "
                       "class is the deployment)")
    return True, f"enforced (performance.enforce: auto on a GPU target, {target})"


def _ratio_check(name, label: str, interval: RatioInterval | None, limit: float, at_least: bool, at: str) -> Check | None:
    if interval is None:
        return None
    status = against_limit(interval, limit, at_least=at_least)
    shown = ratio_text(interval)
    sign = {"passed": ">=" if at_least else "<=", "failed": "<" if at_least else ">"}.get(status, "undecided against")
    limit_name = "min_throughput_ratio" if at_least else "max_ttft_p95_ratio"
    return Check(name=name, value=interval.estimate, limit=limit, status=status,
                 text=f"{label} {shown} {at} {sign} {limit_name} {limit:g}"
                      + ("" if status != "inconclusive" else f" (the interval holds the limit after {interval.pairs} pairs)"))


def checks(policy: PerformancePolicy, concurrency: int, candidate: LevelFigures | None, speed: SpeedComparison | None) -> list[Check]:
    """The checks that apply at `concurrency`."""
    found: list[Check | None] = []
    at = f"at concurrency {concurrency}"
    if speed is not None and policy.min_throughput_ratio is not None:
        found.append(_ratio_check("throughput_ratio", "output throughput ratio", speed.throughput.interval, policy.min_throughput_ratio, True, at))
    if speed is not None and policy.max_ttft_p95_ratio is not None:
        found.append(_ratio_check("ttft_p95_ratio", "TTFT p95 ratio", speed.ttft_p95.interval, policy.max_ttft_p95_ratio, False, at))
    if candidate is not None and candidate.good_fraction is not None:
        value, limit = candidate.good_fraction, policy.slo.min_good_fraction
        passed = value + _EPS >= limit
        targets = ", ".join(pair.replace(":", " <= ") + " ms" for pair in policy.slo.goodput_arguments)
        found.append(Check(name="slo_good_fraction", value=value, limit=limit, status="passed" if passed else "failed",
                           text=f"{value:.1%} of requests met the SLO ({targets}) {at} {'>=' if passed else '<'} min_good_fraction {limit:g}"))
    if candidate is not None:
        found.append(Check(name="errors", value=candidate.failed, limit=0, status="passed" if candidate.failed == 0 else "failed",
                           text=f"{candidate.failed} of {candidate.requests} requests failed {at}"))
    return [check for check in found if check is not None]


def outcome(found: list[Check], enforced: bool, target: str) -> tuple[list[str], list[str]]:
    """(reasons, warnings): failed checks are reasons when enforced, warnings otherwise; inconclusive ones are warnings
    here (enforced, `inconclusive_error` turns them into an error after the evidence is written)."""
    failed = [check.text for check in found if check.status == "failed"]
    undecided = [f"performance inconclusive: {check.text}" for check in found if check.status == "inconclusive"]
    if enforced:
        return [f"performance: {text}" for text in failed], undecided
    return [], [*(f"performance (report-only on {target}): {text}" for text in failed), *undecided]


def inconclusive_error(report: PerformanceReport) -> LoadTestError | None:
    """Under an enforced policy, a ratio check the comparison could not decide is an error naming the budget to raise."""
    undecided = [check for check in report.checks if check.status == "inconclusive"]
    if not report.enforced or not undecided or report.comparison is None:
        return None
    spent = report.comparison
    return LoadTestError(
        f"the enforced performance check is inconclusive: {undecided[0].text}; the paired comparison ran {len(spent.pairs)} pairs in "
        f"{spent.seconds:.0f} s (stopped: {spent.stopped}); raise performance.comparison.budget_s (now {spent.settings.budget_s:g} s)"
        " or max_pairs, or lower the load's noise", field="performance.comparison.budget_s")


def apply_to_gate(gate, reasons: list[str], warnings: list[str]):
    """The quality gate's result with the performance reasons and warnings added; rejected if any reason."""
    if not reasons and not warnings:
        return gate
    return gate.model_copy(update={
        "verdict": "rejected" if reasons or gate.verdict == "rejected" else gate.verdict,
        "reasons": [*gate.reasons, *reasons],
        "warnings": [*gate.warnings, *warnings],
    })
