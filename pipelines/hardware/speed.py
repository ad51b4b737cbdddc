"""What the kernel probe says about a whole artifact's speed here, and the scoring time it implies.

An artifact's schemes are read from its config.json (`quantization_config.config_groups`, as vLLM reads them); its
probed slowdown is the largest among them (pipelines/hardware/kernels.py `KernelFact.slowdown`). A slow artifact's
candidate scoring time is estimated from the 16-bit baseline's measured pace on the same sets (seconds per item,
cached with its scores) times that slowdown: an upper bound, since one Linear's ratio bounds the model's.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ValidationError

from pipelines.console.progress import duration
from pipelines.hardware.host import HostProfile
from pipelines.hardware.kernels import SLOW_RATIO, KernelCase, kernel_facts
from pipelines.recipe import ActivationScheme, WeightScheme

_MAX_CONFIG_BYTES = 4 * 1024 * 1024


class ProbedSpeed(BaseModel):
    """The probe's verdict on an artifact (or recipe) here."""

    host_class: str
    slowest: str | None  # the slowest scheme's key
    slowdown: float | None  # its geometric-mean ratio against 16-bit; None: nothing quantized or not timed
    decode_ratio: float | None = None
    prefill_ratio: float | None = None

    @property
    def slow(self) -> bool:
        return self.slowdown is not None and self.slowdown >= SLOW_RATIO


def probed_speed(profile: HostProfile, cases: list[KernelCase]) -> ProbedSpeed:
    """The slowest of `cases` on this host, by the probe (served cases only)."""
    facts = kernel_facts(profile, cases)
    timed = [facts[case.key] for case in cases if case.key in facts and facts[case.key].slowdown is not None]
    if not timed:
        return ProbedSpeed(host_class=profile.host_class, slowest=None, slowdown=None)
    worst = max(timed, key=lambda fact: fact.slowdown or 0.0)
    return ProbedSpeed(host_class=profile.host_class, slowest=worst.key, slowdown=worst.slowdown,
                       decode_ratio=worst.decode_ratio, prefill_ratio=worst.prefill_ratio)


def read_quantization_config(config_path: Path) -> dict:
    """A checkpoint's `quantization_config` from its config.json ({} when it has none or the file cannot be read)."""
    try:
        if config_path.stat().st_size > _MAX_CONFIG_BYTES:
            return {}
        quantization = json.loads(config_path.read_text()).get("quantization_config", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return quantization if isinstance(quantization, dict) else {}


def artifact_cases(config_path: Path) -> list[KernelCase]:
    """The schemes of a compressed-tensors checkpoint, from its config.json; [] when it holds none we can name
    (a 16-bit model, another format)."""
    groups = read_quantization_config(config_path).get("config_groups", {})
    cases = []
    for group in groups.values() if isinstance(groups, dict) else []:
        case = group_case(group)
        if case is not None and case not in cases:
            cases.append(case)
    return cases


def group_case(group: object) -> KernelCase | None:
    """One compressed-tensors config group's scheme as a kernel case (None: not one our vocabulary names)."""
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        return None
    weights, activations = group["weights"], group.get("input_activations")
    try:
        return KernelCase(
            weights=WeightScheme(bits=weights.get("num_bits"), type=weights.get("type", "int"), granularity=weights.get("strategy"),
                                 group_size=weights.get("group_size") if weights.get("strategy") == "group" else None,
                                 block=weights.get("block_structure") if weights.get("strategy") == "block" else None,
                                 symmetric=weights.get("symmetric", True)),
            activations=None if not isinstance(activations, dict) else ActivationScheme(
                bits=activations.get("num_bits"), type=activations.get("type", "int"), granularity=activations.get("strategy"),
                group_size=activations.get("group_size") if activations.get("strategy") == "group" else None,
                dynamic=activations.get("dynamic", True), symmetric=activations.get("symmetric", True)),
        )
    except (ValidationError, TypeError):
        return None  # a scheme our vocabulary has no words for: the probe cannot time it


class ScoringEstimate(BaseModel):
    """The candidate's scoring time, estimated before it is scored: the baseline's measured time on the same sets
    times the probed slowdown."""

    host_class: str
    items: int
    baseline_seconds: float
    slowdown: float
    seconds: float

    def line(self) -> str:
        return (f"slow kernels here: candidate scoring may take up to {duration(self.seconds)} (the 16-bit baseline scored these "
                f"{self.items:,} items in {duration(self.baseline_seconds)}, x probed slowdown {self.slowdown:.1f} on {self.host_class}; "
                "an upper bound: the probe times one Linear layer, the model also spends time outside them)")


def estimate_scoring(items: int, baseline_seconds: float, speed: ProbedSpeed) -> ScoringEstimate | None:
    """None unless the probe calls the artifact slow here."""
    if not speed.slow or speed.slowdown is None:
        return None
    return ScoringEstimate(host_class=speed.host_class, items=items, baseline_seconds=baseline_seconds, slowdown=speed.slowdown,
                           seconds=baseline_seconds * speed.slowdown)
