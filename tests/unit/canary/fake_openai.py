"""A fake OpenAI-compatible completions server for the canary's tests: a toy language model whose next-token distribution
is a deterministic function of the context and of its `weights` (a seed), plus optional per-request noise, answering
/tokenize and /v1/completions as vLLM does (greedy, top-k log-probabilities keyed 'token_id:N')."""

from __future__ import annotations

import functools
import json
import math
import random
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VOCAB = 40
EOS = 2


class ToyModel:
    def __init__(self, weights: int = 0, *, noise: float = 0.0, perturb: float = 0.0, sharp: float = 4.0):
        self.weights, self.noise, self.perturb, self.sharp = weights, noise, perturb, sharp
        self.requests = 0

    def logprobs(self, context: list[int], jitter: random.Random) -> list[float]:
        fixed = _logits(tuple(context[-3:]), len(context), self.weights, self.sharp, self.perturb)
        logits = [value + self.noise * jitter.gauss(0, 1) for value in fixed] if self.noise else list(fixed)
        top = max(logits)
        norm = top + math.log(sum(math.exp(v - top) for v in logits))
        return [v - norm for v in logits]

    def complete(self, prompt: list[int], max_tokens: int, k: int) -> dict[str, Any]:
        self.requests += 1
        jitter = random.Random()
        context, tokens, rows = list(prompt), [], []
        for _ in range(max_tokens):
            lps = self.logprobs(context, jitter)
            order = sorted(range(VOCAB), key=lambda t: lps[t], reverse=True)
            chosen = order[0]
            tokens.append(f"token_id:{chosen}")
            rows.append({f"token_id:{t}": lps[t] for t in order[:k]})
            context.append(chosen)
            if chosen == EOS:
                break
        return {"choices": [{"text": " ".join(tokens), "logprobs": {"tokens": tokens, "top_logprobs": rows}}]}


@functools.lru_cache(maxsize=100_000)
def _logits(tail: tuple[int, ...], position: int, weights: int, sharp: float, perturb: float) -> tuple[float, ...]:
    """The weights' logits after a context (its last three tokens and its length): shared, plus this artifact's own."""
    base = random.Random(f"base:{list(tail)}:{position}")
    other = random.Random(f"w{weights}:{list(tail)}:{position}")
    return tuple(sharp * base.gauss(0, 1) + perturb * other.gauss(0, 1) for _ in range(VOCAB))


class FakeOpenAI(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the load pass opens dozens of connections at once (the default 5 drops SYNs: 1 s retries)

    def __init__(self, model: ToyModel, *, api_key: str | None = None, served: str = "demo", status: int = 200, delay_s: float = 0.0,
                 get: Callable[[BaseHTTPRequestHandler], None] | None = None):
        self.model, self.api_key, self.served, self.status, self.delay_s = model, api_key, served, status, delay_s
        self.get = get  # answers GET requests (a /metrics page: tests/unit/watch/metrics_pages.py), when given
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: FakeOpenAI

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.server.get is None:
            return self._send(404, {"error": "not found"})
        self.server.get(self)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if self.server.delay_s:
            time.sleep(self.server.delay_s)
        if self.server.api_key and self.headers.get("Authorization") != f"Bearer {self.server.api_key}":
            return self._send(401, {"error": "Unauthorized"})
        if self.path == "/tokenize":
            return self._send(200, {"tokens": [1] + [3 + ord(c) % (VOCAB - 3) for c in body["prompt"]]})
        if self.path != "/v1/completions":
            return self._send(404, {"error": "not found"})
        if body.get("model") != self.server.served:
            return self._send(404, {"error": f"model {body.get('model')} does not exist"})
        if self.server.status != 200:
            return self._send(self.server.status, {"error": "engine dead"})
        return self._send(200, self.server.model.complete(body["prompt"], body["max_tokens"], body["logprobs"]))
