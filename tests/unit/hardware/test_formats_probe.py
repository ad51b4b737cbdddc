"""vLLM's verdict on the other quantize backends' checkpoint formats (GPTQ, bitsandbytes): probed on this machine,
written rules for another target."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import answered_probe

from pipelines.hardware import formats, host, kernels
from pipelines.hardware.emulation import EMULATE_ENV
from pipelines.hardware.formats import format_facts, format_kernel, format_problem
from pipelines.hardware.host import HostProfile
from pipelines.hardware.kernels import FormatCase
from pipelines.hardware.targets import ServeTarget, parse_target
from pipelines.paths import REPO_ROOT

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}
BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
UNKNOWN_BNB = "ValueError: Unknown quantization method: bitsandbytes. Must be one of ['awq', 'gptq']."
PROFILE = HostProfile(host_class="cpu:avx512bf16", library="_C", serve_dtype="bfloat16", dtype_reason="", vllm_version="0.32.0",
                      fingerprint="e" * 16)
LOCAL = ServeTarget(kind="cpu", isa="avx512bf16", local=True)


# --- the case ---------------------------------------------------------------------------------------------------------------


def test_a_format_case_is_keyed_by_everything_vllm_reads_and_sends_its_method() -> None:
    case = FormatCase(method="gptq", config=GPTQ, in_features=256, out_features=256)
    assert case.key == FormatCase(method="gptq", config=dict(reversed(GPTQ.items())), in_features=256, out_features=256).key
    others = {FormatCase(method="gptq", config={**GPTQ, "group_size": 64}, in_features=256, out_features=256).key,
              FormatCase(method="gptq", config=GPTQ, in_features=256, out_features=512).key,
              FormatCase(method="bitsandbytes", config=BNB, in_features=256, out_features=256).key}
    assert case.key not in others and len(others) == 3 and case.key.startswith("format-gptq-")
    request = FormatCase(method="gptq", config={"bits": 4}, in_features=64, out_features=32).probe_request()
    assert request["method"] == "gptq" and request["config"]["quant_method"] == "gptq" and request["in_features"] == 64
    with pytest.raises(ValueError, match="quant_method is 'gptq', not 'bitsandbytes'"):
        FormatCase(method="bitsandbytes", config=GPTQ, in_features=256, out_features=256)


# --- this machine: the probe ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict]:
    """The probe answered as vLLM 0.32's CPU build on cpu:avx512bf16: GPTQ served, bitsandbytes unknown."""
    calls: list[dict] = []

    def run_probe(request: dict, *, timeout_s: float) -> dict:
        calls.append(request)
        found = {case["key"]: {"scheme": "AutoGPTQLinearMethod", "kernel": "CPUWNA16LinearKernel", "error": None}
                 if case["method"] == "gptq" else {"scheme": None, "kernel": None, "error": UNKNOWN_BNB}
                 for case in request["format_cases"]}
        served = {"scheme": "CompressedTensorsW8A8Int8", "kernel": "CPUInt8ScaledMMLinearKernel", "error": None}
        return {"host": {}, "cases": {case["key"]: served for case in request["cases"]}, "kv_cases": {}, "format_cases": found}

    monkeypatch.setattr(formats, "host_profile", lambda: PROFILE)
    with answered_probe(monkeypatch, tmp_path, PROFILE, run_probe):
        yield calls


def test_on_this_machine_vllms_own_refusal_is_the_reason(fake_probe: list[dict]) -> None:
    assert format_problem("bitsandbytes", BNB, 256, 256, LOCAL) == (
        f"vLLM 0.32.0 on cpu:avx512bf16 refuses quant_method bitsandbytes: {UNKNOWN_BNB}")
    assert format_problem("gptq", GPTQ, 256, 256, LOCAL) is None
    fact = format_kernel("gptq", GPTQ, 256, 256)
    assert (fact.scheme, fact.kernel, fact.served) == ("AutoGPTQLinearMethod", "CPUWNA16LinearKernel", True)


def test_formats_are_probed_once_per_host_with_whatever_else_is_missing(fake_probe: list[dict]) -> None:
    format_problem("bitsandbytes", BNB, 256, 256, LOCAL)
    first = fake_probe[0]
    assert len(first["format_cases"]) == 1 and len(first["cases"]) == len(kernels.STANDARD_CASES)
    assert first["format_cases"][0]["config"] == BNB and first["dtype"] == "bfloat16"
    format_problem("bitsandbytes", BNB, 256, 256, LOCAL)
    format_kernel("bitsandbytes", BNB, 256, 256)
    assert len(fake_probe) == 1  # cached per host
    format_problem("gptq", GPTQ, 256, 256, LOCAL)
    assert len(fake_probe) == 2 and fake_probe[1]["cases"] == [] and [c["method"] for c in fake_probe[1]["format_cases"]] == ["gptq"]
    shapes = [(256, 512), (512, 256), (256, 256)]
    facts = format_facts(FormatCase(method="gptq", config=GPTQ, in_features=k, out_features=n) for k, n in shapes)
    assert len(facts) == 3 and all(fact.served for fact in facts.values())
    assert len(fake_probe) == 3 and [(c["in_features"], c["out_features"]) for c in fake_probe[2]["format_cases"]] == shapes[:2]


