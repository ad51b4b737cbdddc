"""Host classes, the kernel probe's cache and rules, the scoring-time estimate, and a dying server's cause.

The probe itself runs in the serve environment (tests/integration/test_hardware_e2e.py); here its output is
given, so that every rule is checked the same on any host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import answered_probe

from pipelines.errors import InputError
from pipelines.hardware import emulation, targets
from pipelines.hardware.emulation import emulated_class, emulation_env, shim_source
from pipelines.hardware.host import HostFacts, HostProfile, classify, serve_dtype_for
from pipelines.hardware.kernels import STANDARD_CASES, KernelCase, KernelFact, kernel_facts
from pipelines.hardware.speed import ProbedSpeed, artifact_cases, estimate_scoring, probed_speed
from pipelines.recipe import GroupScheme, load_recipe
from pipelines.serve.serving import log_cause

DATA = Path(__file__).resolve().parents[2] / "data" / "serving"
MISSING_WNA16 = "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"


def facts(**isa: bool) -> HostFacts:
    return HostFacts(machine="x86_64", isa=isa, library="")


@pytest.mark.parametrize(("isa", "expected"), [
    ({"avx2": True}, "cpu:avx2"),
    ({"avx2": True, "avx512": True}, "cpu:avx512"),
    ({"avx2": True, "avx512": True, "avx512_bf16": True, "amx_tile": True}, "cpu:avx512bf16"),
])
def test_the_class_is_read_as_vllm_reads_it(isa: dict, expected: str) -> None:
    assert classify(facts(**isa))[0] == expected


def test_arm_and_cuda_hosts_have_their_own_classes() -> None:
    assert classify(HostFacts(machine="aarch64"))[0] == "cpu:arm"
    gpu = HostFacts.model_validate({"machine": "x86_64", "cuda": {"capability": [9, 0], "name": "H200"}})
    assert classify(gpu) == ("cuda:9.0", "cuda")


@pytest.mark.parametrize(("host_class", "dtype"), [
    ("cpu:avx2", "float32"), ("cpu:avx512", "float32"), ("cpu:avx512bf16", "bfloat16"), ("cpu:arm", "bfloat16"),
    ("cuda:9.0", "bfloat16"), ("cuda:8.0", "bfloat16"), ("cuda:7.5", "float16"),
])
def test_the_serve_dtype_follows_the_class(host_class: str, dtype: str) -> None:
    assert serve_dtype_for(host_class)[0] == dtype


def test_an_arm_cpu_without_bf16_serves_float32() -> None:
    assert serve_dtype_for("cpu:arm", HostFacts(machine="aarch64", mkldnn_bf16=False))[0] == "float32"


def test_amx_is_always_hidden_and_emulation_hides_the_wider_isa() -> None:
    assert "_is_amx_tile_supported" in shim_source(None) and "_is_avx512_supported" not in shim_source(None)
    avx2 = shim_source("avx2")
    assert all(f"torch.cpu.{name} = lambda: False" in avx2 for name in ("_is_avx512_supported", "_is_avx512_bf16_supported"))
    compile(avx2, "sitecustomize.py", "exec")  # the shim is valid Python
    assert emulation_env("avx2") == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert emulation_env(None) == {}


def test_the_shim_sends_non_finite_log_probabilities_as_json_literals(tmp_path: Path) -> None:
    # vLLM 0.32 answers HTTP 400 to a response holding NaN (starlette's allow_nan=False): the shim sends the literals that
    # lm-eval's json.loads reads back. Run in a child: the patch must not touch this process's starlette.
    (tmp_path / "sitecustomize.py").write_text(shim_source(None))
    check = "from starlette.responses import JSONResponse; print(JSONResponse({'lp': [float('nan'), float('-inf'), -1.5]}).body.decode())"
    answer = subprocess.run([sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                            text=True, timeout=60, check=True)
    assert answer.stdout.strip() == '{"lp":[NaN,-Infinity,-1.5]}'


def test_a_production_server_s_shim_keeps_standard_json(tmp_path: Path) -> None:
    # The fleet's servers answer clients that expect standard JSON: starlette's own refusal of NaN is kept there.
    (tmp_path / "sitecustomize.py").write_text(shim_source(None, non_finite_literals=False))
    check = "from starlette.responses import JSONResponse; JSONResponse({'lp': [float('nan')]})"
    answer = subprocess.run([sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                            text=True, timeout=60)
    assert answer.returncode != 0 and "Out of range float values are not JSON compliant" in answer.stderr


@pytest.mark.parametrize(("own", "asked", "ok"), [
    ("avx512bf16", "cpu:avx2", True), ("avx512bf16", "cpu:avx512", True), ("avx2", "cpu:avx2", True),
    ("avx2", "cpu:avx512", False), ("arm", "cpu:avx2", False),
])
def test_only_a_narrower_class_can_be_emulated(monkeypatch: pytest.MonkeyPatch, own: str, asked: str, ok: bool) -> None:
    monkeypatch.setattr(emulation, "cpuinfo_class", lambda: own)
    monkeypatch.setenv(emulation.EMULATE_ENV, asked)
    if ok:
        assert emulated_class() == asked.removeprefix("cpu:")
    else:
        with pytest.raises(InputError) as raised:
            emulated_class()
        assert raised.value.field == emulation.EMULATE_ENV and "cannot be added" in raised.value.message


def test_an_unknown_emulated_class_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(emulation.EMULATE_ENV, "cpu:avx1024")
    with pytest.raises(InputError, match="only cpu:avx2 and cpu:avx512"):
        emulated_class()


# --- probe cases ------------------------------------------------------------------------------------------------------


def test_standard_cases_cover_every_shipped_recipe_and_ladder_rung_once() -> None:
    keys = [case.key for case in STANDARD_CASES]
    assert len(keys) == len(set(keys))
    for name in ("w8a8", "w4a16", "gptq", "aggressive"):
        recipe = load_recipe(name).recipe
        for scheme in (recipe.groups.attention, recipe.groups.mlp):
            assert scheme is not None
            concrete = scheme.model_copy(update={"weights": scheme.weights.for_layer(1024)})
            assert KernelCase.of(concrete).key in keys, name


def test_a_case_is_a_checkpoint_config_vllm_reads() -> None:
    case = KernelCase.of(GroupScheme.model_validate({"weights": {"bits": 4, "granularity": "group", "group_size": 96, "symmetric": False}}))
    assert case.key == "w4i-g96-asym/a16" and "zero points" in case.label
    config = case.quantization_config()
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["input_activations"] is None
    request = case.probe_request()
    assert request["in_features"] % 96 == 0 and request["in_features"] % 32 == 0
    w8a8 = KernelCase.of(GroupScheme.model_validate({"weights": {"bits": 8}, "activations": {"granularity": "tensor", "dynamic": False}}))
    assert w8a8.key == "w8i-ch-sym/a8i-tensor-static-sym" and w8a8.quantization_config()["format"] == "int-quantized"


def test_a_facts_ratio_and_slowdown() -> None:
    fact = KernelFact(key="k", kernel="K", quant_ms={"4": 40.0, "128": 20.0}, base_ms={"4": 1.0, "128": 10.0})
    assert (fact.decode_ratio, fact.prefill_ratio) == (40.0, 2.0) and fact.slowdown == pytest.approx(80 ** 0.5)
    missing = KernelFact(key="k", error="no kernel", quant_ms={"4": 1.0}, base_ms={"4": 1.0})
    assert not missing.served and missing.slowdown is None


# --- the probe's cache and the local rule ---------------------------------------------------------------------------------


PROFILE = HostProfile(host_class="cpu:avx2", library="_C_AVX2", serve_dtype="float32", dtype_reason="", fingerprint="f" * 16)


@pytest.fixture
def fake_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict]:
    """The probe answered as on an AVX2 host: int8 served, every 4-bit weight-only case missing its op."""
    calls: list[dict] = []

    def run_probe(request: dict, *, timeout_s: float) -> dict:
        calls.append(request)
        found = {}
        for case in request["cases"]:
            if "/a16" in case["key"]:
                found[case["key"]] = {"scheme": "CompressedTensorsWNA16", "kernel": "CPUWNA16LinearKernel", "error": MISSING_WNA16}
            else:
                slow = "static-asym" in case["key"]
                found[case["key"]] = {"scheme": "CompressedTensorsW8A8Int8", "kernel": "CPUInt8ScaledMMLinearKernel", "error": None,
                                      "quant_ms": {"4": 100.0 if slow else 2.0, "128": 60.0 if slow else 5.0}, "base_ms": {"4": 1.0, "128": 4.0}}
        return {"host": {}, "cases": found}

    with answered_probe(monkeypatch, tmp_path, PROFILE, run_probe):
        yield calls


def test_the_probe_runs_once_per_host_and_then_only_for_new_cases(fake_probe: list[dict]) -> None:
    first = kernel_facts(PROFILE)
    assert len(fake_probe) == 1 and len(fake_probe[0]["cases"]) == len(STANDARD_CASES) and fake_probe[0]["dtype"] == "float32"
    assert kernel_facts(PROFILE).keys() == first.keys() and len(fake_probe) == 1
    odd = KernelCase.of(GroupScheme.model_validate({"weights": {"bits": 4, "granularity": "group", "group_size": 96}}))
    assert not kernel_facts(PROFILE, [odd])[odd.key].served
    assert len(fake_probe) == 2 and [case["key"] for case in fake_probe[1]["cases"]] == [odd.key]


def test_a_scheme_with_no_kernel_here_is_refused_naming_the_class_and_the_op(fake_probe: list[dict]) -> None:
    w4a16 = load_recipe("w4a16").recipe.groups.attention
    assert w4a16 is not None
    local = targets.ServeTarget(kind="cpu", isa="avx2", local=True)
    problem = targets.serve_problem(w4a16.model_copy(update={"weights": w4a16.weights.for_layer(256)}), local)
    assert problem is not None
    assert "cpu:avx2" in problem.why and "_C_AVX2" in problem.why and "cpu_gemm_wna16" in problem.why
    assert "Served here: int8 W8A8" in problem.why
    w8a8 = load_recipe("w8a8").recipe.groups.mlp
    assert w8a8 is not None and targets.serve_problem(w8a8, local) is None


def test_the_written_rules_for_avx2_refuse_4_bit_weight_only_without_a_probe() -> None:
    w4a16 = load_recipe("w4a16").recipe.groups.mlp
    assert w4a16 is not None
    concrete = w4a16.model_copy(update={"weights": w4a16.weights.for_layer(256)})
    problem = targets.serve_problem(concrete, targets.parse_target("cpu:avx2"))
    assert problem is not None and problem.field == "weights.bits" and "_C_AVX2" in problem.why
    assert targets.serve_problem(concrete, targets.parse_target("cpu:avx512")) is None


# --- the estimate -----------------------------------------------------------------------------------------------------------


def test_a_slow_artifact_gets_an_estimate_from_the_baselines_pace(fake_probe: list[dict], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                          "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": False}}}
    config.write_text(json.dumps({"quantization_config": {"config_groups": groups}}))
    cases = artifact_cases(config)
    assert [case.key for case in cases] == ["w8i-ch-sym/a8i-tensor-static-asym"]
    speed = probed_speed(PROFILE, cases)
    assert speed.slow and speed.slowdown == pytest.approx((100.0 * 15.0) ** 0.5)
    estimate = estimate_scoring(250, 60.0, speed)
    assert estimate is not None and estimate.seconds == pytest.approx(60.0 * speed.slowdown)
    assert "up to" in estimate.line() and "cpu:avx2" in estimate.line()
    fast = ProbedSpeed(host_class="cpu:avx2", slowest="k", slowdown=1.5)
    assert estimate_scoring(250, 60.0, fast) is None


@pytest.mark.parametrize("text", ["", "{", json.dumps({"quantization_config": {"config_groups": {"g": {"weights": {"num_bits": 3.5}}}}}),
                                  json.dumps({"quantization_config": []})])
def test_an_unreadable_config_names_no_scheme(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    assert artifact_cases(tmp_path / "config.json") == []


# --- a dying server ----------------------------------------------------------------------------------------------------------


def test_a_dead_engine_is_reported_by_the_exception_that_killed_it() -> None:
    """A real vLLM 0.32 log (AVX2 host, a w4a16 artifact): the root cause, not the wrappers logged after it."""
    assert log_cause(DATA / "avx2-w4a16-engine-death.log") == MISSING_WNA16


def test_a_cause_on_several_lines_keeps_its_detail() -> None:
    """vLLM 0.32 refusing an unknown architecture at start-up: pydantic's first line says little, the next says why."""
    cause = log_cause(DATA / "unknown-architecture-start.log")
    assert cause is not None and cause.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig")
    assert "Model architectures ['NoSuchModelForCausalLM'] are not supported" in cause and len(cause) < 1000


