"""What each Ray task asks the cluster for, from the candidate's plan, and whether any node can give it.

On a CUDA serve target a task asks for `num_gpus` = the tensor-parallel size the planner needs for the
candidate's fit GPU (the policy's `fit:`): the smallest of 1, 2, 4, 8 that divides the model's attention
heads (vLLM's rule) and at which the plan fits, the GPU's memory counted that many times
(docs/planner.md: "plan one GPU's share by giving --gpu-memory-gib x TP"); without a fit requirement, 1.
Ray never puts two tasks on one GPU, so no two candidates share one.

On the CPU target (vLLM's CPU build) a task asks for CPUs and memory: the 16-bit weights three times over
while quantizing (model, copy, calibration activations) and, while gating, two vLLM servers at once (the
baseline's and the candidate's stay up for the load test), each its measured resident overhead, the KV
space it is given and its weights.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from pipelines.bounds import GiB
from pipelines.errors import InputError
from pipelines.gate.policy import FitRequirement
from pipelines.hardware.targets import ServeTarget
from pipelines.planner import gpu_spec, load_config, model_shape, plan, predict_weight_bytes
from pipelines.recipe import LoadedRecipe, Recipe
from pipelines.schema import FrozenModel

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
# A vLLM CPU server's own resident memory for the demo model: 2.5-2.9 GiB measured (README, load test).
CPU_SERVER_OVERHEAD_BYTES = 3 * GiB
CPU_SERVERS_AT_ONCE = 2
QUANTIZE_WEIGHT_COPIES = 3
QUANTIZE_OVERHEAD_BYTES = 2 * GiB  # torch, llm-compressor and transformers loaded
CPU_TASK_CPUS = 1.0


class TaskResources(FrozenModel):
    """One task's request, as Ray takes it (`.options(**ray_options())`), and why."""

    num_cpus: float = Field(ge=0)
    num_gpus: int = Field(default=0, ge=0)
    memory_bytes: int = Field(ge=0)
    why: str

    def ray_options(self) -> dict[str, float | int]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "memory": self.memory_bytes}

    def describe(self) -> str:
        gpus = f"{self.num_gpus} GPU(s), " if self.num_gpus else ""
        return f"{gpus}{self.num_cpus:g} CPU(s), {self.memory_bytes / GiB:.1f} GiB memory ({self.why})"

    def fits(self, node: dict[str, float]) -> bool:
        """Whether a node with these total resources (Ray's names: CPU, GPU, memory) can run the task."""
        return (
            node.get("CPU", 0.0) >= self.num_cpus
            and node.get("GPU", 0.0) >= self.num_gpus
            and node.get("memory", 0.0) >= self.memory_bytes
        )


def task_resources(
    model_dir: Path, recipe: LoadedRecipe | None, fit: FitRequirement | None, target: ServeTarget, *, cpu_kv_cache_gib: int,
) -> TaskResources:
    """The request of a task that quantizes `recipe` (None: the 16-bit baseline) of `model_dir` and serves it."""
    weights = _sixteen_bit_weight_bytes(model_dir)
    host_memory = QUANTIZE_OVERHEAD_BYTES + QUANTIZE_WEIGHT_COPIES * weights
    if target.kind == "cuda":
        if fit is None:
            return TaskResources(num_cpus=1, num_gpus=1, memory_bytes=host_memory, why="no fit GPU in the policy: 1 GPU")
        size = tensor_parallel_size(model_dir, None if recipe is None else recipe.recipe, fit)
        return TaskResources(num_cpus=1, num_gpus=size, memory_bytes=host_memory, why=f"tensor-parallel {size} on {_gpu_name(fit)}")
    serving = CPU_SERVERS_AT_ONCE * (CPU_SERVER_OVERHEAD_BYTES + cpu_kv_cache_gib * GiB + weights)
    return TaskResources(num_cpus=CPU_TASK_CPUS, memory_bytes=max(host_memory, serving), why="CPU target: vLLM's CPU build")


def tensor_parallel_size(model_dir: Path, recipe: Recipe | None, fit: FitRequirement) -> int:
    """The smallest tensor-parallel size whose plan fits `fit`'s GPU; the largest allowed when none does (the
    gate's fit check then says why; the candidate still gets the most memory the sizes offer)."""

    config = model_dir / "config.json"
    heads = model_shape(*load_config(config)).heads
    allowed = [size for size in TENSOR_PARALLEL_SIZES if heads % size == 0]
    one_gpu = gpu_spec(fit.gpu, fit.memory_gib)
    for size in allowed:
        gpu = one_gpu.model_copy(update={"memory_bytes": one_gpu.memory_bytes * size, "name": f"{size} x {one_gpu.name}"})
        if plan(config, [recipe], gpu, fit.max_model_len, fit.concurrency).rows[0].fits:
            return size
    return allowed[-1]


def _sixteen_bit_weight_bytes(model_dir: Path) -> int:
    """The source model's weights as the planner predicts them from config.json (what quantize loads)."""

    return predict_weight_bytes(model_shape(*load_config(model_dir / "config.json")), None).total_bytes


def _gpu_name(fit: FitRequirement) -> str:
    return fit.gpu or f"{fit.memory_gib:g} GiB GPUs"


def check_some_node_fits(requests: dict[str, TaskResources], nodes: list[dict[str, float]], *, file: Path) -> None:
    """InputError naming the first task (by its label) that no node of the cluster can run, and what it needs."""
    for label, request in requests.items():
        if not any(request.fits(node) for node in nodes):
            largest = ", ".join(_node_summary(node) for node in nodes) or "no node alive"
            raise InputError(
                f"no node of the Ray cluster can run {label}: it needs {request.describe()}; the nodes have: {largest}",
                file=file, field="executor",
            )


def _node_summary(node: dict[str, float]) -> str:
    return f"{node.get('GPU', 0):g} GPU(s) {node.get('CPU', 0):g} CPU(s) {node.get('memory', 0) / GiB:.1f} GiB"