# --- another target: the written rules --------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["cpu", "cpu:avx2", "cpu:avx512", "cpu:arm"])
def test_every_cpu_target_refuses_bitsandbytes_by_the_written_rule_with_vllms_words(target: str) -> None:
    why = format_problem("bitsandbytes", BNB, 256, 256, parse_target(target))
    assert why is not None and f"written rule for {target if ':' in target else 'cpu:avx512bf16'}" in why
    assert "Unknown quantization method: bitsandbytes" in why


def test_cuda_serves_gptq_and_bitsandbytes_from_their_minimum_capability() -> None:
    ampere = parse_target("cuda:8.0")
    assert format_problem("gptq", GPTQ, 256, 256, ampere) is None and format_problem("bitsandbytes", BNB, 256, 256, ampere) is None
    assert "7.0" in (format_problem("bitsandbytes", BNB, 256, 256, parse_target("cuda:6.1")) or "")
    assert "7.5" in (format_problem("gptq", GPTQ, 256, 256, parse_target("cuda:7.0")) or "")


@pytest.mark.parametrize(("target", "config", "shape", "words"), [
    ("cpu", GPTQ, (256, 256), None),
    ("cpu:arm", GPTQ, (256, 256), None),
    ("cpu:avx2", GPTQ, (256, 256), "torch.float32 is not supported for quantization method auto_gptq"),
    ("cpu:avx512", GPTQ, (256, 256), "float32"),
    ("cpu", {**GPTQ, "bits": 8}, (256, 256), "4 bits only"),
    ("cuda:8.0", {**GPTQ, "bits": 8}, (256, 256), None),
    ("cuda:8.0", {**GPTQ, "sym": False}, (256, 256), "symmetric"),
    ("cuda:8.0", {**GPTQ, "desc_act": True}, (256, 256), "desc_act"),
    ("cuda:8.0", {**GPTQ, "desc_act": True, "group_size": -1}, (256, 256), None),
    ("cpu", {**GPTQ, "group_size": 32}, (96, 80), "multiples of 32"),
    ("cpu", {**GPTQ, "group_size": 33}, (256, 256), "even"),
    ("cuda:8.0", {**GPTQ, "group_size": 16}, (256, 256), "group sizes"),
])
def test_gptq_written_rules_follow_vllms_order(target: str, config: dict, shape: tuple[int, int], words: str | None) -> None:
    why = format_problem("gptq", config, *shape, parse_target(target))
    assert (why is None) if words is None else (why is not None and words in why), why


def test_a_method_without_written_rules_is_refused_for_another_target() -> None:
    why = format_problem("awq", {"bits": 4}, 256, 256, parse_target("cuda:9.0"))
    assert why is not None and "'awq'" in why and "probe" in why


# --- the real serve environment -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_real_cpu_build_serves_gptq_through_a_kernel_and_refuses_bitsandbytes_in_its_own_words(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    serve_env = REPO_ROOT / ".venv-serve"
    if not (serve_env / ".quantgate-stamp").is_file():
        pytest.skip("no serve environment (.venv-serve): make setup builds it")
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(serve_env))
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    profile = host.host_profile()
    if not profile.host_class.startswith("cpu:"):
        pytest.skip(f"vLLM's CPU build's verdicts; this host is {profile.host_class}")
    # this probe run holds the two format cases alone: the standard kernel set is the other tests' business
    monkeypatch.setattr(kernels, "STANDARD_CASES", ())
    monkeypatch.setattr(kernels, "STANDARD_KV_CASES", ())
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    requests: list[dict] = []
    real_probe = kernels.run_probe
    monkeypatch.setattr(kernels, "run_probe", lambda request, *, timeout_s: requests.append(request) or real_probe(request, timeout_s=timeout_s))
    kernels._cached.cache_clear()
    local = parse_target(profile.host_class).model_copy(update={"local": True})

    cases = [FormatCase(method="gptq", config=GPTQ, in_features=256, out_features=256),
             FormatCase(method="bitsandbytes", config=BNB, in_features=256, out_features=256)]
    assert set(format_facts(cases)) == {case.key for case in cases}
    bnb = format_problem("bitsandbytes", BNB, 256, 256, local)
    gptq = format_kernel("gptq", GPTQ, 256, 256)

    assert len(requests) == 1 and len(requests[0]["format_cases"]) == 2, "one probe run for both formats, then the cache"
    assert bnb is not None and bnb.startswith(f"vLLM {profile.vllm_version} on {profile.host_class} refuses quant_method bitsandbytes: ")
    assert "Unknown quantization method: bitsandbytes" in bnb, bnb
    if profile.serve_dtype == "float32":  # cpu:avx2 / cpu:avx512: vLLM's GPTQ method takes 16-bit activations only
        assert not gptq.served and "float32" in (gptq.error or ""), gptq
    else:
        assert gptq.served and gptq.scheme == "AutoGPTQLinearMethod", gptq
        assert gptq.kernel is not None and gptq.kernel.endswith("LinearKernel"), gptq
        assert format_problem("gptq", GPTQ, 256, 256, local) is None
    kernels._cached.cache_clear()