def test_a_healthy_log_has_no_cause(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=1) INFO 12-03 11:50:12 [api_server.py:1] Starting\nINFO: 127.0.0.1 - \"GET /health\" 200 OK\n")
    assert log_cause(log) is None
    assert log_cause(tmp_path / "absent.log") is None


def test_a_forced_target_that_is_not_this_hosts_class_cannot_serve_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path))
    monkeypatch.setattr(targets, "host_profile", lambda: PROFILE)
    monkeypatch.setenv(targets.TARGET_ENV, "cuda:8.9")
    with pytest.raises(InputError) as raised:
        targets.require_local_target()
    assert raised.value.field == targets.TARGET_ENV and "not this host's class (cpu:avx2)" in raised.value.message
    monkeypatch.setenv(targets.TARGET_ENV, "cpu:avx2")
    assert targets.require_local_target().local
    monkeypatch.delenv(targets.TARGET_ENV)
    assert targets.installed_target() == targets.ServeTarget(kind="cpu", isa="avx2", local=True)


def test_the_scoring_limit_holds_against_the_measured_pace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pipelines.evaluation import evaluate
    from pipelines.evaluation.evaluate import ScoringDeadline

    clock = [1000.0]
    monkeypatch.setattr(evaluate.time, "monotonic", lambda: clock[0])
    deadline = ScoringDeadline(limit_s=600, policy_file=tmp_path / "policy.yaml", total=2000)
    clock[0] += 20
    deadline.check(1)  # too early to project: 2 s of a slow start say little
    clock[0] += 20
    deadline.check(400)  # 40 s for 400 of 2,000: 200 s projected
    clock[0] += 20
    with pytest.raises(InputError) as raised:
        deadline.check(410)  # 60 s for 410: 293 s... and then a stall
        clock[0] += 200
        deadline.check(420)  # 260 s for 420: 1,238 s projected
    assert raised.value.field == "max_scoring_time_s" and "420 of 2,000 requests" in raised.value.message
    deadline.done_before = 0
    over = ScoringDeadline(limit_s=10, policy_file=tmp_path / "policy.yaml", total=None)
    clock[0] += 11
    with pytest.raises(InputError, match="> max_scoring_time_s 10"):
        over.check(0)


def test_doctor_tells_what_each_shipped_recipe_gets_here(fake_probe: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.commands import doctor
    from pipelines.hardware import diagnosis

    monkeypatch.setattr(diagnosis, "host_profile", lambda: PROFILE)
    report = doctor.diagnose(targets.ServeTarget(kind="cpu", isa="avx2", local=True))
    actions = report.recipe_actions()
    assert actions["w8a8"] == "runs" and actions["w4a16"] == actions["gptq"] == actions["aggressive"] == "refused"
    assert report.negative_control == "aggressive-w4a8" and report.ladder.endswith("cpu-avx2.yaml")
    refused = next(row for row in report.rows if row.source == "w4a16: mlp")
    assert refused.kernel == "CPUWNA16LinearKernel" and "cpu_gemm_wna16" in refused.why
    elsewhere = doctor.diagnose(targets.parse_target("cpu"))
    assert not elsewhere.probed and elsewhere.negative_control == "aggressive"
    refused_everywhere_on_cpu = {"fp8-block", "fp8-w8a16"}  # block FP8 needs AMX-FP8; no weight-only FP8 kernel on CPU
    assert {name for name, action in elsewhere.recipe_actions().items() if action != "runs"} == refused_everywhere_on_cpu
