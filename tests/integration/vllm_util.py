"""Serve a model folder with the real vLLM (serve environment), ask one completion, stop the server.

Built on pipelines.serving.vllm_server, which runs the model's bf16 with AMX reported unavailable inside
the server: on these VMs vLLM's AMX attention kernel dies with SIGILL ("tilezero", seen in gdb), and its
int8 W8A8 kernel refuses float16 while AMX is reported, so neither plain bf16 nor float16 serves W8A8.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx

from pipelines.serving import ServeSettings, log_tail, vllm_server


def complete_once(model_dir: Path, prompt: str = "Ticket 7: order", *, max_tokens: int = 4) -> dict[str, Any]:
    """The JSON of one greedy /v1/completions answer from vLLM serving `model_dir`."""
    with tempfile.TemporaryDirectory(prefix="vllm-test-") as scratch:
        log_path = Path(scratch) / "vllm.log"
        with vllm_server(model_dir, log_path=log_path, settings=ServeSettings(max_model_len=256)) as server:
            response = httpx.post(
                f"{server.base_url}/completions",
                json={"model": server.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                timeout=server.request_timeout_s,
            )
            assert response.status_code == 200, f"vLLM answered {response.status_code}: {response.text[:300]} | {log_tail(log_path)}"
            return response.json()
