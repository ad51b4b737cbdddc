"""The product's one health probe (pipelines/serve/health.py) against a real HTTP server in this process: 200 is healthy,
anything else is not, a closed port is refused, a silent server is no answer within the one timeout; the key check
tells our server from another."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from http_stand_in import HttpStandIn, Request

from pipelines.serve import health
from pipelines.serve.serving import free_port


class Server(HttpStandIn):
    """Answers /health with `status` after `delay_s`; /v1/models lists `name` to whoever sends `key`."""

    def __init__(self, status: int = 200, delay_s: float = 0.0, name: str = "m", key: str = "ours"):
        self.status, self.delay_s, self.name, self.key = status, delay_s, name, key
        super().__init__(self._answer)

    def _answer(self, request: Request) -> tuple[int, bytes]:
        if request.path == "/health":
            time.sleep(self.delay_s)
            return self.status, b""
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return 401, b"{}"
        return 200, json.dumps({"data": [{"id": self.name}]}).encode()


@pytest.fixture
def server() -> Iterator[Server]:
    running = Server()
    yield running
    running.close()


def test_healthy_is_200_from_health_and_nothing_else(server: Server) -> None:
    assert health.probe_health(server.port) == "ok" and health.healthy(server.port)
    server.status = 503
    assert health.probe_health(server.port) == "error" and not health.healthy(server.port)
    assert health.probe_health(None) == "not running"
    assert health.probe_health(free_port()) == "refused"


def test_a_server_slower_than_the_one_timeout_is_no_answer(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "HEALTH_TIMEOUT_S", 0.2)  # the policy's value, shortened for the test's time
    server.delay_s = 5.0  # far past the timeout: the bound below holds on a loaded CI host and still needs the timeout
    started = time.monotonic()
    assert health.probe_health(server.port) == "no answer"
    assert time.monotonic() - started < 3.0


def test_the_key_check_tells_our_server_from_another(server: Server) -> None:
    with httpx.Client() as client:
        assert health.key_problem(client, server.port, served_name="m", api_key="ours") == ""
        assert "HTTP 401" in health.key_problem(client, server.port, served_name="m", api_key="theirs")
        assert "not 'other'" in health.key_problem(client, server.port, served_name="other", api_key="ours")
        assert "ConnectError" in health.key_problem(client, free_port(), served_name="m", api_key="ours")
