"""The local host's kernel rule: a scheme is served here when the probe built and ran vLLM's kernel for it."""

from __future__ import annotations

from pipelines.hardware.host import host_profile
from pipelines.hardware.kernels import STANDARD_CASES, KernelCase, KernelFact, kernel_facts
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
        ("int8 W8A8 (the w8a8 recipe)", lambda c: c.activations is not None and c.weights.bits == 8),
        ("int4 weights with int8 activations (W4A8: the aggressive recipe)", lambda c: c.activations is not None and c.weights.bits == 4),
        ("int4 weight-only (w4a16, gptq)", lambda c: c.activations is None and c.weights.bits == 4),
        ("int8 weight-only", lambda c: c.activations is None and c.weights.bits == 8),
    ):
        if any(test(case) and facts.get(case.key, KernelFact(key=case.key, error="absent")).served for case in STANDARD_CASES):
            families.append(name)
    return ", ".join(families)
