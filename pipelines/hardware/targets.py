"""Serve targets: which recipe schemes vLLM can serve on the machine that will serve the artifact.

A target is a host class (pipelines/hardware/host.py): `cpu:avx2`, `cpu:avx512`, `cpu:avx512bf16` (`cpu` for
short), `cpu:arm` for vLLM's CPU build, which loads a different compiled library per class, or `cuda:<major>.<minor>`
for its CUDA build on a GPU of that compute capability. Each kind has one written rule function; the compiler asks
the target's rules about every scheme (and again with each layer's shape) before anything is quantized. The
target of this machine (`installed_target`) is detected in the serve environment and is `local`: its kernels are
also probed (pipelines/hardware/kernels.py), and a scheme the probe found no kernel for is refused with the
probe's own reason, whatever the written rules say. A target named by `--target` or $QUANTGATE_SERVE_TARGET is
judged by the written rules alone (validating for another machine); it cannot serve locally unless it is this
host's class.

The rules are read from vLLM 0.32.0, the version both serve environments pin (requirements/serve-*.txt),
and its documentation (docs.vllm.ai/en/v0.32.0/features/quantization/, "Supported Hardware"). Paths below are
inside the vllm package:
- compressed-tensors picks a scheme per layer in
  model_executor/layers/quantization/compressed_tensors/compressed_tensors.py `_get_scheme_from_parts`:
  weight-only int (`_is_wNa16_group_channel`: per channel or per group, pack-quantized) -> CompressedTensorsWNA16;
  int8 activations with 8-bit symmetric weights per channel or tensor, static per-tensor (`_is_static_tensor_w8a8`)
  or dynamic per-token (`_is_dynamic_token_w8a8`), symmetric or asymmetric activations -> CompressedTensorsW8A8Int8.
  Both schemes' get_min_capability() is 75 and get_scheme() refuses a GPU below it (`_check_scheme_supported`).
- CompressedTensorsWNA16 then needs a mixed-precision kernel (model_executor/kernels/linear/__init__.py
  `_POSSIBLE_KERNELS`): on CPU only CPUWNA16 (mixed_precision/cpu.py: uint4/uint4b8, even group size, input and
  output sizes multiples of 32); on CUDA Marlin (mixed_precision/marlin.py, utils/marlin_utils.py:
  MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64, 128], types uint4b8/uint8b128 without zero points and uint4 with
  them, sm75+, tile misalignment zero-padded at load), Machete (machete.py, machete_utils.py: sm90 only, uint4/uint8
  with or without zero points, group sizes -1/64/128 for 16-bit activations, input % 64 and output % 128) and
  Triton W4A16 (triton_w4a16.py: 4-bit only, group sizes -1/32/64/128/256, output % 8). Exllama needs float16
  activations (the serve dtype is bfloat16) and Conch/Humming are optional packages: not counted.

FP8 (type: float): compressed-tensors' `_is_fp8_w8a8` (float weights per tensor, channel or block, symmetric; float
activations dynamic, or static per tensor) -> CompressedTensorsW8A8Fp8 where the capability reaches 89, else
CompressedTensorsW8A16Fp8 (the activations ignored); `_is_fp8_w8a16` (float weights, no activations) ->
CompressedTensorsW8A16Fp8. Kernels (model_executor/kernels/linear/__init__.py `_POSSIBLE_FP8_KERNELS`,
`_POSSIBLE_FP8_BLOCK_KERNELS`, `_POSSIBLE_WFP8A16_KERNELS`): on CUDA, CUTLASS / FlashInfer / torch._scaled_mm from sm89
and Marlin FP8 (weight-only) from sm75; block-wise: DeepGEMM / CUTLASS / Triton from sm89, Marlin below. On CPU
(scaled_mm/cpu.py, pytorch.py): CPUFP8W8A8ScaledMMLinearKernel, CPUFp8PerTensorScaledMMLinearKernel and both block
kernels need AMX (and AMX-FP8), which the product reports unavailable on every CPU (its AMX kernels die with SIGILL on
these VMs); what is left is torch._scaled_mm: ChannelWiseTorchFP8ScaledMMLinearKernel (per-channel weights, dynamic
per-token activations: probed serving on cpu:avx2) and PerTensorTorchFP8ScaledMMLinearKernel, whose activation
quantization (`static_scaled_fp8_quant`) is an empty stub in _C_AVX2 (probed); no weight-only FP8 kernel.

The KV cache (`kv_cache:`, vLLM's --kv-cache-dtype): on CPU the attention backend (v1/attention/backends/cpu_attn.py)
stores `auto` (the serve dtype), 16-bit (measured: bfloat16 beside a float32 model on cpu:avx2, although the backend's
own list names only auto and FP8: the CPU platform does not enforce it) or FP8 (fp8, fp8_e4m3, fp8_e5m2), FP8 only on
x86 with AVX-512 or AMX and with a head size that is a multiple of 32 (`_get_attn_isa`); on CUDA Triton attention
stores 16-bit and FP8 on every capability (FlashAttention / FlashInfer natively on newer GPUs).

Checkpoints of the other quantize backends (config.json `quant_method`; `checkpoint_format_problem`): GPTQ resolves
to vLLM's AutoGPTQConfig on every platform (auto_gptq.py: symmetric 4- or 8-bit weights, no group activation
ordering, float16/bfloat16 activations), whose Linear verifies Marlin's types even on CPU (4-bit only there) and
then takes the same mixed-precision kernels as compressed-tensors WNA16 (choose_mp_linear_kernel). bitsandbytes is
not in vLLM 0.32's CPU package at all: neither in QUANTIZATION_METHODS ("Unknown quantization method: bitsandbytes")
nor as a load format. On CUDA it is written as served from compute capability 7.0 (BitsAndBytesConfig), with RFC
vllm#39583 proposing its deprecation; not checked against a CUDA 0.32 install (the CPU package lacks the method by
its list, not by a platform check): on a CUDA host of its own the probe asks vLLM.

What the recipe schema cannot express yet, for the record: NVFP4 (Blackwell, sm100), MXFP4/8, W4A8 int with FP8
activations (sm90), 2-4-bit KV caches (turboquant, per-token-head).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from pipelines.errors import InputError, ServeError
from pipelines.hardware.emulation import CpuIsa, cpuinfo_class
from pipelines.hardware.host import gpu_capability, host_profile, serve_dtype_for
from pipelines.hardware.probe_rules import kv_probe_problem, probe_problem
from pipelines.recipe import ActivationScheme, GroupScheme, KvCache, WeightScheme
from pipelines.settings import current as current_settings

TARGET_HELP = (
    "cpu (vLLM's CPU build with its full x86 kernel set: AVX-512 with BF16), cpu:avx2, cpu:avx512, cpu:avx512bf16, "
    "cpu:arm, or cuda:MAJOR.MINOR (a GPU's compute capability, e.g. cuda:8.9)"
)
TARGET_ENV = "QUANTGATE_SERVE_TARGET"
_TARGET = re.compile(r"^(cpu(?::(avx2|avx512|avx512bf16|arm))?|cuda:(\d{1,2})\.(\d))$")

# Minimum compute capability of compressed-tensors' W8A8 int8 and WNA16 schemes (get_min_capability: "Turing and up").
CT_MIN_CAPABILITY = 75
MARLIN_GROUP_SIZES = (32, 64, 128)  # and per channel (-1)
TRITON_W4A16_GROUP_SIZES = (32, 64, 128, 256)  # and per channel
MACHETE_GROUP_SIZES = (64, 128)  # with bfloat16/float16 activations; and per channel
MACHETE_CAPABILITY = 90
MACHETE_BLOCK = (64, 128)  # input, output: MACHETE_PREPACKED_BLOCK_SHAPE
CPU_WNA16_MULTIPLE = 32
FP8_COMPUTE_CAPABILITY = 89  # CompressedTensorsW8A8Fp8.get_min_capability: Ada Lovelace and newer
FP8_MARLIN_CAPABILITY = 75  # is_fp8_marlin_supported: FP8 weights with 16-bit activations
CPU_FP8_KV_HEAD_MULTIPLE = 32  # cpu_attn.py _get_attn_isa: "FP8 KV cache requires head_size divisible by 32 on CPU"
CPU_FP8_KV_CLASSES = ("avx512", "avx512bf16")  # x86 with AVX-512 (AMX hosts are cpu:avx512bf16)
GPTQ_TYPES = ((4, True), (8, True))  # AutoGPTQConfig.TYPE_MAP: (bits, sym)
GPTQ_ACT_DTYPES = ("float16", "bfloat16")  # AutoGPTQConfig.get_supported_act_dtypes
BITSANDBYTES_MIN_CAPABILITY = 70  # BitsAndBytesConfig.get_min_capability
# The vLLM library each CPU class loads (vllm/platforms/cpu.py import_kernels).
CPU_LIBRARY: dict[str, str] = {"avx2": "_C_AVX2", "avx512": "_C_AVX512", "avx512bf16": "_C", "arm": "_C"}


class ServeTarget(BaseModel):
    """Where the artifact will be served: vLLM's CPU build on a host of class `isa`, or its CUDA build on a GPU of
    `capability`. `local`: this machine, whose kernels the probe has measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["cpu", "cuda"]
    capability: tuple[int, int] | None = None
    isa: CpuIsa | None = None
    local: bool = False

    @property
    def sm(self) -> int:
        """The capability as vLLM compares it (8.9 -> 89); 0 on CPU."""
        return self.capability[0] * 10 + self.capability[1] if self.capability else 0

    @property
    def host_class(self) -> str:
        """The class name without the `local` mark: what --target and $QUANTGATE_SERVE_TARGET take."""
        return str(self)

    def __str__(self) -> str:
        if self.capability:
            return f"cuda:{self.capability[0]}.{self.capability[1]}"
        return f"cpu:{self.isa}" if self.isa else "cpu"


