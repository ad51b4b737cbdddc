"""How a memory plan reads for a person: one title, one row per scheme, the vLLM arguments.

Shared by `quantize plan` and the gate report (which shows the plan for the run's artifact), so the
two never present the same numbers differently.
"""

from __future__ import annotations

from pipelines.bounds import MiB
from pipelines.planner.gpus import GiB, known_gpus
from pipelines.planner.plan import Plan, PlanRow
from pipelines.planner.roofline import BASIS, Roofline, RooflinePoint

PLAN_COLUMNS = [
    "scheme", "weights", "KV/token KiB", "KV total", "activations", "overhead", "total", "fits",
    "max conc.", "max context", "recommended util / len / seqs", "vLLM KV tokens", "decode tok/s (predicted)",
]


DOES_NOT_APPLY = "does not apply"


def gib(value: int) -> str:
    return f"{value / GiB:.2f}"


def size(value: int) -> str:
    """GiB, or MiB for the small sizes a demo model has."""
    return f"{value / GiB:.2f} GiB" if value >= GiB / 10 else f"{value / MiB:.1f} MiB"


def plan_title(result: Plan) -> str:
    gpu = result.gpu
    bandwidth = f", {gpu.bandwidth_bytes_per_s / 1e9:g} GB/s" if gpu.bandwidth_bytes_per_s else ""
    device = f"{gpu.name} ({gib(gpu.memory_bytes)} GiB{bandwidth})" if gpu.name in known_gpus() else f"{gpu.name}{bandwidth}"
    kernels = f" (recipes checked for {result.target})" if result.target else ""
    layers = f"; layers: {result.attention}" if result.attention else ""
    return f"{result.model} on {device}: {result.max_model_len:,} tokens x {result.concurrency} sequences{layers}{kernels}"


def plan_row_cells(row: PlanRow) -> list[str]:
    advice = row.recommended
    return [
        row.scheme + (" (measured)" if row.weights_source == "measured" else ""),
        size(row.weights_bytes), f"{row.kv_cache_bytes_per_token / 1024:g}", size(row.kv_cache_bytes),
        size(row.activation_bytes), size(row.overhead_bytes), size(row.total_bytes),
        fits_cell(row), f"{row.max_concurrency:,}", f"{row.max_context:,}",
        f"{advice.gpu_memory_utilization:.2f} / {advice.max_model_len:,} / {advice.max_num_seqs}" if advice else "-",
        f"{row.vllm_kv_tokens:,}" if row.vllm_kv_tokens is not None else "-",
        f"{row.decode_tokens_per_s:,.0f}" if row.decode_tokens_per_s is not None else "-",
    ]


def fits_cell(row: PlanRow) -> str:
    """yes / NO, or `does not apply` for a recipe the model cannot take (the reason follows the table)."""
    if row.does_not_apply is not None:
        return DOES_NOT_APPLY
    return "yes" if row.fits else "NO"


def vllm_arguments(row: PlanRow) -> str:
    if row.does_not_apply is not None:
        return f"{DOES_NOT_APPLY}: {row.does_not_apply}"
    return f"vllm serve ... {row.recommended.vllm_args}" if row.recommended else "does not fit at any context"


def roofline_point_text(point: RooflinePoint) -> str:
    streams = "1 stream" if point.batch == 1 else f"{point.batch} streams"
    return f"{streams} {point.tokens_per_s:,.0f} tok/s ({point.bound}-bound)"


def roofline_text(scheme: str, speed: Roofline) -> str:
    """One scheme's predicted decode speed, e.g. `w8a8: predicted 1 stream 190 tok/s (memory-bound), 16 streams ...;
    kernel CutlassInt8ScaledMMLinearKernel`."""
    points = ", ".join(roofline_point_text(point) for point in speed.points)
    return f"{scheme}: {speed.source} {points} at {speed.context:,} tokens of context; kernel {speed.kernel}"


def roofline_lines(result: Plan) -> list[str]:
    """The roofline lines under a plan's table, with what they are (none when no row has a bandwidth)."""
    lines = [roofline_text(row.scheme, row.roofline) for row in result.rows if row.roofline]
    return [f"Decode speed, {BASIS}:", *lines] if lines else []
