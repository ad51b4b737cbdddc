"""`make bench-speed`'s peer: llama.cpp, what a CPU user would pick instead of vLLM, on the same model.

The model's GGUF files (pipelines/models/gguf_build.py: F16 written from the same safetensors vLLM serves, checked against
the model's own logits; Q8_0 and Q4_K_M by llama.cpp's quantizer) are served one at a time by llama-cpp-python's server
(pipelines/serve/llamacpp.py) beside the 16-bit vLLM server, and the load test's paired comparison measures each against
it, as it measures a recipe's artifact. Two differences, both printed with the figures:
- every request asks for a fixed number of output tokens (PEER_OUTPUT_TOKENS, both servers): llama.cpp drops vLLM's
  `ignore_eos` and stops early at EOS unless `min_tokens` holds it (vllm bench's --extra-body), so the two do the same work;
- llama-cpp-python's server computes one request at a time (the others queue), while vLLM batches up to max_num_seqs:
  at the policy's concurrency that is the deployment a CPU user would get from it, and the table says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import Field

from pipelines.errors import QuantGateError
from pipelines.loadtest import bench
from pipelines.loadtest.results import Role, SpeedComparison
from pipelines.loadtest.stage import paired_comparison
from pipelines.loadtest.verdict import ratio_text
from pipelines.runs.loadtest import Options, stage_inputs
from pipelines.schema import StrictModel
from pipelines.serve.serving import RunningServer

PEER_OUTPUT_TOKENS = 16
PEER_KINDS = ("q8_0", "q4_k_m")
COLUMNS = ["Model", "llama.cpp GGUF", "File MiB (x 16-bit)", "Throughput", "Throughput ratio", "TTFT p95 ratio", "Pairs (stopped)",
           "Seconds", "Logit check"]


class PeerRow(StrictModel):
    model: str
    kind: str
    refused: str | None = None
    comparison: SpeedComparison | None = None
    file_bytes: int | None = None
    baseline_bytes: int | None = None
    check: str | None = Field(default=None, description="the GGUF against the HF model's logits on the same token ids")
    serves_at_once: int | None = None

    def cells(self) -> list[str]:
        if self.comparison is None:
            return [self.model, self.kind, f"not measured: {self.refused}", *["-"] * (len(COLUMNS) - 3)]
        speed = self.comparison
        size = "-" if self.file_bytes is None else f"{self.file_bytes / 2**20:,.1f}"
        if self.file_bytes and self.baseline_bytes:
            size += f" ({self.file_bytes / self.baseline_bytes:.2f}x)"
        return [self.model, self.kind, size, speed.throughput.outcome, ratio_text(speed.throughput.interval),
                ratio_text(speed.ttft_p95.interval), f"{len(speed.pairs)} ({speed.stopped})", f"{speed.seconds:.0f}", self.check or "-"]


PEER_BUDGET_S = 180.0  # a server that computes one request at a time needs longer runs at the policy's concurrency


def peer_options(chosen: Options, budget_s: float) -> Options:
    """The load test's options with fixed-length outputs (the same for both servers) and the peer's own budget."""
    performance = chosen.performance
    load = performance.load.model_copy(update={"output_tokens": PEER_OUTPUT_TOKENS})
    budget = performance.comparison.model_copy(update={"budget_s": budget_s})
    return chosen.model_copy(update={"performance": performance.model_copy(update={"load": load, "comparison": budget})})


def peer_rows(model_name: str, chosen: Options, baseline: RunningServer, driver: bench.BenchDriver, folder: Path,
              baseline_bytes: int | None, budget_s: float = PEER_BUDGET_S) -> list[PeerRow]:
    """Each GGUF kind of the model against the running 16-bit vLLM server (a row that says why when it cannot run)."""
    from pipelines.models.gguf_build import build_ggufs  # needs .venv-llamacpp

    try:
        ggufs = build_ggufs(chosen.model)
    except QuantGateError as error:
        return [PeerRow(model=model_name, kind=kind, refused=str(error).splitlines()[0]) for kind in PEER_KINDS]
    checks = {check.kind: check for check in ggufs.checks}
    rows = []
    for kind in PEER_KINDS:
        check = checks.get(kind)
        words = f"top-1 {check.top1_agreement:.1%}, KL {check.mean_kl_nats:.2g} nats" if check is not None else None
        rows.append(_one(model_name, kind, ggufs.files[kind], peer_options(chosen, budget_s), baseline, driver, folder / f"llamacpp-{kind}",
                         baseline_bytes, words))
    return rows


def _one(model_name: str, kind: str, gguf: Path, chosen: Options, baseline: RunningServer, driver: bench.BenchDriver, folder: Path,
         baseline_bytes: int | None, check: str | None) -> PeerRow:
    from pipelines.serve.llamacpp import fixed_length_body, llamacpp_server

    options = chosen
    top = options.performance.load.max_concurrency or (options.fit.concurrency if options.fit else None) or options.serve.max_num_seqs
    inputs = stage_inputs(options.model_copy(update={"artifact": options.model}), folder)  # llama.cpp counts tokens with the HF tokenizer
    extra: dict[Role, list[str]] = {"candidate": ["--extra-body", json.dumps(fixed_length_body(PEER_OUTPUT_TOKENS))]}
    try:
        with llamacpp_server(gguf, log_path=folder / "llamacpp-server.log", threads=max(1, (os.cpu_count() or 2) - 1),
                             ctx=options.serve.max_model_len * 2, parallel=top, model_dir=options.model, served_name="candidate") as peer:
            speed = paired_comparison(inputs, {"baseline": baseline, "candidate": peer}, driver, extra)
            serves = getattr(peer, "serves_at_once", None)
    except QuantGateError as error:
        return PeerRow(model=model_name, kind=kind, refused=str(error).splitlines()[0])
    return PeerRow(model=model_name, kind=kind, comparison=speed, file_bytes=gguf.stat().st_size, baseline_bytes=baseline_bytes,
                   check=check, serves_at_once=serves)


def markdown(rows: list[PeerRow]) -> list[str]:
    if not rows:
        return []
    return [
        "## The peer: llama.cpp (llama-cpp-python's server) beside the same 16-bit vLLM server",
        "",
        f"Every request of both servers generates {PEER_OUTPUT_TOKENS} tokens (llama.cpp held by `min_tokens`); llama-cpp-python "
        "computes one request at a time and queues the rest, vLLM batches them: the ratio is what a CPU user gets from each "
        "at the policy's concurrency. File: the GGUF against the 16-bit model's weight files.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
        *("| " + " | ".join(row.cells()) + " |" for row in rows),
    ]