CPU = ServeTarget(kind="cpu", isa="avx512bf16")


class Problem(NamedTuple):
    """Why a target cannot serve a scheme: the scheme's sub-field ('' for the whole scheme) and the reason."""

    field: str
    why: str


class Layer(NamedTuple):
    name: str
    in_features: int
    out_features: int


def parse_target(text: str, field: str = "target") -> ServeTarget:
    """`cpu`, `cpu:avx2`, ... or `cuda:8.9`; anything else is an InputError naming `field`."""
    found = _TARGET.match(text.strip().lower()) if isinstance(text, str) else None
    if found is None:
        raise InputError(f"unknown serve target {text!r}: give {TARGET_HELP}", field=field)
    if found.group(1).startswith("cpu"):
        return ServeTarget(kind="cpu", isa=found.group(2) or "avx512bf16")
    return ServeTarget(kind="cuda", capability=(int(found.group(3)), int(found.group(4))))


# ----------------------------------------------------------------------------------------- the rules


def serve_problem(scheme: GroupScheme, target: ServeTarget, layer: Layer | None = None) -> Problem | None:
    """Why `target` cannot serve `scheme` (with `layer`: also its shape), or None. A `group_size: auto` is
    judged once the compiler has made it concrete. On the local target the probe's finding comes first."""
    written = cpu_rules(scheme, target, layer) if target.kind == "cpu" else cuda_rules(scheme, target, layer)
    if target.local and not scheme.weights.auto_group:
        found = probe_problem(scheme)
        if found:
            return Problem(written.field if written else found[0], found[1])
    return written


