"""The roofline calibrated on this host: measure its memory bandwidth and 16-bit GEMM rate, predict a model's decode
speed with the planner's roofline (pipelines/planner/roofline.py, the code `quantize plan --gpu` uses), then measure it
on vLLM and print measured beside predicted.

    quantize plan --calibrate [--model DIR] [--concurrency N] [--json]

1. host: read bandwidth = bytes / time of a torch sum over a 256 MiB float32 tensor (8x this kind of host's 32 MiB
   last-level cache), the median of 7; GEMM rate = 2 n^3 / time of a 2048-square matmul in the served dtype, the
   median of 5; both with torch's threads set to the threads vLLM's CPU worker runs (all cores but one, at least one).
   A few seconds in all. The host becomes a "device" with that bandwidth and that rate as its 16-bit peak.
2. predicted: the model's decode step at batch 1 and at the deployment's concurrency, in the served dtype (float32
   hosts read 4 bytes a weight), at the mean context of the measured steps.
3. measured: the model on vLLM (pipelines/serve/serving.py vllm_server, the product's own settings, max_num_seqs
   raised to the concurrency), greedy completions with `ignore_eos` of SHORT and LONG tokens, `concurrency` of them
   at once, alternated, REPEATS times each after a warm-up: one decode step = (time of LONG - time of SHORT) /
   (LONG - SHORT), so prefill, HTTP and start-up cancel out; the median step; tokens/s = concurrency / step.

A model whose weights fit in the last-level cache is not read from DRAM at each step: the bandwidth roofline then
overshoots (the step is bound by cache bandwidth, launch overheads and Python), and the result says so.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from pydantic import Field

from pipelines.artifact import is_model_dir, read_config_json, require_model_dir
from pipelines.bounds import MiB
from pipelines.console.output import say, table
from pipelines.errors import InputError, ServeError
from pipelines.hardware.host import host_profile
from pipelines.hardware.targets import installed_target
from pipelines.paths import DEMO_MODEL_NAME
from pipelines.planner import GpuSpec, RooflinePoint, model_shape, predict_weight_bytes, roofline, step_cost
from pipelines.planner.kv import SERVED_DTYPE_BYTES, kv_element_bytes
from pipelines.planner.roofline import BASIS
from pipelines.schema import StrictModel
from pipelines.serve.serving import RunningServer, ServeSettings, vllm_server
from pipelines.settings import current as current_settings

BANDWIDTH_BYTES = 256 * MiB
BANDWIDTH_REPEATS = 7
GEMM_SIZE = 2048
GEMM_REPEATS = 5
SHORT, LONG = 8, 136  # completion tokens of the two request lengths whose difference is timed
REPEATS = 5
SMOLLM2 = "smollm2-135m"
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"
_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}


class HostRates(StrictModel):
    cpu_model: str
    host_class: str
    flags: list[str] = Field(description="of avx512f, avx512_bf16, amx_tile: which /proc/cpuinfo lists")
    threads: int = Field(description="torch threads of the measurement: those vLLM's CPU worker runs")
    last_level_cache_bytes: int | None
    bandwidth_bytes_per_s: float = Field(description="median read bandwidth of a sum over BANDWIDTH_BYTES")
    bandwidth_samples: list[float]
    gemm_dtype: str
    gemm_flops_per_s: float = Field(description="median rate of a GEMM_SIZE-square matmul in the served dtype")
    date: str

    def device(self) -> GpuSpec:
        """This host as the roofline's device: its measured bandwidth, its measured GEMM rate as the 16-bit peak."""
        return GpuSpec(
            name=f"this host ({self.cpu_model}, {self.host_class}, measured)", memory_bytes=_memory_bytes(),
            bandwidth_bytes_per_s=int(self.bandwidth_bytes_per_s), peak_flops_per_s={"bf16": self.gemm_flops_per_s},
        )


class MeasuredDecode(StrictModel):
    batch: int
    step_s: float = Field(description="median of (LONG time - SHORT time) / (LONG - SHORT)")
    step_samples: list[float]
    tokens_per_s: float = Field(description="batch / step_s: every sequence together")
    prompt_tokens: int


class CalibrationRow(StrictModel):
    batch: int
    predicted: RooflinePoint
    measured: MeasuredDecode

    @property
    def ratio(self) -> float:
        """measured / predicted tokens/s: 1 means the roofline is reached; above 1, it was not an upper bound."""
        return self.measured.tokens_per_s / self.predicted.tokens_per_s


class ModelCalibration(StrictModel):
    model: str
    served_dtype: str
    weights_read_bytes: int = Field(description="weights one decode step reads, in the served dtype")
    fits_in_cache: bool = Field(description="weights_read_bytes <= the host's last-level cache: the DRAM roofline overshoots")
    context: int
    kernel: str
    rows: list[CalibrationRow]


