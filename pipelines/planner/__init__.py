"""The memory planner: does a model, in 16-bit or quantized by a recipe, fit a GPU at a given context
length and concurrency, and how fast can one stream decode there?

Planning needs only config.json; weight bytes are measured exactly from safetensors headers when the
model's files are at hand. One module per job: gpus (the GPU table), shape (config.json -> ModelShape),
weights (predicted and measured weight bytes), kv (KV cache maths), roofline (the predicted decode speed), plan (the
search, rows and vLLM arguments). The formulas, their assumptions and their knobs are in docs/planner.md.
"""

from pipelines.planner.gpus import MAX_GPU_PEAK_TFLOPS, TERA, GiB, GpuSpec, gpu_spec, known_gpus
from pipelines.planner.kv import (
    KV_CACHE_DTYPES,
    kv_cache_bytes_for_context,
    kv_cache_bytes_per_token,
    kv_capacity_tokens,
    kv_element_bytes,
)
from pipelines.planner.plan import (
    MAX_BATCHED_TOKENS,
    MAX_OVERHEAD_GIB,
    Plan,
    PlanRow,
    PlanSettings,
    RecommendedArgs,
    activation_bytes,
    gpu_target,
    plan,
    recipe_problem,
)
from pipelines.planner.roofline import PREDICTED, Roofline, RooflinePoint, StepCost, roofline, roofline_point, step_cost
from pipelines.planner.shape import ModelShape, load_config, model_shape
from pipelines.planner.weights import (
    WeightBreakdown,
    linear_bytes,
    linear_schemes,
    predict_weight_bytes,
    safetensors_bytes,
    shape_layout,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "MAX_BATCHED_TOKENS",
    "MAX_GPU_PEAK_TFLOPS",
    "MAX_OVERHEAD_GIB",
    "PREDICTED",
    "TERA",
    "GiB",
    "GpuSpec",
    "ModelShape",
    "Plan",
    "PlanRow",
    "PlanSettings",
    "RecommendedArgs",
    "Roofline",
    "RooflinePoint",
    "StepCost",
    "WeightBreakdown",
    "activation_bytes",
    "gpu_spec",
    "gpu_target",
    "known_gpus",
    "kv_cache_bytes_for_context",
    "kv_cache_bytes_per_token",
    "kv_capacity_tokens",
    "kv_element_bytes",
    "linear_bytes",
    "linear_schemes",
    "load_config",
    "model_shape",
    "plan",
    "predict_weight_bytes",
    "recipe_problem",
    "roofline",
    "roofline_point",
    "safetensors_bytes",
    "shape_layout",
    "step_cost",
]