def cpu_rules(scheme: GroupScheme, target: ServeTarget = CPU, layer: Layer | None = None) -> Problem | None:
    """vLLM's CPU build: weight-only at 4 bits (CPUWNA16, not in the AVX2 library), int8 W8A8
    (CPUInt8ScaledMMLinearKernel, oneDNN)."""
    weights, activations = scheme.weights, scheme.activations
    if _is_fp8(scheme):
        return _cpu_fp8_problem(scheme, target)
    if activations is not None and weights.bits == 4:
        return _w4a8_problem(weights, activations, layer)
    if activations is not None:
        return _w8a8_problem(weights, activations, "on CPU vLLM serves W4A8 with int4 weights and int8 dynamic activations")
    if target.isa == "avx2" and weights.bits == 4:
        return Problem(
            "weights.bits",
            "vLLM's CPU build on cpu:avx2 hosts (its _C_AVX2 library) has no 4-bit weight-only kernel: cpu_gemm_wna16 "
            "is built only into its AVX-512 libraries. Use int8 weights with int8 activations (the w8a8 recipe), or "
            "serve on an AVX-512 host",
        )
    if weights.bits != 4:
        return Problem(
            "weights.bits",
            f"vLLM CPU serves weight-only quantization at 4 bits only (CPUWNA16: uint4); {weights.bits}-bit weights "
            "are refused at load time. Use 4 bits, or 8-bit weights with 8-bit activations",
        )
    if weights.granularity == "tensor":
        return _PER_TENSOR_WEIGHT_ONLY
    if layer is not None and (layer.in_features % CPU_WNA16_MULTIPLE or layer.out_features % CPU_WNA16_MULTIPLE):
        return Problem(
            "weights",
            f"vLLM's CPU 4-bit kernel needs layer sizes that are multiples of {CPU_WNA16_MULTIPLE}; {layer.name} is "
            f"{layer.in_features} -> {layer.out_features}",
        )
    return None