class Calibration(StrictModel):
    host: HostRates
    models: list[ModelCalibration]


# ----------------------------------------------------------------------------------------------- the host


def vllm_threads() -> int:
    """The OpenMP threads vLLM's CPU worker runs: every core but one reserved for the engine, at least one."""
    return max(1, (os.cpu_count() or 1) - 1)


def _median_rate(work: float, run: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    run()  # warm-up: page faults, thread pool start
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        rates.append(work / (time.perf_counter() - started))
    return statistics.median(rates), rates


def measure_host(served_dtype: str, threads: int | None = None) -> HostRates:
    """The host's read bandwidth and GEMM rate (a few seconds)."""
    import torch  # heavy: imported when measured

    threads = threads or vllm_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
        bandwidth, samples = _median_rate(BANDWIDTH_BYTES, data.sum, BANDWIDTH_REPEATS)
        del data
        dtype = getattr(torch, _TORCH_DTYPES.get(served_dtype, "float32"))
        a, b = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype), torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
        gemm, _ = _median_rate(2 * GEMM_SIZE**3, lambda: a @ b, GEMM_REPEATS)
    finally:
        torch.set_num_threads(previous)
    profile = host_profile()
    return HostRates(
        cpu_model=profile.cpu_model or _cpuinfo_field("model name"), host_class=profile.host_class, flags=_flags(),
        threads=threads, last_level_cache_bytes=_last_level_cache(), bandwidth_bytes_per_s=bandwidth,
        bandwidth_samples=samples, gemm_dtype=str(dtype).removeprefix("torch."), gemm_flops_per_s=gemm,
        date=datetime.date.today().isoformat(),
    )


def _cpuinfo_field(name: str) -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition(":")[2].strip() for line in lines if line.startswith(name)), "")


def _flags() -> list[str]:
    present = set(_cpuinfo_field("flags").split())
    return [flag for flag in ("avx512f", "avx512_bf16", "amx_tile") if flag in present]


def _last_level_cache() -> int | None:
    """The largest cache /sys lists for cpu0 (L3 on x86), in bytes."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=None)


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---------------------------------------------------------------------------------------------- the model


def _complete_batch(client: httpx.Client, server: RunningServer, tokens: int, batch: int) -> tuple[float, int]:
    """Wall time of `batch` simultaneous greedy completions of exactly `tokens` tokens, and the prompt's tokens."""
    body = {"model": server.served_name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}

    def one(_: int) -> dict:
        response = client.post(f"{server.base_url}/completions", json=body, headers=server.auth_headers)
        if response.status_code != 200:
            server.check_engine()
            raise ServeError(f"/v1/completions answered HTTP {response.status_code}: {response.text[:200]}", file=server.log_path)
        return response.json()["usage"]

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=batch) as pool:
        usages = list(pool.map(one, range(batch)))
    elapsed = time.perf_counter() - started
    if any(usage["completion_tokens"] != tokens for usage in usages):
        raise ServeError(f"vLLM returned other than {tokens} tokens despite ignore_eos: {usages[0]}", file=server.log_path)
    return elapsed, int(usages[0]["prompt_tokens"])


def measure_decode(server: RunningServer, batch: int, repeats: int = REPEATS) -> MeasuredDecode:
    """One decode step at `batch` sequences, from the difference between LONG and SHORT completions."""
    steps = []
    with httpx.Client(timeout=httpx.Timeout(server.request_timeout_s)) as client:
        _, prompt_tokens = _complete_batch(client, server, LONG, batch)  # warm-up
        for _ in range(repeats):
            short, _ = _complete_batch(client, server, SHORT, batch)
            long, _ = _complete_batch(client, server, LONG, batch)
            steps.append((long - short) / (LONG - SHORT))
    step = statistics.median(steps)
    if step <= 0:
        raise ServeError(f"the LONG completions were not slower than the SHORT ones ({steps}): the host is too noisy to time",
                         file=server.log_path)
    return MeasuredDecode(batch=batch, step_s=step, step_samples=steps, tokens_per_s=batch / step, prompt_tokens=prompt_tokens)


