"""Whether vLLM serves a backend's checkpoint format on the serve target, asked before any heavy work.

On this machine the kernel probe asks vLLM itself (pipelines.hardware.formats: its quantization method registry, the
platform's own check, then a Linear built and loaded through that method); on another target the written rules
decide. The question is asked with the backend's typical configuration on one of the model's own Linear shapes: the
method-level refusal (bitsandbytes on vLLM's CPU build) does not depend on it, and the per-scheme kernel rules
(4-bit weight-only on cpu:avx2, group sizes) are checked by the compiler on the recipe's own schemes.
"""

from __future__ import annotations

from pipelines.errors import InputError
from pipelines.hardware.formats import format_problem
from pipelines.hardware.targets import ServeTarget
from pipelines.quantize.backends.specs import BACKENDS
from pipelines.quantize.layout import ModelLayout
from pipelines.recipe import LoadedRecipe

# vLLM's quantization_config for each backend's typical checkpoint (what the tools write into config.json)
TYPICAL_CONFIG: dict[str, dict] = {
    "gptqmodel": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "lm_head": False},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                     "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_use_double_quant": False},
}


def check_backend_served(loaded: LoadedRecipe, layout: ModelLayout, target: ServeTarget) -> None:
    """An InputError (field `backend`) when vLLM cannot serve the recipe's backend's format on `target`."""
    spec = BACKENDS[loaded.recipe.backend]
    if spec.environment is None or not layout.linears:
        return  # llm-compressor's compressed-tensors schemes are checked scheme by scheme by the compiler
    # a hidden x hidden Linear (the attention's query or output projection): the shape gate.json's runtime probes too
    square = [info for info in layout.linears if info.in_features == info.out_features]
    shape = min(square or layout.linears, key=lambda info: info.in_features * info.out_features)
    problem = format_problem(spec.quant_method, TYPICAL_CONFIG[spec.name], shape.in_features, shape.out_features, target)
    if problem:
        raise InputError(f"backend {spec.name} writes {spec.checkpoint_format} checkpoints, which vLLM cannot serve here: {problem}",
                         file=loaded.path, field="backend")