def cuda_rules(scheme: GroupScheme, target: ServeTarget, layer: Layer | None = None) -> Problem | None:
    """vLLM's CUDA build on compute capability `target.sm`: weight-only int at 4 or 8 bits (Marlin, Machete,
    Triton W4A16), int8 W8A8 (CUTLASS / Triton scaled_mm), both from sm75."""
    if target.sm < CT_MIN_CAPABILITY:
        return Problem("", f"vLLM's compressed-tensors int schemes need compute capability 7.5 (Turing) or newer; {target} is older")
    weights, activations = scheme.weights, scheme.activations
    if _is_fp8(scheme):
        return _cuda_fp8_problem(scheme, target, layer)
    if activations is not None:
        return _w8a8_problem(weights, activations, "vLLM's CUDA build serves int8 W8A8; its W4A8 kernels take FP8 activations, "
                                                   "W4A8 with int8 activations serves on CPUs only")
    if weights.granularity == "tensor":
        return _PER_TENSOR_WEIGHT_ONLY
    if weights.bits not in (4, 8):
        return Problem(
            "weights.bits",
            f"vLLM on CUDA serves weight-only int at 4 or 8 bits (Marlin, Machete, Triton W4A16); {weights.bits}-bit "
            "weights have no kernel",
        )
    if weights.bits == 8 and not weights.symmetric and target.sm != MACHETE_CAPABILITY:
        return Problem(
            "weights.symmetric",
            f"asymmetric 8-bit weights (zero points) are served only by the Machete kernel, on compute capability 9.0; "
            f"{target} needs `symmetric: true` (Marlin) or 4 bits",
        )
    return _cuda_group_problem(weights, target) or (_cuda_shape_problem(weights, layer) if layer else None)


def _cuda_group_problem(weights: WeightScheme, target: ServeTarget) -> Problem | None:
    group = weights.group_size
    if weights.granularity != "group" or not isinstance(group, int):
        return None  # per channel always serves; `auto` is judged once concrete
    sizes = cuda_group_sizes(weights, target)
    if group in sizes:
        return None
    return Problem(
        "weights.group_size",
        f"vLLM's CUDA kernels take group sizes {', '.join(map(str, sizes))} (or per channel) for "
        f"{'symmetric' if weights.symmetric else 'asymmetric'} {weights.bits}-bit weights on {target}; got {group}",
    )


def cuda_group_sizes(weights: WeightScheme, target: ServeTarget) -> tuple[int, ...]:
    """Group sizes some CUDA kernel serves for these weights: Marlin's, plus 256 from Triton W4A16 at 4 bits;
    asymmetric 8-bit weights only through Machete."""
    if weights.bits == 8 and not weights.symmetric:
        return MACHETE_GROUP_SIZES if target.sm == MACHETE_CAPABILITY else ()
    return TRITON_W4A16_GROUP_SIZES if weights.bits == 4 else MARLIN_GROUP_SIZES


