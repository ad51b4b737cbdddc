"""The GPUs the planner knows by name (pipelines/data/gpus.yaml), or one given by its size."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import Field, ValidationError

from pipelines.bounds import MAX_GPU_BANDWIDTH_GBS, MAX_GPU_MEMORY_GIB, GiB
from pipelines.errors import InputError, from_validation_error
from pipelines.hardware.kernel_choice import ComputeDtype
from pipelines.schema import StrictModel

GPU_TABLE = Path(__file__).resolve().parent.parent / "data" / "gpus.yaml"
TERA = 1e12
MAX_GPU_PEAK_TFLOPS = 10**6  # an exaflop on one device
_Rate = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class GpuSpec(StrictModel):
    name: str
    memory_bytes: int = Field(gt=0)
    bandwidth_bytes_per_s: int | None = Field(default=None, gt=0)
    compute_capability: str | None = Field(
        default=None, pattern=r"^\d{1,2}\.\d$", description="CUDA compute capability (the serve target's kernel rules)",
    )
    peak_flops_per_s: dict[ComputeDtype, _Rate] = Field(
        default_factory=dict, description="peak dense operations per second by compute dtype (data sheet, or measured on a host)",
    )


class _GpuEntry(StrictModel):
    memory_gib: float = Field(gt=0)
    bandwidth_gbs: float = Field(gt=0)
    compute_capability: str | None = Field(default=None, pattern=r"^\d{1,2}\.\d$")
    peak_tflops: dict[ComputeDtype, _Rate] = Field(default_factory=dict)
    aliases: list[str] = Field(default_factory=list)


class _GpuTable(StrictModel):
    gpus: dict[str, _GpuEntry]


def _normalized(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


@lru_cache(maxsize=1)
def _gpu_table() -> tuple[dict[str, GpuSpec], dict[str, str]]:
    """The shipped GPU table: specs by canonical name, and canonical names by normalized name or alias."""
    try:
        table = _GpuTable.model_validate(yaml.safe_load(GPU_TABLE.read_text()))
    except ValidationError as error:
        raise from_validation_error(error, GPU_TABLE) from None
    specs = {
        name: GpuSpec(
            name=name, memory_bytes=int(e.memory_gib * GiB), bandwidth_bytes_per_s=int(e.bandwidth_gbs * 1e9),
            compute_capability=e.compute_capability,
            peak_flops_per_s={dtype: tflops * TERA for dtype, tflops in e.peak_tflops.items()},
        )
        for name, e in table.gpus.items()
    }
    aliases = {_normalized(alias): name for name, e in table.gpus.items() for alias in (name, *e.aliases)}
    return specs, aliases


def known_gpus() -> dict[str, GpuSpec]:
    """The GPUs in pipelines/data/gpus.yaml, by canonical name."""
    return _gpu_table()[0]


def gpu_spec(
    name: str | None = None, memory_gib: float | None = None, bandwidth_gbs: float | None = None, peak_tflops: float | None = None,
) -> GpuSpec:
    """A GPU by table name, or by size (and bandwidth, and 16-bit peak TFLOPS); a bandwidth or a peak given with a name
    overrides the table's."""
    if (name is None) == (memory_gib is None):
        raise InputError("give a GPU name or a memory size (not both)", field="gpu")
    for field, value, most in (
        ("gpu_memory_gib", memory_gib, MAX_GPU_MEMORY_GIB), ("gpu_bandwidth_gbs", bandwidth_gbs, MAX_GPU_BANDWIDTH_GBS),
        ("gpu_peak_tflops", peak_tflops, MAX_GPU_PEAK_TFLOPS),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= most)):
            raise InputError(f"must be a positive number of at most {most:g} (got {value})", field=field)
    if name is not None and not isinstance(name, str):
        raise InputError(f"a GPU name is text (got {name!r})", field="gpu")
    bandwidth = int(bandwidth_gbs * 1e9) if bandwidth_gbs is not None else None
    if name is None:
        assert memory_gib is not None  # exactly one of the two is given
        spec = GpuSpec(name=f"{memory_gib:g} GiB", memory_bytes=int(memory_gib * GiB), bandwidth_bytes_per_s=bandwidth)
    else:
        canonical = _gpu_table()[1].get(_normalized(name))
        if canonical is None:
            raise InputError(f"unknown GPU {name!r} (known: {', '.join(known_gpus())}; or give --gpu-memory-gib)", field="gpu")
        spec = known_gpus()[canonical]
        spec = spec.model_copy(update={"bandwidth_bytes_per_s": bandwidth}) if bandwidth else spec
    if peak_tflops is None:
        return spec
    return spec.model_copy(update={"peak_flops_per_s": {**spec.peak_flops_per_s, "bf16": peak_tflops * TERA}})
