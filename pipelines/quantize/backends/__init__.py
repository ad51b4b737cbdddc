"""Quantize backends: the toolkit that turns a recipe into a vLLM-servable artifact (docs/backends.md).

- `llm-compressor` (the default): in .venv, in-process (pipelines.quantize.oneshot), compressed-tensors checkpoints.
- `gptqmodel`: GPTQModel, the maintained successor of the archived AutoGPTQ; GPTQ checkpoints (vLLM's `gptq` method).
- `bitsandbytes`: bitsandbytes through transformers; LLM.int8 and NF4 checkpoints (vLLM's `bitsandbytes` method).

Every backend but the default runs in an environment of its own (scripts/setup_env.sh NAME, pinned and locked like
the others, built on first use), as a subprocess of backend_tool.py: its pins conflict with .venv's (GPTQModel needs
torch >= 2.14.1 and transformers >= 5.20.2) and it is never imported into .venv. Each backend compiles the recipe's
layer-wise schemes (the plan pipelines.quantize.compiler resolved and checked against vLLM's kernels) into its own
configuration, or refuses the first field it cannot express, in one line, before any model is loaded.
"""

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
