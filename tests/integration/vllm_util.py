"""Ask a running vLLM server (pipelines.serve.serving.vllm_server) for one greedy completion."""

from __future__ import annotations

from typing import Any

import httpx

from pipelines.serve.serving import RunningServer, log_tail


def complete(server: RunningServer, prompt: str, *, max_tokens: int = 4) -> dict[str, Any]:
    """The JSON of one greedy /v1/completions answer."""
    response = httpx.post(
        f"{server.base_url}/completions",
        json={"model": server.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers=server.auth_headers, timeout=server.request_timeout_s,
    )
    assert response.status_code == 200, f"vLLM answered {response.status_code}: {response.text[:300]} | {log_tail(server.log_path)}"
    return response.json()