def _cuda_shape_problem(weights: WeightScheme, layer: Layer) -> Problem | None:
    """Marlin zero-pads any shape; the kernels used only where Marlin cannot serve have shape limits."""
    shape = f"{layer.name} is {layer.in_features} -> {layer.out_features}"
    if weights.bits == 8 and not weights.symmetric:
        if layer.in_features % MACHETE_BLOCK[0] or layer.out_features % MACHETE_BLOCK[1]:
            return Problem("weights", f"the Machete kernel needs input sizes multiples of {MACHETE_BLOCK[0]} and output "
                                      f"sizes multiples of {MACHETE_BLOCK[1]}; {shape}")
    elif weights.group_size == 256 and layer.out_features % 8:
        return Problem("weights", f"group size 256 serves through Triton W4A16, which needs output sizes multiples of 8; {shape}")
    return None


def _is_fp8(scheme: GroupScheme) -> bool:
    return scheme.weights.type == "float" or (scheme.activations is not None and scheme.activations.type == "float")


def _fp8_shape_problem(scheme: GroupScheme) -> Problem | None:
    """compressed-tensors' `_is_fp8_w8a8` / `_is_fp8_w8a16`, the same on every target: FP8 weights and FP8 activations
    together, weights per tensor, channel or block, activations dynamic (per token, or per token and group with block
    weights) or static per tensor."""
    weights, activations = scheme.weights, scheme.activations
    if weights.type != "float":
        return Problem("activations.type", "vLLM serves FP8 activations with FP8 weights only (W8A8 FP8); write `type: float` "
                                           "in weights too, or int8 activations with int8 weights")
    if activations is not None and activations.type != "float":
        return Problem("activations.type", "vLLM serves FP8 weights with FP8 activations or 16-bit ones, not int8 activations")
    if weights.granularity == "group":
        return Problem("weights.granularity", "vLLM serves FP8 weights per tensor, per channel or per block, not per group")
    if activations is None:
        return None
    if activations.granularity == "group" and weights.granularity != "block":
        return Problem("activations.granularity", "FP8 activations per token group go with block-wise FP8 weights (granularity: block)")
    if weights.granularity == "block" and activations.granularity != "group":
        return Problem("activations.granularity", "block-wise FP8 weights take dynamic FP8 activations per token group: write "
                                                  "`granularity: group, group_size: <the block's input columns>`")
    block = weights.block_shape
    if block is not None and activations.group_size != block[1]:
        return Problem("activations.group_size", f"the activation group size must equal the block's input columns ({block[1]}) "
                                                 f"for vLLM's block FP8 kernels; got {activations.group_size}")
    return None


def _cpu_fp8_problem(scheme: GroupScheme, target: ServeTarget) -> Problem | None:
    """What is left of vLLM's CPU FP8 kernels with AMX reported unavailable: torch._scaled_mm per channel with dynamic
    per-token activations (ChannelWiseTorchFP8ScaledMMLinearKernel)."""
    shape = _fp8_shape_problem(scheme)
    if shape:
        return shape
    weights, activations = scheme.weights, scheme.activations
    amx = ("vLLM's CPU build has it only with AMX (and AMX-FP8), which the product reports unavailable on every CPU (its AMX "
           "kernels die with SIGILL on these VMs)")
    if activations is None:
        return Problem("activations", f"vLLM's CPU build has no weight-only FP8 kernel (W8A16 FP8) on {target}: serve FP8 weights "
                                      "with FP8 dynamic per-token activations (the fp8 recipe), or int8 W8A8")
    if weights.granularity == "block":
        return Problem("weights.granularity", f"block-wise FP8 (the fp8-block recipe) has no kernel on {target}: {amx}. Use per-channel "
                                              "FP8 weights with dynamic per-token activations (the fp8 recipe)")
    if weights.granularity == "tensor" or not activations.dynamic:
        where = "an empty stub in _C_AVX2 (probed)" if target.isa == "avx2" else "not probed on this class"
        return Problem("weights.granularity" if weights.granularity == "tensor" else "activations.dynamic",
                       f"per-tensor FP8 scales on {target}: CPUFp8PerTensorScaledMMLinearKernel needs AMX ({amx}) and the torch._scaled_mm "
                       f"path quantizes activations with vLLM's static_scaled_fp8_quant, {where}. Use per-channel FP8 weights with "
                       "dynamic per-token activations (the fp8 recipe)")
    return None


