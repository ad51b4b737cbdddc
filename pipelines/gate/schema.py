"""gate.json, the gate's report: its schema (GateReport and what it holds), written and read back.

    save_report(report, path)   writes it atomically
    read_report(path)           the typed report and its JSON object as written (what the registry keeps and hashes)
    load_report(path)           the typed report alone (to render it, register it, repair from it)

A file that is not a gate report (missing, larger than MAX_REPORT_BYTES, not a JSON object, not the schema) is
refused as an InputError naming it. The rules that fill a report are pipelines.gate.verdict's (decide); its
rendering is pipelines.gate.report's. The file format is in docs/gate-json.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from pipelines.bounds import MiB
from pipelines.errors import EXIT_OK, EXIT_REJECTED, InputError, from_validation_error
from pipelines.files.atomic import write_text_atomic
from pipelines.files.jsonio import read_json_object
from pipelines.gate import stats
from pipelines.gate.policy import SetPolicy
from pipelines.loadtest.results import PerformanceReport
from pipelines.schema import StrictModel

SCHEMA_VERSION: Literal[2] = 2
MAX_REPORT_BYTES = 64 * MiB  # a gate.json is kilobytes (megabytes with thousands of sets)


class FitCheck(StrictModel):
    """The planner's answer to the policy's fit requirement."""

    fits: bool
    required_bytes: int = Field(ge=0)
    available_bytes: int = Field(ge=0)
    gpu: str


class StatsSettings(StrictModel):
    confidence: float = stats.CONFIDENCE
    bootstrap_resamples: int = stats.RESAMPLES
    seed: int = stats.SEED
    alpha: float = stats.ALPHA
    power: float = stats.POWER


# Older gate.json files name what the sets got then: "tango-score" (Tango's bound at z(c)), "tango-score-scaled-floored"
# and "bca-bootstrap-floored" (averaged metrics), "percentile-bootstrap-floored" (corpus metrics without the allowance).
IntervalMethod = Literal[
    "tango-score-calibrated", "betting", "percentile-bootstrap-clipped-betting", "percentile-bootstrap-rare-damage",
    "tango-score", "tango-score-scaled-floored", "bca-bootstrap-floored", "percentile-bootstrap-floored",
]


class NoiseFloor(StrictModel):
    """The runtime against itself on one set: the 16-bit baseline scored twice (pipelines.gate.noise)."""

    n: int
    flips: int = Field(description="items whose value differs between the two baseline passes (both directions)")
    right_to_wrong: int | None = Field(description="pass/fail: right in the first pass, wrong in the second")
    wrong_to_right: int | None
    rate: float = Field(description="flips / n")
    rate_low: float = Field(description="exact (Clopper-Pearson) two-sided interval of the rate at interval_confidence")
    rate_high: float
    interval_confidence: float
    floor: float | None = Field(description="the rate in the set's unit (points) for metrics in points: tolerances under it are refused")
    unstable_items: list[str] = Field(description="ids of the items that flipped between the passes")
    reference: Literal["mean of both passes", "first pass"] = Field(description="what the candidate was compared with")
    candidate_flips: int | None = Field(description="items where the candidate differs from the first pass")
    candidate_flips_on_unstable: int | None = Field(description="of those, items the runtime flipped against itself")


class SetVerdict(StrictModel):
    """One eval set, judged. Scores, deltas, CI bounds and min_detectable_drop are in `unit`s.

    `delta` is candidate - baseline as measured; `worsening` is the same difference signed so that
    positive is worse (-delta when higher is better, delta when lower is better): the rules read it.
    """

    eval_set: str
    metric: str
    higher_is_better: bool
    aggregation: str
    kind: Literal["binary", "continuous", "corpus"]
    unit: str
    binary: bool
    n: int
    baseline_score: float
    candidate_score: float
    delta: float
    worsening: float
    ci_low: float
    ci_high: float
    interval_method: IntervalMethod
    mcnemar_p: float | None
    flips_right_to_wrong: int | None
    flips_wrong_to_right: int | None
    flip_rate: float | None = Field(description="fraction of items that went right->wrong")
    flip_rate_lower_bound: float | None = Field(description="one-sided Clopper-Pearson lower bound of flip_rate at the rules' confidence")
    kl_mean: float | None
    kl_max: float | None
    kl_items: int
    kl_method: str | None
    min_detectable_drop: float
    rules: SetPolicy
    warnings: list[str]
    reasons: list[str]
    passed: bool
    # What the tolerance rules read, and the set's size against them (added in place: optional, null in older files).
    bound_confidence: float | None = Field(default=None, description="one-sided confidence of worsening_bound")
    worsening_bound: float | None = Field(default=None, description="one-sided upper confidence bound of the worsening, in unit")
    relative_worsening_bound: float | None = Field(default=None, description="worsening_bound / |baseline_score| (null at a 0 baseline)")
    tolerance: float | None = Field(default=None, description="the tightest tolerance in force, in unit (null: no bound rule)")
    min_certifiable_tolerance: float | None = Field(
        default=None, description="smallest tolerance, in unit, an unchanged candidate at this set's discordance passes with power 0.8",
    )
    items_needed: int | None = Field(default=None, description="items for `tolerance` at this set's discordance, power 0.8")
    unchanged_reject_probability: float | None = Field(
        default=None, description="P(this set rejects an unchanged candidate at its observed discordance), KL not counted",
    )
    noise_floor: NoiseFloor | None = Field(default=None, description="the baseline scored twice; null when the policy's noise_floor is off")
    concentrated_bound: float | None = Field(
        default=None, description="corpus sets: one-sided bound of the mean worsening with each item's contribution clipped, a share "
                                  "of the tolerance (passes at most 0.5; pipelines.gate.concentrated); null where no tolerance applies",
    )
    concentrated_clip: float | None = Field(
        default=None, description="the clip level of concentrated_bound, a share of the tolerance: 1 / (2 damage_share)",
    )

    @property
    def worst_bound(self) -> float:
        """The 95% CI bound on the bad side, as a worsening (positive = worse)."""
        return -self.ci_low if self.higher_is_better else self.ci_high


class GateResult(StrictModel):
    """The decision. `reasons` (why rejected) and `warnings` collect those of every set plus the fit."""

    schema_version: Literal[2] = SCHEMA_VERSION
    recipe: str
    verdict: Literal["promoted", "rejected"]
    sets: list[SetVerdict]
    fit: FitCheck | None
    reasons: list[str]
    warnings: list[str]
    settings: StatsSettings
    # P(at least one set rejects an unchanged candidate at the observed discordances), sets independent; null in older files.
    unchanged_reject_probability: float | None = None

    @property
    def exit_code(self) -> int:
        """0 promoted, 1 rejected: the CLI's contract."""
        return EXIT_OK if self.verdict == "promoted" else EXIT_REJECTED


