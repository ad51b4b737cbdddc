"""What a proposal costs, in the planner's own terms: predicted weight bytes, and the plan at the policy's fit.

The search prices every proposal before it is gated: pipelines.planner.predict_weight_bytes on the
proposal's recipe (the same formula `quantize plan` uses, checked byte for byte against llm-compressor
checkpoints), and, when the policy names a deployment, the planner's memory total there (weights + KV
cache at max_model_len x concurrency + activations + overhead). A proposal that cannot fit is not gated.
The KV cache does not change with weight schemes, so proposals are ordered by weight bytes.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pipelines.gate.policy import FitRequirement
from pipelines.planner import ModelShape, gpu_spec, linear_bytes, load_config, model_shape, plan, predict_weight_bytes
from pipelines.recipe import GroupScheme, Recipe
from pipelines.repair.units import Unit


class Price(BaseModel):
    model_config = ConfigDict(frozen=True)

    weight_bytes: int
    kv_cache_bytes: int | None = None
    total_bytes: int | None = None
    available_bytes: int | None = None
    fits: bool | None = None


def shape_of(model_dir: Path) -> ModelShape:
    return model_shape(*load_config(model_dir))


def unit_bytes(unit: Unit, scheme: GroupScheme | None) -> int:
    """The planner's bytes for this unit's weights under `scheme` (pipelines.planner.linear_bytes)."""
    return sum(linear_bytes(info.out_features, info.in_features, scheme) for info in unit.modules)


def recipe_bytes(shape: ModelShape, recipe: Recipe | None) -> int:
    """The planner's predicted weight bytes of the checkpoint `recipe` writes (None: the 16-bit model)."""
    return predict_weight_bytes(shape, recipe).total_bytes


def price(model_dir: Path, shape: ModelShape, recipe: Recipe, fit: FitRequirement | None) -> Price:
    """Weight bytes, and the plan's total at the policy's fit when there is one."""
    weights = recipe_bytes(shape, recipe)
    if fit is None:
        return Price(weight_bytes=weights)
    gpu = gpu_spec(fit.gpu, fit.memory_gib)
    row = plan(model_dir / "config.json", [recipe], gpu, fit.max_model_len, fit.concurrency).rows[0]
    return Price(weight_bytes=row.weights_bytes, kv_cache_bytes=row.kv_cache_bytes, total_bytes=row.total_bytes,
                 available_bytes=row.available_bytes, fits=row.fits)


class QuantizeCost(BaseModel):
    """The wall time of the quantize a proposal implies, estimated from what was measured: the rejected recipe's own
    quantize, the sensitivity pass's calibration forward and its GPTQ solves. Bytes decide between proposals first;
    this decides between proposals of equal bytes, and is reported beside each attempt's measured quantize time."""

    model_config = ConfigDict(frozen=True)

    seconds: float
    parts: dict[str, float] = Field(description="parent quantize, calibration pipeline (added), GPTQ solves added / removed")


# llm-compressor's sequential pipeline runs every calibration sample through each layer twice: calibrating, then
# propagating the layer's (quantized) output to the next.
PIPELINE_PASSES = 2


def quantize_cost(parent_s: float, parent_calibrates: bool, proposal_calibrates: bool, calibration_pass_s: float,
                  gptq_added_s: float, gptq_removed_s: float) -> QuantizeCost:
    parts = {
        "parent quantize": round(max(0.0, parent_s), 2),
        "calibration pipeline": round(PIPELINE_PASSES * calibration_pass_s if proposal_calibrates and not parent_calibrates else 0.0, 2),
        "GPTQ solves added": round(gptq_added_s, 2),
        "GPTQ solves removed": round(-gptq_removed_s, 2),
    }
    return QuantizeCost(seconds=round(max(0.0, sum(parts.values())), 2), parts=parts)
