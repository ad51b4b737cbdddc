"""The local host's kernel rule: a scheme is served here when the probe built and ran vLLM's kernel for it."""

from __future__ import annotations

from pipelines.hardware.host import host_profile
from pipelines.hardware.kernels import STANDARD_CASES, KernelCase, KernelFact, KvCase, kernel_facts
from pipelines.recipe import GroupScheme


def probe_problem(scheme: GroupScheme | KernelCase) -> tuple[str, str] | None:
    """(field, why) when no vLLM kernel serves `scheme` on this host, with the probe's own error and what is served
    here instead; None when one does."""
    profile = host_profile()
    case = scheme if isinstance(scheme, KernelCase) else KernelCase.of(scheme)
    facts = kernel_facts(profile, [case])
    fact = facts[case.key]
    if fact.served:
        return None
    instead = served_families(facts)
    return "", (
        f"no vLLM kernel serves {case.label} on this host ({profile.host_class}, vLLM's {profile.library} library): "
        f"{fact.kernel or fact.scheme or 'vLLM'} failed in the kernel probe with {fact.error}. "
        + (f"Served here: {instead}" if instead else "The probe found no quantized kernel on this host")
    )


def served_families(facts: dict[str, KernelFact]) -> str:
    """The standard schemes the probe found served, in words (for 'use this instead')."""
    families = []
    for name, test in (
        ("int8 W8A8 (the w8a8 recipe)", lambda c: c.activations is not None and c.weights.bits == 8 and c.weights.type == "int"),
        ("int4 weights with int8 activations (W4A8: the aggressive recipe)", lambda c: c.activations is not None and c.weights.bits == 4),
        ("int4 weight-only (w4a16, gptq)", lambda c: c.activations is None and c.weights.bits == 4),
        ("int8 weight-only", lambda c: c.activations is None and c.weights.bits == 8 and c.weights.type == "int"),
        ("FP8 W8A8 (the fp8 recipe)", lambda c: c.activations is not None and c.weights.type == "float"),
        ("FP8 weight-only (fp8-w8a16)", lambda c: c.activations is None and c.weights.type == "float"),
    ):
        if any(test(case) and facts.get(case.key, KernelFact(key=case.key, error="absent")).served for case in STANDARD_CASES):
            families.append(name)
    return ", ".join(families)


def kv_probe_problem(kv_cache_dtype: str, head_size: int) -> str | None:
    """Why vLLM's attention on this host refuses a KV cache of `kv_cache_dtype` for heads of `head_size` (its own
    start-up check, run by the probe), or None when it stores it."""
    profile = host_profile()
    case = KvCase(kv_cache_dtype=kv_cache_dtype, head_size=head_size)
    fact = kernel_facts(profile, [case]).get(case.key)
    if fact is None or fact.served:  # a CUDA host's KV cases are not probed: the written rules decide
        return None
    return (f"vLLM's attention on this host ({profile.host_class}, vLLM's {profile.library} library) cannot store {case.label}: "
            f"its start-up check says {fact.error}")
