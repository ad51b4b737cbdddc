"""The decode roofline (`plan --gpu`: predicted tokens/s per scheme with its kernel) and its calibration on a CPU host,
against figures computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipelines import cli
from pipelines.benchmarks import roofline as calibration
from pipelines.hardware.kernel_choice import selected_kernel
from pipelines.hardware.targets import Layer, parse_target
from pipelines.planner import GpuSpec, StepCost, gpu_spec, plan, roofline_point
from pipelines.planner.gpus import _GpuEntry
from pipelines.recipe import load_recipe

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"
LLAMA2_7B = CONFIGS / "llama-2-7b" / "config.json"
DEMO = Path(__file__).resolve().parents[3] / "models" / "demo-llama"

# Llama-2-7B in bf16, by hand: 6,738,415,616 parameters x 2 bytes, less the input embedding table a step reads one row of
# (32,000 x 4,096 x 2); KV 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB a token.
LLAMA2_7B_READ = 6_738_415_616 * 2 - 32_000 * 4_096 * 2
LLAMA2_7B_KV_PER_TOKEN = 2 * 32 * 32 * 128 * 2
# FLOPs a token: 2 x (32 layers x (4 x 4096^2 + 3 x 4096 x 11008) + the lm_head 32,000 x 4,096) + attention 4 x 4096 x context x 32.
LLAMA2_7B_LINEAR_FLOPS = 2 * 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
LLAMA2_7B_LM_HEAD_FLOPS = 2 * 32_000 * 4_096


def recipes(*names: str) -> list:
    return [None, *(load_recipe(name).recipe for name in names)]


def test_7b_bf16_on_h100_at_batch_1_is_bandwidth_over_bytes_read() -> None:
    row = plan(LLAMA2_7B, [None], gpu_spec("H100"), 2048, 1).rows[0]
    read = LLAMA2_7B_READ + 2048 * LLAMA2_7B_KV_PER_TOKEN  # 14,288,429,056 bytes
    assert read == 14_288_429_056
    point = row.roofline.at(1)
    assert point.bytes_per_step == read
    assert point.tokens_per_s == pytest.approx(3350e9 / read) == pytest.approx(234.45, abs=0.01)
    assert point.bound == "memory" and row.decode_tokens_per_s == point.tokens_per_s
    assert point.flops_per_step == {"bf16": LLAMA2_7B_LINEAR_FLOPS + LLAMA2_7B_LM_HEAD_FLOPS + 4 * 4096 * 2048 * 32}
    assert point.compute_s == pytest.approx(point.flops_per_step["bf16"] / 989e12)


def test_a_batch_shares_the_weight_read_and_adds_each_sequence_kv() -> None:
    row = plan(LLAMA2_7B, [None], gpu_spec("H100"), 2048, 16).rows[0]
    point = row.roofline.at(16)
    assert point.bytes_per_step == LLAMA2_7B_READ + 16 * 2048 * LLAMA2_7B_KV_PER_TOKEN
    assert point.tokens_per_s == pytest.approx(16 * 3350e9 / point.bytes_per_step)
    assert [p.batch for p in row.roofline.points] == [1, 16]


def test_the_step_is_the_slower_of_memory_and_compute() -> None:
    device = GpuSpec(name="toy", memory_bytes=1, bandwidth_bytes_per_s=1000, peak_flops_per_s={"bf16": 100.0})
    cost = StepCost(weight_bytes=1000, kv_bytes_per_sequence=0, flops_per_sequence={"bf16": 10}, kernel="k")
    one = roofline_point(cost, device, 1)  # memory 1 s, compute 0.1 s
    assert (one.step_s, one.tokens_per_s, one.bound) == (1.0, 1.0, "memory")
    twenty = roofline_point(cost, device, 20)  # memory 1 s, compute 2 s
    assert (twenty.step_s, twenty.tokens_per_s, twenty.bound) == (2.0, 10.0, "compute")


def test_each_compute_dtype_is_divided_by_its_own_peak() -> None:
    device = GpuSpec(name="toy", memory_bytes=1, bandwidth_bytes_per_s=1, peak_flops_per_s={"bf16": 10.0, "int8": 40.0})
    cost = StepCost(weight_bytes=1, kv_bytes_per_sequence=0, flops_per_sequence={"bf16": 20, "int8": 80}, kernel="k")
    assert roofline_point(cost, device, 1).compute_s == 4.0  # 20/10 + 80/40
    no_int8 = device.model_copy(update={"peak_flops_per_s": {"bf16": 10.0}})
    point = roofline_point(cost, no_int8, 1)
    assert point.compute_s is None and point.bound == "memory"  # an unknown peak is left out, never guessed


@pytest.mark.parametrize("gpu, recipe, kernel, dtypes", [
    ("H100", "w8a8", "CutlassInt8ScaledMMLinearKernel", {"int8", "bf16"}),
    ("H100", "w4a16", "MacheteLinearKernel", {"bf16"}),
    ("A100-80GB", "w4a16", "MarlinLinearKernel", {"bf16"}),
    ("H100", "fp8", "CutlassFP8ScaledMMLinearKernel", {"fp8", "bf16"}),
    ("H100", "fp8-block", "CUTLASS block FP8 (DeepGEMM where installed)", {"fp8", "bf16"}),
    ("L4", "fp8-block", "Triton block FP8", {"fp8", "bf16"}),
    ("A100-80GB", "fp8-w8a16", "MarlinFP8 (FP8 weights, 16-bit activations)", {"bf16"}),
])
def test_each_scheme_names_the_kernel_the_cuda_rules_select(gpu: str, recipe: str, kernel: str, dtypes: set) -> None:
    result = plan(LLAMA2_7B, recipes(recipe), gpu_spec(gpu), 2048, 1)
    sixteen, row = result.rows
    assert sixteen.roofline.kernel == "cuBLAS GEMM (unquantized)"
    assert row.roofline.source == "predicted" and row.roofline.kernel == kernel
    assert set(row.roofline.at(1).flops_per_step) == dtypes


def test_int8_linears_are_counted_at_the_int8_peak_and_the_rest_at_bf16() -> None:
    row = plan(LLAMA2_7B, recipes("w8a8"), gpu_spec("H100"), 2048, 1).rows[1]
    flops = row.roofline.at(1).flops_per_step
    assert flops["int8"] == LLAMA2_7B_LINEAR_FLOPS
    assert flops["bf16"] == LLAMA2_7B_LM_HEAD_FLOPS + 4 * 4096 * 2048 * 32


def test_quantized_weights_read_fewer_bytes_and_predict_faster_decode() -> None:
    rows = plan(LLAMA2_7B, recipes("w8a8", "w4a16"), gpu_spec("H100"), 2048, 1).rows
    speeds = [row.roofline.at(1).tokens_per_s for row in rows]
    assert speeds[0] < speeds[1] < speeds[2]
    assert speeds[1] == pytest.approx(3350e9 / (rows[1].roofline.at(1).bytes_per_step))


def test_a_scheme_the_rules_refuse_has_no_kernel_and_no_roofline() -> None:
    row = plan(LLAMA2_7B, recipes("fp8"), gpu_spec("A100-80GB"), 2048, 1).rows[1]
    assert row.does_not_apply and row.roofline is None
    fp8 = load_recipe("fp8").recipe.groups.attention
    assert selected_kernel(fp8, parse_target("cuda:8.0"), Layer("q", 4096, 4096)) is None
    assert selected_kernel(fp8, parse_target("cuda:8.9"), Layer("q", 4096, 4096)).compute == "fp8"


def test_machete_needs_its_shapes_else_marlin() -> None:
    w4a16 = load_recipe("w4a16").recipe.groups.attention
    scheme = w4a16.model_copy(update={"weights": w4a16.weights.for_layer(4096)})
    hopper = parse_target("cuda:9.0")
    assert selected_kernel(scheme, hopper, Layer("q", 4096, 4096)).name == "MacheteLinearKernel"
    assert selected_kernel(scheme, hopper, Layer("k", 4096, 4000)).name == "MarlinLinearKernel"  # 4000 % 128 != 0


def test_a_gpu_without_a_compute_peak_gets_a_bandwidth_only_roofline() -> None:
    point = plan(LLAMA2_7B, [None], gpu_spec("A10G"), 2048, 1).rows[0].roofline.at(1)
    assert point.compute_s is None and point.tokens_per_s == pytest.approx(600e9 / point.bytes_per_step)
    assert plan(LLAMA2_7B, [None], gpu_spec(memory_gib=80), 2048, 1).rows[0].roofline is None


def test_a_peak_given_on_the_command_line_sets_the_16_bit_compute_side() -> None:
    gpu = gpu_spec(memory_gib=80, bandwidth_gbs=1000, peak_tflops=0.001)  # 1 TFLOPS, 1e9 a second: compute-bound at once
    point = plan(LLAMA2_7B, [None], gpu, 2048, 1).rows[0].roofline.at(1)
    assert point.bound == "compute" and point.tokens_per_s == pytest.approx(1e9 / point.flops_per_step["bf16"])


@pytest.mark.parametrize("peak", [-1, 0, float("nan"), float("inf")])
def test_the_gpu_table_refuses_a_peak_that_is_not_a_positive_number(peak: float) -> None:
    with pytest.raises(ValidationError):
        _GpuEntry(memory_gib=80, bandwidth_gbs=3350, peak_tflops={"bf16": peak})


def test_every_table_gpu_with_a_compute_capability_has_a_16_bit_peak_except_a10g() -> None:
    from pipelines.planner import known_gpus

    missing = [name for name, gpu in known_gpus().items() if "bf16" not in gpu.peak_flops_per_s]
    assert missing == ["A10G"]
    h100 = known_gpus()["H100-80GB"].peak_flops_per_s
    assert h100 == {"bf16": 989e12, "int8": 1979e12, "fp8": 1979e12}


@pytest.fixture
def only_the_plan_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "COMMANDS", {"plan": cli.COMMANDS["plan"]})


@pytest.mark.usefixtures("only_the_plan_command")
def test_cli_labels_the_speed_predicted_with_the_kernel(capsys: pytest.CaptureFixture) -> None:
    argv = ["plan", "--config", str(LLAMA2_7B), "--recipe", "w8a8", "--gpu", "H100", "--max-model-len", "2048", "--concurrency", "16"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "(predicted)" in out and "an upper bound on speed" in out  # the wrapped column header, the lines' heading
    assert "w8a8: predicted 1 stream" in out and "16 streams" in out and "kernel CutlassInt8ScaledMMLinearKernel" in out
    assert cli.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [row["roofline"]["source"] for row in rows] == ["predicted", "predicted"]
    assert rows[1]["roofline"]["kernel"] == "CutlassInt8ScaledMMLinearKernel"


@pytest.mark.parametrize("argv, option", [
    (["--gpu", "H100", "--gpu-peak-tflops", "-5"], "--gpu-peak-tflops"),
    (["--gpu", "H100", "--gpu-peak-tflops", "nan"], "--gpu-peak-tflops"),
    (["--gpu", "H100", "--gpu-peak-tflops", "inf"], "--gpu-peak-tflops"),
    (["--gpu", "H100", "--gpu-peak-tflops", "fast"], "--gpu-peak-tflops"),
    (["--calibrate", "--concurrency", "-1"], "--concurrency"),
    (["--calibrate", "--concurrency", "1.5"], "--concurrency"),
])
@pytest.mark.usefixtures("only_the_plan_command")
def test_bad_numbers_are_one_line_naming_the_option(argv: list[str], option: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["plan", "--config", str(LLAMA2_7B), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith(f"quantize: error: quantize plan: argument {option}")


@pytest.mark.usefixtures("only_the_plan_command")
def test_calibrate_refuses_a_config_or_artifact_and_a_missing_model(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.main(["plan", "--calibrate", "--config", str(LLAMA2_7B)]) == 2
    assert "calibrate" in capsys.readouterr().err
    (tmp_path / "models" / "demo-llama").mkdir(parents=True)
    (tmp_path / "models" / "demo-llama" / "config.json").write_text("{}")
    monkeypatch.setenv("QUANTGATE_ROOT", str(tmp_path))  # no SmolLM2 there: refused before anything is measured or served
    assert cli.main(["plan", "--calibrate"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "quantize models add smollm2-135m" in error and "model" in error


# --- the calibration's arithmetic, without a server ----------------------------------------------------------


def host(bandwidth: float, gemm: float = 1e15, cache: int | None = 32 * 2**20) -> calibration.HostRates:
    return calibration.HostRates(
        cpu_model="test", host_class="cpu:avx512bf16", flags=[], threads=1, last_level_cache_bytes=cache,
        bandwidth_bytes_per_s=bandwidth, bandwidth_samples=[bandwidth], gemm_dtype="bfloat16", gemm_flops_per_s=gemm,
        date="2026-12-07",
    )


# The demo model by hand: 4 layers x (q 256x256, k and v 128x256, o 256x256, gate/up/down 3 x 768x256) = 3,145,728
# weights, lm_head 1024 x 256, norms (2 x 4 + 1) x 256; the embedding table is not read. KV: 2 x 4 x 2 x 64 a token.
DEMO_READ_WEIGHTS = 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 768 * 256) + 1024 * 256 + 9 * 256
DEMO_KV_WEIGHTS = 2 * 4 * 2 * 64


@pytest.mark.parametrize("served, width", [("bfloat16", 2), ("float32", 4)])
def test_the_demo_prediction_reads_its_weights_at_the_served_width(served: str, width: int) -> None:
    head, points = calibration.predicted(DEMO, host(10e9), served, context=100, batches=[1, 16])
    assert head.weights_read_bytes == DEMO_READ_WEIGHTS * width == {2: 6_820_352, 4: 13_640_704}[width]
    assert head.fits_in_cache  # 6.5 MiB in 32 MiB: the DRAM roofline overshoots and the output says so
    one, sixteen = points
    assert one.bytes_per_step == (DEMO_READ_WEIGHTS + 100 * DEMO_KV_WEIGHTS) * width
    assert one.tokens_per_s == pytest.approx(10e9 / one.bytes_per_step)
    assert sixteen.bytes_per_step == (DEMO_READ_WEIGHTS + 16 * 100 * DEMO_KV_WEIGHTS) * width
    assert not calibration.predicted(DEMO, host(10e9, cache=2**20), served, 100, [1])[0].fits_in_cache


def test_one_decode_step_is_the_long_minus_short_time_over_the_extra_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    step = 0.01  # seconds a step; prefill and HTTP cost 0.5 s, whatever the length

    def fake(client: object, server: object, tokens: int, batch: int) -> tuple[float, int]:
        return 0.5 + tokens * step, 20

    monkeypatch.setattr(calibration, "_complete_batch", fake)
    server = type("S", (), {"request_timeout_s": 5.0, "log_path": Path("log")})()
    measured = calibration.measure_decode(server, batch=4)  # type: ignore[arg-type]
    assert measured.step_s == pytest.approx(step) and measured.tokens_per_s == pytest.approx(400)
    assert measured.prompt_tokens == 20 and len(measured.step_samples) == calibration.REPEATS


def test_the_ratio_is_measured_over_predicted() -> None:
    _, points = calibration.predicted(DEMO, host(10e9), "bfloat16", 100, [1])
    measured = calibration.MeasuredDecode(batch=1, step_s=1 / 100, step_samples=[0.01], tokens_per_s=100, prompt_tokens=20)
    row = calibration.CalibrationRow(batch=1, predicted=points[0], measured=measured)
    assert row.ratio == pytest.approx(100 / points[0].tokens_per_s)
