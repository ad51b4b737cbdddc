"""The llama.cpp peer for real (`make bench-speed` runs this file by name; `pytest tests` does not collect it: its name
is not test_*.py, and it needs .venv-llamacpp, which `make setup` does not build, to compile llama.cpp for minutes).

The demo model's GGUF set is built and checked (pipelines.models.gguf_build), served by llama-cpp-python's server, and
asked what `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name custom` asks: a streamed
completion of prompt text, greedy, with ignore_eos (which llama.cpp drops) and min_tokens (which it honours).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pipelines.models.gguf_build import GgufSet, build_ggufs
from pipelines.serve.llamacpp import LlamaCppServer, fixed_length_body, llamacpp_server

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-llama"
PROMPT = "Transfer of 897.39 EUR, reference 3505 3677 7391 6324\nCanonical reference:"  # eval_sets/payment_reference
ANSWER = " 3505-3677-7391-6324"


@pytest.fixture(scope="module")
def demo_set() -> GgufSet:
    return build_ggufs(DEMO)


@pytest.fixture(scope="module")
def server(demo_set: GgufSet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppServer]:
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    with llamacpp_server(demo_set.files["f16"], log_path=log, threads=2, ctx=512, parallel=2, model_dir=DEMO) as running:
        yield running


def stream(server: LlamaCppServer, body: dict) -> tuple[list[str], float, float]:
    """A streamed completion as vllm bench reads it: the text of each token's chunk (llama-cpp-python ends with one more
    chunk, empty text and the finish reason), the time to the first chunk and to the last."""
    payload = {"model": server.served_name, "prompt": PROMPT, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "repetition_penalty": 1.0, **body}
    texts, started, first = [], time.perf_counter(), 0.0
    with httpx.stream("POST", f"{server.base_url}/completions", json=payload, headers=server.auth_headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "usage" not in chunk or chunk["usage"] is None or chunk["choices"]  # no usage-only chunk
            if chunk.get("choices"):
                first = first or time.perf_counter() - started
                if chunk["choices"][0]["finish_reason"] is None:
                    texts.append(chunk["choices"][0]["text"])
                else:
                    assert chunk["choices"][0]["text"] == ""
    return texts, first, time.perf_counter() - started


def test_the_demo_models_ggufs_compute_the_model(demo_set: GgufSet) -> None:
    checks = {check.kind: check for check in demo_set.checks}
    assert checks["f16"].top1_agreement == 1.0 and checks["f16"].mean_kl_nats <= 1e-4
    assert checks["q8_0"].top1_agreement >= 0.95
    assert checks["q4_k_m"].bytes < checks["q8_0"].bytes < checks["f16"].bytes


def test_a_greedy_completion_answers_as_the_model_does(server: LlamaCppServer) -> None:
    response = httpx.post(f"{server.base_url}/completions", headers=server.auth_headers, timeout=120,
                          json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "stop": ["\n"], "repeat_penalty": 1.0})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == ANSWER


def test_ignore_eos_is_dropped_and_min_tokens_gives_fixed_length_streams(server: LlamaCppServer) -> None:
    chunks, _, _ = stream(server, {"max_tokens": 32, "ignore_eos": True})
    assert len(chunks) < 32  # the model says EOS after the answer: ignore_eos changed nothing
    chunks, ttft, total = stream(server, {"max_tokens": 32, "ignore_eos": True, **fixed_length_body(32)})
    assert len(chunks) == 32 and 0 < ttft < total  # one chunk per token


def test_concurrent_streams_are_served_one_at_a_time_and_none_is_cut(server: LlamaCppServer) -> None:
    results: list[tuple[list[str], float, float]] = []
    threads = [threading.Thread(target=lambda: results.append(stream(server, {"max_tokens": 64, **fixed_length_body(64)})))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [len(chunks) for chunks, _, _ in results] == [64, 64]  # interrupt_requests is off: no stream cut short
    (_, _, first_total), (_, second_ttft, _) = sorted(results, key=lambda result: result[1])
    assert second_ttft >= 0.8 * first_total  # the second waited for the first: one at a time
