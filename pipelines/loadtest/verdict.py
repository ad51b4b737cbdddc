"""The performance checks, whether they are enforced, and what they do to the gate's verdict.

Checks, at the deployment's concurrency (the top of the sweep):
- throughput_ratio: candidate / baseline output tokens per second >= min_throughput_ratio;
- ttft_p95_ratio: candidate / baseline p95 time to first token <= max_ttft_p95_ratio;
- slo_good_fraction: the candidate's share of requests meeting the SLO targets >= slo.min_good_fraction;
- errors: no request of the candidate failed.
A ratio is judged by its estimate (the geometric mean of the paired runs); when its 95% interval reaches the
other side of the limit, a warning says the result is not conclusive.

Enforcement (`enforce`): `auto` enforces on a GPU (cuda) target and only reports on a CPU target, where speed
says little about the GPU the model will serve on; `always` and `never` say so outright. Enforced, a failed
check is a reason: the candidate is rejected (exit 1). Report-only, it is a warning and the verdict stands.
"""

from __future__ import annotations

from pipelines.loadtest.config import PerformancePolicy
from pipelines.loadtest.results import Check, LevelFigures, LevelRatio

_EPS = 1e-9


def enforcement(policy: PerformancePolicy, target: str) -> tuple[bool, str]:
    """(enforced, the sentence the report shows)."""
    if policy.enforce == "always":
        return True, f"enforced (performance.enforce: always; serve target {target})"
    if policy.enforce == "never":
        return False, f"report-only (performance.enforce: never; serve target {target})"
    if target.split(":")[0] == "cpu":
        return False, "report-only (performance.enforce: auto on a CPU target: CPU speed says little about a GPU deployment)"
    return True, f"enforced (performance.enforce: auto on a GPU target, {target})"


def _interval_note(name: str, ratio, limit: float, low_is_bad: bool) -> str | None:
    if ratio.low is None or ratio.high is None:
        return None
    if ratio.low - _EPS <= limit <= ratio.high + _EPS:
        side = "below" if low_is_bad else "above"
        return (f"performance: {name} {ratio.estimate:.3f} [95% CI {ratio.low:.3f}, {ratio.high:.3f}] may lie {side} the limit "
                f"{limit:g}: not conclusive with {ratio.pairs} paired runs")
    return None


def checks(
    policy: PerformancePolicy, concurrency: int, candidate: LevelFigures | None, ratio: LevelRatio | None,
) -> tuple[list[Check], list[str]]:
    """The checks that apply at `concurrency`, and notes on inconclusive ratios."""
    found: list[Check] = []
    notes: list[str | None] = []
    at = f"at concurrency {concurrency}"
    if ratio is not None and ratio.throughput is not None and policy.min_throughput_ratio is not None:
        value, limit = ratio.throughput.estimate, policy.min_throughput_ratio
        found.append(Check(name="throughput_ratio", value=value, limit=limit, passed=value + _EPS >= limit,
                           text=f"output throughput ratio {value:.3f} {at} {'>=' if value + _EPS >= limit else '<'} min_throughput_ratio {limit:g}"))
        notes.append(_interval_note("throughput ratio", ratio.throughput, limit, low_is_bad=True))
    if ratio is not None and ratio.ttft_p95 is not None and policy.max_ttft_p95_ratio is not None:
        value, limit = ratio.ttft_p95.estimate, policy.max_ttft_p95_ratio
        found.append(Check(name="ttft_p95_ratio", value=value, limit=limit, passed=value <= limit + _EPS,
                           text=f"TTFT p95 ratio {value:.3f} {at} {'<=' if value <= limit + _EPS else '>'} max_ttft_p95_ratio {limit:g}"))
        notes.append(_interval_note("TTFT p95 ratio", ratio.ttft_p95, limit, low_is_bad=False))
    if candidate is not None and candidate.good_fraction is not None:
        value, limit = candidate.good_fraction, policy.slo.min_good_fraction
        passed = value + _EPS >= limit
        targets = ", ".join(pair.replace(":", " <= ") + " ms" for pair in policy.slo.goodput_arguments)
        found.append(Check(name="slo_good_fraction", value=value, limit=limit, passed=passed,
                           text=f"{value:.1%} of requests met the SLO ({targets}) {at} {'>=' if passed else '<'} min_good_fraction {limit:g}"))
    if candidate is not None:
        found.append(Check(name="errors", value=candidate.failed, limit=0, passed=candidate.failed == 0,
                           text=f"{candidate.failed} of {candidate.requests} requests failed {at}"))
    return found, [note for note in notes if note]


def outcome(found: list[Check], enforced: bool, target: str) -> tuple[list[str], list[str]]:
    """(reasons, warnings): failed checks are reasons when enforced, warnings otherwise."""
    failed = [check.text for check in found if not check.passed]
    if enforced:
        return [f"performance: {text}" for text in failed], []
    return [], [f"performance (report-only on {target}): {text}" for text in failed]


def apply_to_gate(gate, reasons: list[str], warnings: list[str]):
    """The quality gate's result with the performance reasons and warnings added; rejected if any reason."""
    if not reasons and not warnings:
        return gate
    return gate.model_copy(update={
        "verdict": "rejected" if reasons or gate.verdict == "rejected" else gate.verdict,
        "reasons": [*gate.reasons, *reasons],
        "warnings": [*gate.warnings, *warnings],
    })
