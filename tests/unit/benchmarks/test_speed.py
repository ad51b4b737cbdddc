"""`make bench-speed`'s own parts without vLLM: the independent interleaved check against two real HTTP servers of
known speed, and the table's rows."""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines.benchmarks import speed
from pipelines.benchmarks.speed_peer import PeerRow


def slow_server(delay_s: float) -> tuple[ThreadingHTTPServer, SimpleNamespace]:
    """An OpenAI-style /v1/completions endpoint that answers after `delay_s` (requests served in parallel threads)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["max_tokens"] == speed.CHECK_TOKENS and body["temperature"] == 0 and self.headers["Authorization"] == "Bearer k"
            time.sleep(delay_s)
            payload = json.dumps({"choices": [{"text": "x"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            return None

    class Server(ThreadingHTTPServer):
        request_queue_size = 64  # the default 5 drops connections at concurrency 8, and SYN retries cost a second

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = SimpleNamespace(served_name="m", base_url=f"http://127.0.0.1:{server.server_port}/v1", request_timeout_s=10.0,
                              auth_headers={"Authorization": "Bearer k"})
    return server, address


@pytest.mark.slow  # about 8 s of deliberate server delays: make test runs it, make test-fast leaves it out
def test_the_independent_check_measures_the_ratio_of_two_servers_of_known_speed():
    fast, fast_address = slow_server(0.05)
    slow, slow_address = slow_server(0.1)
    try:
        check = speed.independent_check(fast_address, slow_address, ["a", "b", "c"])  # type: ignore[arg-type]
    finally:
        fast.shutdown()
        slow.shutdown()
    # 0.5 in theory; threads and HTTP add a little. On a loaded host one round can swing (CI, 7 December: 0.52, 2.19, 0.82,
    # 0.52), so the known answer is checked on the rounds' median, and the estimate against its definition.
    assert len(check.ratios) == speed.CHECK_ROUNDS and 0.35 < statistics.median(check.ratios) < 0.75
    assert check.estimate == pytest.approx(math.exp(statistics.fmean(math.log(r) for r in check.ratios)), rel=1e-3)


def test_a_refused_recipe_is_a_row_that_says_why():
    row = speed.SpeedRow(model="demo-llama", recipe="fp8", refused="no FP8 kernel without AMX")
    cells = row.cells()
    assert cells[:3] == ["demo-llama", "fp8", "refused here: no FP8 kernel without AMX"] and len(cells) == len(speed.COLUMNS)


def test_the_table_names_the_host_and_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(speed, "host_profile", lambda: SimpleNamespace(host_class="cpu:avx512bf16", cpu_model="AMD EPYC", vllm_version="0.32.0"))
    peer = PeerRow(model="demo-llama", kind="q8_0", refused="no .venv-llamacpp")
    text = speed.markdown([speed.SpeedRow(model="demo-llama", recipe="fp8", refused="no kernel")], [peer], "T", 12.0)
    assert "host class cpu:avx512bf16 (AMD EPYC" in text and "| demo-llama | fp8 | refused here: no kernel |" in text
    assert "## The peer: llama.cpp" in text and "| demo-llama | q8_0 | not measured: no .venv-llamacpp |" in text
