"""What the product knows of each quantize backend before running it (the package docstring says what each is)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from pipelines.recipe import DEFAULT_BACKEND, Backend
from pipelines.schema import StrictModel


@dataclass(frozen=True)
class BackendSpec:
    """What the product knows of a backend before running it."""

    name: Backend
    package: str  # the distribution whose version the manifest records
    checkpoint_format: str  # what it writes
    quant_method: str  # vLLM's quantization method for that format
    environment: str | None  # scripts/setup_env.sh's name for its environment; None: .venv, in-process


BACKENDS: dict[str, BackendSpec] = {
    "llm-compressor": BackendSpec("llm-compressor", "llmcompressor", "compressed-tensors", "compressed-tensors", None),
    "gptqmodel": BackendSpec("gptqmodel", "gptqmodel", "gptq", "gptq", "gptqmodel"),
    "bitsandbytes": BackendSpec("bitsandbytes", "bitsandbytes", "bitsandbytes", "bitsandbytes", "bitsandbytes"),
}
DEFAULT = BACKENDS[DEFAULT_BACKEND]


class BackendPlan(StrictModel):
    """A recipe compiled for a subprocess backend: the arguments its tool takes, and what the compilation decided."""

    backend: str
    config: dict[str, Any]
    notes: list[str] = Field(default=[], description="recipe settings the backend applies differently, in words")