def predicted(model_dir: Path, host: HostRates, served_dtype: str, context: int, batches: list[int]) -> tuple[ModelCalibration, list[RooflinePoint]]:
    """The roofline of the 16-bit model served in `served_dtype` on this host (its weights at that dtype's width)."""
    config = read_config_json(model_dir / "config.json")
    shape = model_shape(config, str(model_dir / "config.json"))
    shape = shape.model_copy(update={"param_bytes": SERVED_DTYPE_BYTES.get(served_dtype, shape.param_bytes)})
    weights = predict_weight_bytes(shape, None)
    _, kv_bytes = kv_element_bytes(shape, "auto", served_dtype)
    cost = step_cost(shape, None, weights, kv_bytes, context, installed_target())
    speed = roofline(cost, host.device(), context, batches)
    assert speed is not None  # the host's device always has a bandwidth
    cache = host.last_level_cache_bytes
    head = ModelCalibration(
        model=model_dir.name, served_dtype=served_dtype, weights_read_bytes=cost.weight_bytes,
        fits_in_cache=cache is not None and cost.weight_bytes <= cache, context=context, kernel=speed.kernel, rows=[],
    )
    return head, speed.points


def calibrate_model(model_dir: Path, host: HostRates, served_dtype: str, concurrency: int, log_dir: Path) -> ModelCalibration:
    """Serve the 16-bit model, measure its decode at 1 and `concurrency` sequences, and predict the same."""
    require_model_dir(model_dir, "model")
    batches = sorted({1, concurrency})
    settings = ServeSettings(max_num_seqs=max(batches))
    with vllm_server(model_dir, log_path=log_dir / f"vllm-{model_dir.name}.log", settings=settings) as server:
        measured = [measure_decode(server, batch) for batch in batches]
    context = measured[0].prompt_tokens + (SHORT + LONG) // 2
    head, points = predicted(model_dir, host, served_dtype, context, batches)
    rows = [CalibrationRow(batch=m.batch, predicted=p, measured=m) for m, p in zip(measured, points, strict=True)]
    return head.model_copy(update={"rows": rows})


def calibrate(model_dirs: list[Path], concurrency: int, log_dir: Path) -> Calibration:
    """Measure the host once, then each model: predicted and measured decode speed on this host."""
    served_dtype = ServeSettings().served_dtype()
    host = measure_host(served_dtype)
    return Calibration(host=host, models=[calibrate_model(d, host, served_dtype, concurrency, log_dir) for d in model_dirs])


def calibration_models() -> list[Path]:
    """The demo model and SmolLM2-135M (`quantize models add smollm2-135m` converts it offline): both must be there."""
    root = current_settings().root / "models"
    folders = [root / DEMO_MODEL_NAME, root / SMOLLM2]
    for folder in folders:
        if not is_model_dir(folder):
            hint = f"run `quantize models add {SMOLLM2}` (it converts offline)" if folder.name == SMOLLM2 else "the demo model ships there"
            raise InputError(f"no model folder {folder}: {hint}; or give --model DIR", field="model")
    return folders


# ------------------------------------------------------------------------------------------------ printing


def host_line(host: HostRates) -> str:
    flags = ", ".join(host.flags) or "no avx512f"
    cache = f", last-level cache {host.last_level_cache_bytes / MiB:g} MiB" if host.last_level_cache_bytes else ""
    return (f"{host.cpu_model} ({host.host_class}: {flags}{cache}), {host.threads} thread(s), {host.date}: read bandwidth "
            f"{host.bandwidth_bytes_per_s / 1e9:.1f} GB/s (median of {len(host.bandwidth_samples)}, {BANDWIDTH_BYTES // MiB} MiB), "
            f"{host.gemm_dtype} GEMM {host.gemm_flops_per_s / 1e9:.0f} GFLOP/s")


def calibration_cells(model: ModelCalibration, row: CalibrationRow) -> list[str]:
    point, steps = row.predicted, row.measured.step_samples
    return [
        model.model, f"{model.weights_read_bytes / MiB:.1f} MiB" + (" (fits in cache)" if model.fits_in_cache else ""),
        str(row.batch), f"{point.tokens_per_s:,.1f} ({point.bound}-bound)", f"{row.measured.tokens_per_s:,.1f}",
        f"{row.measured.step_s * 1e3:.2f} ({min(steps) * 1e3:.2f} to {max(steps) * 1e3:.2f})", f"{row.ratio:.2f}",
    ]


CALIBRATION_COLUMNS = ["model", "weights read / step", "sequences", "predicted tok/s (roofline)", "measured tok/s (vLLM)",
                       "step ms: median (range)", "measured / predicted"]


def render_calibration(result: Calibration) -> None:
    rows = [calibration_cells(model, row) for model in result.models for row in model.rows]
    say(table(f"Decode speed on this host: predicted ({BASIS}) vs measured", CALIBRATION_COLUMNS, rows))
    say(f"host: {host_line(result.host)}")
    for model in result.models:
        say(f"{model.model}: {model.served_dtype} weights, context {model.context} tokens, kernel {model.kernel}"
            + ("; its weights fit in the last-level cache, so DRAM bandwidth does not bind and the roofline is not the "
               "limit a decode step meets (launch, attention and Python overheads are)" if model.fits_in_cache else ""))