def _cuda_fp8_problem(scheme: GroupScheme, target: ServeTarget, layer: Layer | None) -> Problem | None:
    shape = _fp8_shape_problem(scheme)
    if shape:
        return shape
    if scheme.activations is not None and target.sm < FP8_COMPUTE_CAPABILITY:
        return Problem("activations", f"FP8 compute (W8A8 FP8) needs compute capability 8.9 (Ada, Hopper, Blackwell); {target} has none, "
                                      "and vLLM would serve the weights alone (Marlin W8A16 FP8), not what the gate measured. Use FP8 "
                                      "weights with 16-bit activations there (the fp8-w8a16 recipe) or int8 W8A8")
    if target.sm < FP8_MARLIN_CAPABILITY:
        return Problem("", f"vLLM's FP8 kernels need compute capability 7.5 or newer (Marlin FP8); {target} is older")
    block = scheme.weights.block_shape
    if block is not None and layer is not None and layer.in_features % block[1]:
        return Problem("weights.block", f"block-wise FP8 needs input sizes that are multiples of the block's {block[1]} columns "
                                        f"(activation groups and weight blocks); {layer.name} has {layer.in_features}")
    return None


def kv_cache_problem(kv: KvCache, target: ServeTarget, head_dim: int | None) -> Problem | None:
    """Why vLLM's attention on `target` cannot store the KV cache at `kv`'s precision for heads of `head_dim`, or None.
    On the local target the probe's finding (vLLM's own start-up check) comes first."""
    written = _kv_written_problem(kv, target, head_dim)
    if target.local and target.kind == "cpu" and kv.quantized and head_dim is not None:
        found = kv_probe_problem(kv.vllm_dtype, head_dim)
        if found:
            return Problem("dtype", found + (f" ({written.why})" if written else ""))
    return written


def _kv_written_problem(kv: KvCache, target: ServeTarget, head_dim: int | None) -> Problem | None:
    if kv.dtype == "auto":
        return None
    if target.kind == "cuda":
        return None  # Triton attention stores 16-bit and FP8 KV on every capability vLLM supports
    if not kv.quantized:
        return _cpu_16_bit_kv_problem(kv, target)
    if target.isa not in CPU_FP8_KV_CLASSES:
        return Problem("dtype", f"an FP8 KV cache ({kv.dtype}) cannot be served on {target}: vLLM's CPU attention stores FP8 only on x86 "
                                "with AVX-512 or AMX (cpu:avx512, cpu:avx512bf16). Keep `kv_cache: auto` here, or serve on such a host")
    if head_dim is not None and head_dim % CPU_FP8_KV_HEAD_MULTIPLE:
        return Problem("dtype", f"vLLM's CPU attention stores an FP8 KV cache only for head sizes that are multiples of "
                                f"{CPU_FP8_KV_HEAD_MULTIPLE}; this model's heads are {head_dim} wide")
    return None


def _cpu_16_bit_kv_problem(kv: KvCache, target: ServeTarget) -> Problem | None:
    """vLLM's CPU attention lists no 16-bit KV dtype of its own (supported_kv_cache_dtypes: auto and the FP8 ones) and does
    not refuse one: a cache in another dtype than the model's starts, fills twice the tokens and is read back wrong.
    Measured on cpu:avx2 (float32 served): a bfloat16 cache took the demo model from 100 to 10 on date_normalisation (KL
    0.82 nats a token) and SmolLM2-135M from 63.3 to 37.5 on retail_sentiment. A cache in the served dtype is `auto`."""
    served = host_profile().serve_dtype if target.local else serve_dtype_for(str(target))[0]
    if kv.vllm_dtype == served:
        return None
    return Problem("dtype", f"a {kv.vllm_dtype} KV cache cannot be served on {target}: vLLM serves this class's models in {served}, "
                            f"and its CPU attention reads a cache of another 16-bit dtype back wrong (it lists only auto and FP8 KV "
                            f"caches; measured on cpu:avx2: the demo model 100 -> 10 on date_normalisation). Keep `kv_cache: auto` "
                            f"(the cache in {served}) here")


