"""This CPU's class as vLLM's CPU build will see it, and the narrower class it can be made to look like.

The class is read from /proc/cpuinfo (before the serve environment exists: torch's checks read the same CPUID bits).
An AVX-512 host can reproduce a narrower class (`QUANTGATE_EMULATE_HOST=cpu:avx2`): the server's sitecustomize (the shim)
reports the wider ISA checks false to torch (so vLLM loads that class's library), ONEDNN_MAX_CPU_ISA caps oneDNN and
ATEN_CPU_CAPABILITY caps PyTorch's own kernels. A wider class than the host's cannot be emulated.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Literal

from pipelines.errors import InputError

EMULATE_ENV = "QUANTGATE_EMULATE_HOST"
CpuIsa = Literal["avx2", "avx512", "avx512bf16", "arm"]
CPU_CLASSES: tuple[CpuIsa, ...] = ("avx2", "avx512", "avx512bf16", "arm")
# Width order of the x86 classes: a host can emulate its own class or a narrower one.
_X86_ORDER: tuple[CpuIsa, ...] = ("avx2", "avx512", "avx512bf16")
# The torch.cpu checks each emulated class reports false (vLLM's import_kernels reads the first two).
_HIDDEN_CHECKS: dict[CpuIsa, tuple[str, ...]] = {
    "avx2": ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported", "_is_amx_tile_supported"),
    "avx512": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
}
_ONEDNN_ISA: dict[CpuIsa, str] = {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI"}
_ATEN_CAPABILITY: dict[CpuIsa, str] = {"avx2": "avx2", "avx512": "avx512"}


def cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpuinfo_class() -> CpuIsa | None:
    """The CPU class from /proc/cpuinfo alone (before the serve environment exists): torch's checks read the
    same CPUID bits."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "arm"
    flags = cpuinfo_flags()
    if not flags:
        return None
    if "avx512f" in flags:
        return "avx512bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2"


def emulated_class() -> CpuIsa | None:
    """$QUANTGATE_EMULATE_HOST (`cpu:avx2` or `cpu:avx512`), checked against this machine's CPU flags."""
    value = (os.environ.get(EMULATE_ENV) or "").strip().lower()
    if not value:
        return None
    isa = next((name for name in _HIDDEN_CHECKS if name == value.removeprefix("cpu:")), None)
    if isa is None:
        raise InputError(f"{EMULATE_ENV}={value!r}: only cpu:avx2 and cpu:avx512 can be emulated", field=EMULATE_ENV)
    own = cpuinfo_class()
    if own is None or own == "arm" or _X86_ORDER.index(isa) > _X86_ORDER.index(own):
        raise InputError(
            f"{EMULATE_ENV}={value!r}: this host is cpu:{own or 'unknown'}; only its own class or a narrower x86 class can be "
            "emulated (an ISA the CPU lacks cannot be added)", field=EMULATE_ENV,
        )
    return isa


# vLLM 0.32 answers HTTP 400 "Out of range float values are not JSON compliant" to a request whose log-probabilities hold a
# NaN (its -9999 clamp lets NaN through; starlette encodes with allow_nan=False): lm-eval then fails the whole run. Encoded
# as the literals NaN / Infinity instead, each item's values reach the samples file and the gate rejects the items that
# carry them (pipelines.evaluation.evaluate.read_items).
_NON_FINITE_JSON = """try:
    import json as _json
    import starlette.responses as _responses

    def _render(self, content):
        return _json.dumps(content, ensure_ascii=False, allow_nan=True, indent=None, separators=(",", ":")).encode("utf-8")

    _responses.JSONResponse.render = _render
except Exception:
    pass
"""


def shim_source(emulated: CpuIsa | None, *, non_finite_literals: bool = True) -> str:
    """The server's sitecustomize: AMX always reported unavailable; with emulation, the wider ISA checks too; for a server
    the gate scores, non-finite log-probabilities sent as JSON's NaN / Infinity literals, not refused (_NON_FINITE_JSON).
    A production server (the fleet's) keeps vLLM's own answer: its clients expect standard JSON."""
    hidden = ("_is_amx_tile_supported", *(_HIDDEN_CHECKS.get(emulated, ()) if emulated else ()))
    lines = "".join(f"    torch.cpu.{name} = lambda: False\n" for name in dict.fromkeys(hidden))
    literals = _NON_FINITE_JSON if non_finite_literals else ""
    return f"try:\n    import torch.cpu\n{lines}except Exception:\n    pass\n{literals}"


def emulation_env(emulated: CpuIsa | None) -> dict[str, str]:
    """oneDNN's and PyTorch's own ISA caps for an emulated class (empty without emulation)."""
    if emulated is None:
        return {}
    return {"ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[emulated], "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[emulated]}