class GateReport(StrictModel):
    """gate.json: the decision plus what it was made from (hashes), how long each stage took, the plan."""

    schema_version: Literal[2] = SCHEMA_VERSION
    created_at: str | None = None
    inputs: dict[str, Any] = Field(default_factory=dict, description="model, artifact, recipe, policy, eval_sets: paths and hashes")
    stages: dict[str, float] = Field(default_factory=dict, description="wall seconds per stage, in run order")
    plan: dict[str, Any] | None = None
    gate: GateResult
    # The load test's figures and checks (docs/loadtest.md); null when it did not run. Optional: schema 2 still.
    performance: PerformanceReport | None = None

    @property
    def manifest_sha256(self) -> str | None:
        """The manifest.json sha256 of the artifact judged (the runner writes inputs.artifact.manifest_sha256)."""
        artifact = self.inputs.get("artifact")
        value = artifact.get("manifest_sha256") if isinstance(artifact, dict) else None
        return value if isinstance(value, str) else None


def save_report(report: GateReport, path: Path) -> None:
    write_text_atomic(path, report.model_dump_json(indent=2) + "\n")


def read_report(path: Path) -> tuple[GateReport, dict[str, Any]]:
    """A gate.json, typed, and its JSON object as written (what the registry keeps and hashes); a bad file
    raises InputError naming it."""
    if not path.is_file():
        raise InputError("no such gate report", file=path, field="report")
    data = read_json_object(path, what="gate report", max_bytes=MAX_REPORT_BYTES)[0]
    try:
        return GateReport.model_validate(data), data
    except ValidationError as error:
        raise from_validation_error(error, path) from None


def load_report(path: Path) -> GateReport:
    """Read a gate.json back (to render it, register it, repair from it); a bad file raises InputError naming it."""
    return read_report(path)[0]
