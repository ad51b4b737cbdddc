"""Serve targets: each rule of vLLM's CPU build and of its CUDA build, and which target this machine has."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.errors import InputError, ServeError
from pipelines.hardware import targets
from pipelines.hardware.host import HostProfile
from pipelines.hardware.targets import CPU, TARGET_ENV, Layer, ServeTarget, installed_target, parse_target, serve_problem
from pipelines.recipe import GroupScheme


def scheme(bits: int = 4, granularity: str = "group", group_size: int | None = 128, symmetric: bool = True,
           activations: dict | None = None) -> GroupScheme:
    weights = {"bits": bits, "granularity": granularity, "symmetric": symmetric}
    if granularity == "group":
        weights["group_size"] = group_size
    return GroupScheme.model_validate({"weights": weights, "activations": activations})


def cuda(capability: str) -> ServeTarget:
    return parse_target(f"cuda:{capability}")


W8A8_DYNAMIC = {"granularity": "token", "dynamic": True}
W8A8_STATIC = {"granularity": "tensor", "dynamic": False}
SQUARE = Layer("model.layers.0.self_attn.q_proj", 256, 256)


def field(problem) -> str | None:
    return problem.field if problem else None


# --- parsing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("cpu", "cpu:avx512bf16"), ("cpu:avx2", "cpu:avx2"), ("CPU:ARM", "cpu:arm"), ("cuda:8.9", "cuda:8.9"), (" CUDA:9.0 ", "cuda:9.0"),
    ("cuda:10.0", "cuda:10.0"),
])
def test_targets_parse_and_print(text: str, expected: str) -> None:
    assert str(parse_target(text)) == expected


def test_the_capability_compares_as_vllm_compares_it() -> None:
    assert (cuda("8.9").sm, cuda("10.0").sm, CPU.sm) == (89, 100, 0)


@pytest.mark.parametrize("text", ["cuda", "gpu", "cuda:89", "cuda:8.9.1", "rocm:9.4", "", "cpu:avx1024", "cpu:"])
def test_an_unknown_target_is_an_input_error_naming_the_field(text: str) -> None:
    with pytest.raises(InputError) as raised:
        parse_target(text)
    assert raised.value.field == "target" and "cuda:MAJOR.MINOR" in raised.value.message


# --- vLLM's CPU build -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("group", "expected"), [
    (scheme(4, "group", 128), None),
    (scheme(4, "group", 96), None),  # CPUWNA16 takes any even group size
    (scheme(4, "channel"), None),
    (scheme(4, "group", 128, symmetric=False), None),  # uint4 with zero points
    (scheme(8, "channel"), "weights.bits"),  # W8A16: no CPU kernel
    (scheme(3, "group", 128), "weights.bits"),
    (scheme(4, "tensor"), "weights.granularity"),
])
def test_cpu_weight_only_rules(group: GroupScheme, expected: str | None) -> None:
    assert field(serve_problem(group, CPU)) == expected


def test_cpu_four_bit_layers_need_sizes_in_multiples_of_32() -> None:
    assert serve_problem(scheme(4), CPU, SQUARE) is None
    problem = serve_problem(scheme(4), CPU, Layer("model.layers.0.mlp.gate_proj", 256, 808))
    assert problem and problem.field == "weights" and "multiples of 32" in problem.why and "256 -> 808" in problem.why


@pytest.mark.parametrize(("group", "expected"), [
    (scheme(8, "channel", activations=W8A8_DYNAMIC), None),
    (scheme(8, "tensor", activations=W8A8_STATIC), None),
    (scheme(8, "channel", activations={**W8A8_DYNAMIC, "symmetric": False}), None),  # asymmetric activations serve
    (scheme(4, "channel", activations=W8A8_DYNAMIC), None),  # W4A8: Dynamic4bitLinearKernel, every CPU class
    (scheme(4, "group", 128, activations=W8A8_DYNAMIC), None),
    (scheme(4, "channel", symmetric=False, activations=W8A8_DYNAMIC), "weights.symmetric"),
    (scheme(4, "channel", activations=W8A8_STATIC), "activations"),
    (scheme(8, "group", 128, activations=W8A8_DYNAMIC), "weights.granularity"),
    (scheme(8, "channel", symmetric=False, activations=W8A8_DYNAMIC), "weights.symmetric"),
    (scheme(8, "channel", activations={"granularity": "tensor", "dynamic": True}), "activations.granularity"),
])
def test_w8a8_rules_on_cpu(group: GroupScheme, expected: str | None) -> None:
    assert field(serve_problem(group, CPU)) == expected


# --- vLLM's CUDA build ----------------------------------------------------------------------------------------


def test_nothing_serves_below_turing() -> None:
    for group in (scheme(4), scheme(8, "channel", activations=W8A8_DYNAMIC)):
        problem = serve_problem(group, cuda("7.0"))
        assert problem and problem.field == "" and "7.5" in problem.why
        assert serve_problem(group, cuda("7.5")) is None


@pytest.mark.parametrize(("group", "expected"), [
    (scheme(8, "channel"), None),  # W8A16 int: Marlin uint8b128, refused on CPU
    (scheme(8, "group", 128), None),
    (scheme(8, "group", 32), None),
    (scheme(8, "group", 256), "weights.group_size"),  # Marlin's sizes only at 8 bits
    (scheme(4, "group", 256), None),  # Triton W4A16
    (scheme(4, "group", 16), "weights.group_size"),
    (scheme(4, "group", 96), "weights.group_size"),  # CPU-only size
    (scheme(4, "group", 64, symmetric=False), None),  # Marlin uint4 with zero points
    (scheme(2, "group", 128), "weights.bits"),
    (scheme(3, "channel"), "weights.bits"),
    (scheme(4, "tensor"), "weights.granularity"),
])
def test_cuda_weight_only_rules(group: GroupScheme, expected: str | None) -> None:
    assert field(serve_problem(group, cuda("8.0"))) == expected


def test_a_refused_cuda_group_size_names_the_ones_that_serve() -> None:
    problem = serve_problem(scheme(8, "group", 256), cuda("8.9"))
    assert problem and "32, 64, 128 (or per channel)" in problem.why and "got 256" in problem.why


def test_asymmetric_8_bit_weights_serve_only_through_machete_on_hopper() -> None:
    asymmetric = scheme(8, "group", 128, symmetric=False)
    problem = serve_problem(asymmetric, cuda("8.9"))
    assert problem and problem.field == "weights.symmetric" and "Machete" in problem.why
    assert serve_problem(asymmetric, cuda("9.0"), Layer("x", 256, 256)) is None
    assert field(serve_problem(scheme(8, "group", 32, symmetric=False), cuda("9.0"))) == "weights.group_size"
    assert field(serve_problem(asymmetric, cuda("9.0"), Layer("x", 256, 192))) == "weights"  # output % 128
    assert field(serve_problem(asymmetric, cuda("10.0"))) == "weights.symmetric"  # Machete is sm90 only


def test_marlin_pads_any_shape_but_triton_group_256_needs_outputs_in_eights() -> None:
    assert serve_problem(scheme(4, "group", 128), cuda("8.0"), Layer("x", 256, 808)) is None
    assert serve_problem(scheme(4, "group", 256), cuda("8.0"), Layer("x", 512, 808)) is None
    problem = serve_problem(scheme(4, "group", 256), cuda("8.0"), Layer("x", 512, 810))
    assert problem and problem.field == "weights" and "Triton" in problem.why


@pytest.mark.parametrize(("group", "expected"), [
    (scheme(8, "channel", activations=W8A8_DYNAMIC), None),
    (scheme(8, "tensor", activations={**W8A8_STATIC, "symmetric": False}), None),  # asymmetric activations (azp)
    (scheme(4, "group", 128, activations=W8A8_DYNAMIC), "weights.bits"),
    (scheme(8, "channel", symmetric=False, activations=W8A8_DYNAMIC), "weights.symmetric"),
    (scheme(8, "channel", activations={"granularity": "tensor", "dynamic": True}), "activations.granularity"),
])
def test_w8a8_rules_on_cuda(group: GroupScheme, expected: str | None) -> None:
    assert field(serve_problem(group, cuda("7.5"))) == expected


def test_an_auto_group_size_is_judged_once_concrete() -> None:
    auto = GroupScheme.model_validate({"weights": {"bits": 8, "granularity": "group", "group_size": {"auto": 256}}})
    assert serve_problem(auto, cuda("8.0")) is None
    assert field(serve_problem(auto.model_copy(update={"weights": auto.weights.for_layer(512)}), cuda("8.0"))) == "weights.group_size"


# --- the installed target --------------------------------------------------------------------------------------


@pytest.fixture
def serve_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A serve environment folder without its Python: the target is what setup_env.sh would build."""
    monkeypatch.delenv(TARGET_ENV, raising=False)
    monkeypatch.delenv("QUANTGATE_SERVE_FLAVOR", raising=False)
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path))
    return tmp_path


