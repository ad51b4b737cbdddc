"""A fake vLLM /metrics server for the unit tests of `quantize watch`: pages in vLLM 0.32's own format (the series and
buckets a real server exported, tests/integration checks against a real one), driven by a mutable state, served over
real HTTP on loopback, plus hostile pages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
BATCH_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
LABELS = 'engine="0",model_name="demo-llama"'


@dataclass
class State:
    """What the fake server has done so far (cumulative), and its gauges now."""

    finished: dict[str, float] = field(default_factory=lambda: {"stop": 0.0, "length": 0.0, "abort": 0.0, "error": 0.0})
    http: dict[str, float] = field(default_factory=lambda: {"2xx": 0.0, "4xx": 0.0, "5xx": 0.0})
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    batch: list[float] = field(default_factory=list)
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    preemptions: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    kv_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    memory: float = 100 * 2**20
    started: float = 1796306253.55
    num_blocks: int = 2048
    rejected: float = 0.0  # vllm:admission_rejections_total (each also answered 503)
    corrupted: float | None = None  # vllm:corrupted_requests_total; None: a server without VLLM_COMPUTE_NANS_IN_LOGITS=1

    def reject(self, requests: int) -> None:
        self.rejected += requests
        self.http["5xx"] += requests

    def serve(self, requests: int, *, ttft: float, itl: float, tokens: int = 10, reason: str = "length") -> None:
        for _ in range(requests):
            self.finished[reason] += 1
            self.http["5xx" if reason == "error" else "2xx"] += 1
            self.ttft.append(ttft)
            self.itl.extend([itl] * (tokens - 1))
            self.batch.append(float(requests))
            self.generation_tokens += tokens
            self.prompt_tokens += 20
            self.prefix_queries += 20


def _histogram(name: str, bounds: list[float], values: list[float]) -> list[str]:
    lines = [f"# TYPE {name} histogram"]
    for bound in bounds:
        lines.append(f'{name}_bucket{{{LABELS},le="{float(bound)}"}} {float(sum(v <= bound for v in values))}')
    lines.append(f'{name}_bucket{{{LABELS},le="+Inf"}} {float(len(values))}')
    lines += [f"{name}_count{{{LABELS}}} {float(len(values))}", f"{name}_sum{{{LABELS}}} {float(sum(values))}",
              f"{name}_created{{{LABELS}}} 1.7963064069e+09"]
    return lines


def page(state: State) -> str:
    lines = [
        "# HELP python_gc_objects_collected_total Objects collected during gc", "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 1234.0',
        f"process_resident_memory_bytes {state.memory}", f"process_start_time_seconds {state.started}",
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{LABELS}}} {state.running}",
        f"vllm:num_requests_waiting{{{LABELS}}} {state.waiting}", f"vllm:kv_cache_usage_perc{{{LABELS}}} {state.kv_usage}",
        f"vllm:prefix_cache_queries_total{{{LABELS}}} {state.prefix_queries}", f"vllm:prefix_cache_hits_total{{{LABELS}}} {state.prefix_hits}",
        f"vllm:num_preemptions_total{{{LABELS}}} {state.preemptions}", f"vllm:num_preemptions_created{{{LABELS}}} 1.79e+09",
        f"vllm:prompt_tokens_total{{{LABELS}}} {state.prompt_tokens}", f"vllm:generation_tokens_total{{{LABELS}}} {state.generation_tokens}",
    ]
    lines += [f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="demo-llama"}} {count}'
              for reason, count in state.finished.items()]
    lines += [f'http_requests_total{{handler="/v1/completions",method="POST",status="{status}"}} {count}'
              for status, count in state.http.items()]
    lines.append('http_requests_total{handler="/metrics",method="GET",status="2xx"} 999.0')
    lines += [f'vllm:admission_rejections_total{{model_name="demo-llama",reason="{reason}"}} {count}'
              for reason, count in (("max_num_queued_reqs", state.rejected), ("max_num_queued_tokens", 0.0))]
    if state.corrupted is not None:
        lines.append(f"vllm:corrupted_requests_total{{{LABELS}}} {state.corrupted}")
    lines += _histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS, state.ttft)
    lines += _histogram("vllm:inter_token_latency_seconds", ITL_BUCKETS, state.itl)
    lines += _histogram("vllm:e2e_request_latency_seconds", TTFT_BUCKETS, [t + 0.5 for t in state.ttft])
    lines += _histogram("vllm:iteration_tokens_total", BATCH_BUCKETS, state.batch)
    lines.append(f'vllm:cache_config_info{{block_size="128",engine="0",kv_cache_max_concurrency="{state.num_blocks * 128 / 512}",'
                 f'kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="{state.num_blocks * 128}",num_gpu_blocks="{state.num_blocks}"}} 1.0')
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.respond(self)  # type: ignore[attr-defined]


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, respond: Callable[[BaseHTTPRequestHandler], None]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.respond = respond

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up on purpose (a size or time limit) is not news

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/metrics"


def send(handler: BaseHTTPRequestHandler, body: bytes, status: int = 200, delay_s: float = 0.0) -> None:
    time.sleep(delay_s)
    handler.send_response(status)
    handler.send_header("Content-Type", "text/plain; version=0.0.4")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextmanager
def serving(respond: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[MetricsServer]:
    server = MetricsServer(respond)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def live(state: State, on_read: Callable[[State, int], None] = lambda state, reads: None) -> Callable[[BaseHTTPRequestHandler], None]:
    """A responder that serves the state's page, calling `on_read(state, reads)` before each read (to drive it)."""
    reads = [0]

    def respond(handler: BaseHTTPRequestHandler) -> None:
        reads[0] += 1
        on_read(state, reads[0])
        send(handler, page(state).encode())

    return respond
