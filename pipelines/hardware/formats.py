"""vLLM's verdict on a quantize backend's checkpoint format, asked before anything is quantized.

The backends other than llm-compressor write their own formats (config.json `quant_method`: `gptq` from gptqmodel,
`bitsandbytes`). On this machine (`target.local`) the kernel probe asks vLLM itself, the way a server meets the
checkpoint (pipelines/hardware/serve_probe.py, format cases): vLLM's config classes accept or refuse the method
(its own message when this build lacks it), then it builds, loads and runs a Linear of the given shape, naming the
linear method and the kernel it chose (GPTQ on cpu:avx512bf16: AutoGPTQLinearMethod on CPUWNA16LinearKernel). The
facts are cached per host with the kernel facts (pipelines/hardware/kernels.py): one probe run for everything not
yet known. For another target the written rules decide (targets.checkpoint_format_problem).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipelines.hardware.host import host_profile
from pipelines.hardware.kernels import FormatCase, KernelFact, kernel_facts
from pipelines.hardware.targets import Layer, ServeTarget, checkpoint_format_problem


def format_problem(method: str, config: dict[str, Any], in_features: int, out_features: int, target: ServeTarget) -> str | None:
    """None when vLLM on `target` serves a `method` checkpoint with this `quantization_config` for an
    `in_features` -> `out_features` Linear; else one line naming the reason (on this machine, vLLM's own)."""
    if target.local:
        fact = format_kernel(method, config, in_features, out_features)
        if fact.served:
            return None
        profile = host_profile()
        return f"vLLM {profile.vllm_version or '(version unknown)'} on {profile.host_class} refuses quant_method {method}: {fact.error}"
    found = checkpoint_format_problem(method, config, target, Layer(f"a {in_features} -> {out_features} Linear", in_features, out_features))
    return found.why if found else None


def format_kernel(method: str, config: dict[str, Any], in_features: int, out_features: int) -> KernelFact:
    """What vLLM builds on this machine for a Linear of a `method` checkpoint: its linear method class (`scheme`)
    and kernel, or its refusal (`error`); probed once per host."""
    case = FormatCase(method=method, config=config, in_features=in_features, out_features=out_features)
    return format_facts([case])[case.key]


def format_facts(cases: Iterable[FormatCase]) -> dict[str, KernelFact]:
    """vLLM's facts on this machine for every case by key, all the unknown ones probed in one run: ask this first with
    every shape (and method) a run will ask `format_problem` about, and each of those is then read from the cache."""
    wanted = list(cases)
    facts = kernel_facts(host_profile(), wanted)
    return {case.key: facts[case.key] for case in wanted}


