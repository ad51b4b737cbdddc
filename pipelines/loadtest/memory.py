"""What a server holds: the KV capacity vLLM measured (its log) next to the planner's, and a memory watermark.

KV capacity: vLLM logs "CPU KV cache size: N tokens, Maximum concurrency for L tokens per request: Xx" (GPU
KV on CUDA) once it has sized its cache. The planner's kv_capacity_tokens predicts N for the same KV space:
on CPU that space is VLLM_CPU_KVCACHE_SPACE (ServeSettings.cpu_kv_cache_gib) with 128-token blocks
(vllm/platforms/cpu.py); on CUDA it is the "Available KV cache memory: X GiB" vLLM logs, with 16-token
blocks, so the prediction checks the per-token arithmetic, not the memory profile.

Memory watermark: the server's whole process group (API server, engine core, workers) sampled every
SAMPLE_S seconds while the load runs, from /proc: the sum of each process's proportional set size (PSS,
/proc/PID/smaps_rollup: shared pages such as torch's libraries counted once across the group), or of
resident set sizes where PSS cannot be read (then shared pages count once per process, an overestimate).
On a GPU this is host memory only; the device's is what vLLM's KV sizing and the planner describe.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from pipelines.artifact import served_kv_cache_dtype
from pipelines.loadtest.results import MemoryGain, ModelFigures
from pipelines.planner import GiB, kv_capacity_tokens
from pipelines.serve.serving import ServeSettings

SAMPLE_S = 0.5
CPU_BLOCK_SIZE = 128  # vLLM's CPU default (vllm/platforms/cpu.py) when --block-size is not given
CUDA_BLOCK_SIZE = 16
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens(?:, Maximum concurrency for ([\d,]+) tokens per request: ([\d.,]+)x)?")
AVAILABLE_KV = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
PSS = "PSS"
RSS = "RSS"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def measured_kv(log_path: Path) -> tuple[int | None, float | None]:
    """(tokens, maximum concurrency at max_model_len) from the server's log; None where it says nothing."""
    try:
        found = KV_LINE.search(log_path.read_text(errors="replace"))
    except OSError:
        return None, None
    if found is None:
        return None, None
    return int(_number(found.group(1))), _number(found.group(3)) if found.group(3) else None


def predicted_kv(model_dir: Path, serve: ServeSettings, target: str, log_path: Path) -> int | None:
    """The planner's KV tokens for the space this server had (see the module docstring)."""
    if target.split(":")[0] == "cpu":
        space, block = serve.cpu_kv_cache_gib * GiB, CPU_BLOCK_SIZE
    else:
        try:
            found = AVAILABLE_KV.search(log_path.read_text(errors="replace"))
        except OSError:
            found = None
        if found is None:
            return None
        space, block = int(float(found.group(1)) * GiB), CUDA_BLOCK_SIZE
    return kv_capacity_tokens(model_dir / "config.json", space, block_size=block, max_model_len=serve.max_model_len,
                              served_dtype=serve.served_dtype(), kv_cache_dtype=served_kv_cache_dtype(model_dir))


def _group_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return int(fields[2])  # pgrp: the field after state and ppid
    except (OSError, IndexError, ValueError):
        return None


def _pss_bytes(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_bytes(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def group_memory(groups: set[int]) -> dict[int, tuple[int, str]]:
    """{process group: (bytes, PSS or RSS)} for every live process in those groups."""
    totals: dict[int, list] = {group: [0, PSS] for group in groups}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        group = _group_of(pid)
        if group not in totals:
            continue
        pss = _pss_bytes(pid)
        if pss is None:
            totals[group][1] = RSS
        totals[group][0] += pss if pss is not None else _rss_bytes(pid)
    return {group: (value[0], value[1]) for group, value in totals.items()}


class MemorySampler:
    """Peak memory of process groups, sampled in a thread while the block runs:

        with MemorySampler({server.process.pid}) as sampler: ...
        sampler.peak[pgid] -> (bytes, "PSS" | "RSS")
    """

    def __init__(self, groups: set[int], interval_s: float = SAMPLE_S):
        self.groups = set(groups)
        self.interval_s = interval_s
        self.peak: dict[int, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loadtest memory", daemon=True)

    def sample(self) -> None:
        for group, (value, method) in group_memory(self.groups).items():
            if value > self.peak.get(group, (-1, PSS))[0]:
                self.peak[group] = (value, method)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weight_bytes(folder: Path) -> int | None:
    """Bytes of a model folder's weight files (what the server loads); None when it holds none."""
    try:
        sizes = [path.stat().st_size for path in folder.iterdir() if path.is_file() and path.suffix in WEIGHT_SUFFIXES]
    except OSError:
        return None
    return sum(sizes) if sizes else None


def memory_gain(models: list[ModelFigures], baseline_dir: Path, artifact_dir: Path | None) -> MemoryGain | None:
    """Weights and KV capacity of the candidate beside the baseline's (None: no candidate)."""
    if artifact_dir is None:
        return None
    kv = {model.role: model.kv_capacity_tokens for model in models}
    return MemoryGain(baseline_weight_bytes=weight_bytes(baseline_dir), candidate_weight_bytes=weight_bytes(artifact_dir),
                      baseline_kv_tokens=kv.get("baseline"), candidate_kv_tokens=kv.get("candidate"))