def _w4a8_problem(weights: WeightScheme, activations: ActivationScheme, layer: Layer | None) -> Problem | None:
    """compressed-tensors' `_is_dynamic_token_w4a8_int` -> CompressedTensorsW4A8Int -> Dynamic4bitLinearKernel, vLLM's
    only CPU kernel for it (PyTorch's _dyn_quant_matmul_4bit: KleidiAI on Arm, PyTorch's own kernel on x86, in every
    library vLLM loads): symmetric int4 weights per channel or group, int8 activations dynamic per token."""
    if not weights.symmetric:
        return Problem("weights.symmetric", "vLLM's W4A8 kernel (Dynamic4bitLinearKernel) needs symmetric int4 weights")
    if weights.granularity == "tensor":
        return Problem("weights.granularity", "W4A8 weights must be per channel or per group in vLLM")
    if not activations.dynamic or activations.granularity != "token":
        return Problem("activations", "vLLM serves W4A8 with dynamic per-token int8 activations only")
    group = weights.group_size
    if layer is not None and isinstance(group, int) and layer.in_features % group:
        return Problem("weights.group_size", f"vLLM's W4A8 kernel needs a group size that divides the input size; {layer.name} has "
                                             f"{layer.in_features} inputs")
    return None


def _w8a8_problem(weights: WeightScheme, activations: ActivationScheme, w4a8: str) -> Problem | None:
    """compressed-tensors' `_is_static_tensor_w8a8` / `_is_dynamic_token_w8a8`, the same on every target."""
    if weights.bits != 8:
        return Problem("weights.bits", f"quantized activations need 8-bit weights ({w4a8})")
    if weights.granularity == "group":
        return Problem("weights.granularity", "W8A8 weights must be per channel or per tensor in vLLM")
    if not weights.symmetric:
        return Problem("weights.symmetric", "vLLM's W8A8 kernels need symmetric weights")
    if activations.dynamic and activations.granularity == "tensor":
        return Problem(
            "activations.granularity",
            "vLLM serves dynamic activation scales per token and static ones per tensor, not dynamic per tensor",
        )
    return None


def checkpoint_format_problem(method: str, config: Mapping[str, Any], target: ServeTarget, layer: Layer | None = None) -> Problem | None:
    """The written rule for a checkpoint another quantize backend writes (config.json `quant_method` and its
    `quantization_config`) on `target`, with `layer`: also its shape. Problem fields are the config's keys."""
    if method == "bitsandbytes":
        return _bitsandbytes_problem(target)
    if method == "gptq":
        return _gptq_problem(config, target, layer)
    return Problem("quant_method", f"the written rules know quant_method gptq and bitsandbytes (compressed-tensors through the recipe's "
                                   f"schemes); {method!r} is judged only on a {target} host itself, by the kernel probe")


def _bitsandbytes_problem(target: ServeTarget) -> Problem | None:
    if target.kind == "cpu":
        return Problem("quant_method", f"the written rule for {target}: vLLM 0.32's CPU build refuses quant_method bitsandbytes (its own "
                                       "message: \"Unknown quantization method: bitsandbytes\"; neither the method nor its load format is in "
                                       "the CPU package). Quantize with the gptq or llm-compressor backend for a CPU target")
    if target.sm < BITSANDBYTES_MIN_CAPABILITY:
        return Problem("quant_method", f"vLLM's bitsandbytes method needs compute capability 7.0 or newer; {target} is older")
    return None