def test_the_environment_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TARGET_ENV, "cuda:8.9")
    assert str(installed_target()) == "cuda:8.9" and not installed_target().local
    monkeypatch.setenv(TARGET_ENV, "tpu")
    with pytest.raises(InputError) as raised:
        installed_target()
    assert raised.value.field == TARGET_ENV


def test_with_a_serve_environment_the_detected_host_class_is_local(serve_venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (serve_venv / "bin").mkdir()
    (serve_venv / "bin" / "python").write_text("")
    profile = HostProfile(host_class="cuda:9.0", library="cuda", serve_dtype="bfloat16", dtype_reason="", fingerprint="0" * 16)
    monkeypatch.setattr(targets, "host_profile", lambda: profile)
    assert installed_target() == ServeTarget(kind="cuda", capability=(9, 0), local=True)


def test_before_the_serve_environment_is_built_the_setup_scripts_choice(serve_venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(targets, "gpu_capability", lambda: None)
    monkeypatch.setattr(targets, "cpuinfo_class", lambda: "avx2")
    assert installed_target() == ServeTarget(kind="cpu", isa="avx2")
    monkeypatch.setattr(targets, "gpu_capability", lambda: (12, 0))
    assert str(installed_target()) == "cuda:12.0"
    monkeypatch.setenv("QUANTGATE_SERVE_FLAVOR", "cpu")
    assert installed_target() == ServeTarget(kind="cpu", isa="avx2")
    monkeypatch.setenv("QUANTGATE_SERVE_FLAVOR", "cuda")
    monkeypatch.setattr(targets, "gpu_capability", lambda: None)
    with pytest.raises(ServeError) as raised:
        installed_target()
    assert TARGET_ENV in raised.value.message