def _gptq_problem(config: Mapping[str, Any], target: ServeTarget, layer: Layer | None) -> Problem | None:
    """vLLM's order: AutoGPTQConfig (types, activation ordering), the activation dtype, the Linear's Marlin type check
    (on CPU too), then the mixed-precision kernel, judged by the rules of the same weights written by compressed-tensors."""
    bits, sym, group = config.get("bits"), config.get("sym", True), config.get("group_size", -1)
    if (bits, sym) not in GPTQ_TYPES:
        return Problem("bits" if sym else "sym", f"vLLM serves GPTQ with symmetric 4- or 8-bit weights only (AutoGPTQConfig); got "
                                                 f"bits={bits}, sym={sym}")
    if config.get("desc_act") and group != -1:
        return Problem("desc_act", "vLLM no longer serves GPTQ with group activation ordering (desc_act: true with groups); write "
                                   "desc_act: false")
    if target.kind == "cuda" and target.sm < CT_MIN_CAPABILITY:
        return Problem("", f"vLLM's GPTQ layers need Marlin-class kernels, compute capability 7.5 (Turing) or newer; {target} is older")
    dtype = serve_dtype_for(str(target))[0]
    if dtype not in GPTQ_ACT_DTYPES:
        return Problem("", f"vLLM serves {target}'s models in {dtype}, and its GPTQ method takes float16 or bfloat16 activations only "
                           f"(\"torch.{dtype} is not supported for quantization method auto_gptq\"). Use llm-compressor's schemes there")
    if target.kind == "cpu" and bits != 4:
        return Problem("bits", "vLLM's CPU build serves GPTQ at 4 bits only: its GPTQ layer checks Marlin's types there too "
                               "(\"Marlin does not support weight_bits = uint8b128\", probed)")
    try:
        weights = WeightScheme(bits=bits, granularity="channel" if group == -1 else "group", group_size=None if group == -1 else group)
    except ValidationError:
        return Problem("group_size", f"vLLM's kernels take even GPTQ group sizes (or -1, per channel); got {group!r}")
    scheme = GroupScheme(weights=weights)
    found = cpu_rules(scheme, target, layer) if target.kind == "cpu" else cuda_rules(scheme, target, layer)
    return Problem(_GPTQ_FIELDS.get(found.field, ""), found.why) if found else None


_GPTQ_FIELDS = {"weights.bits": "bits", "weights.group_size": "group_size", "weights.symmetric": "sym"}


_PER_TENSOR_WEIGHT_ONLY = Problem(
    "weights.granularity", "weight-only layers need granularity 'channel' or 'group' in vLLM (pack-quantized format)",
)


# ------------------------------------------------------------------------------- the installed target


def installed_target() -> ServeTarget:
    """The target of this machine: $QUANTGATE_SERVE_TARGET when set (written rules only); else the host class the
    serve environment detects (`local`: its kernels are probed); before the environment is built, the class
    scripts/setup_env.sh would serve on ($QUANTGATE_SERVE_FLAVOR, or cuda when nvidia-smi finds a GPU; a CPU's
    class read from /proc/cpuinfo), judged by the written rules."""
    override = os.environ.get(TARGET_ENV)
    if override:
        return parse_target(override, field=TARGET_ENV)
    if current_settings().serve_python.exists():
        return _from_host_class(host_profile().host_class)
    flavor = os.environ.get("QUANTGATE_SERVE_FLAVOR") or ("cuda" if gpu_capability() else "cpu")
    if flavor != "cuda":
        return ServeTarget(kind="cpu", isa=cpuinfo_class() or "avx512bf16")
    capability = gpu_capability()
    if capability is None:
        raise ServeError(
            f"the serve environment will run vLLM's CUDA build but nvidia-smi reports no GPU compute capability; "
            f"set {TARGET_ENV}=cuda:MAJOR.MINOR (or give --target)",
            field="target",
        )
    return ServeTarget(kind="cuda", capability=capability)


def host_record() -> dict[str, str | bool]:
    """What a manifest, gate.json, registry version and signed bundle record of the host: the detected class and
    its facts, or a forced target's class with `detected: false`."""
    target = installed_target()
    if target.local:
        return host_profile().record()
    library = CPU_LIBRARY.get(target.isa or "", "") if target.kind == "cpu" else "cuda"
    return {"host_class": str(target), "library": library, "serve_dtype": serve_dtype_for(str(target))[0], "detected": False}


def _from_host_class(host_class: str) -> ServeTarget:
    target = parse_target(host_class, field="host class")
    return target.model_copy(update={"local": True})


def require_local_target() -> ServeTarget:
    """The target a local server runs on. A target forced by $QUANTGATE_SERVE_TARGET that is not this host's
    class cannot serve here: one line, before anything starts (it stays valid for `recipe validate --target`)."""
    target = installed_target()
    if target.local or not current_settings().serve_python.exists():
        return target
    actual = host_profile().host_class
    if str(target) != actual:
        raise InputError(
            f"{TARGET_ENV}={target} is not this host's class ({actual}); a forced target only validates recipes for "
            f"another machine (`quantize recipe validate --target {target}`): unset it to serve here",
            field=TARGET_ENV,
        )
    return _from_host_class(actual)

