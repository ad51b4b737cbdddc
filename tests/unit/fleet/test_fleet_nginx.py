"""The proxy's chain on the real nginx (docs/fleet.md), with stand-in routes in this process: overload (a 503/429 of a route,
or its max_conns reached) goes down the chain without opening the route's breaker, a failure (500) opens it; no route
answering is 529 when one was busy and 503 when all were down; a reload starts every breaker closed; and reloads under
kept-alive client connections lose no request. The proxy's log is read back through traffic.py, as `serve status` does."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from http_stand_in import HttpStandIn, Request

from pipelines.fleet.deployment import Deployment
from pipelines.fleet.nginx import PROBE_PREFIX, ProxyLayout, Upstream, render_config, write_config
from pipelines.fleet.proxy import NginxProcess, check_config
from pipelines.fleet.traffic import LogTail, TrafficCounter
from pipelines.serve.serving import free_port

NGINX = shutil.which("nginx", path="/usr/sbin:/usr/bin:/sbin:/bin")
pytestmark = pytest.mark.skipif(NGINX is None, reason="Debian's nginx is not installed (make setup)")


class StandIn(HttpStandIn):
    """A route's server: answers every request with `status` (after `delay_s`), naming itself."""

    def __init__(self, name: str, status: int = 200, delay_s: float = 0.0):
        self.name, self.status, self.delay_s = name, status, delay_s
        self.entered = threading.Event()  # set when a request reaches it
        super().__init__(self._answer)

    def _answer(self, request: Request) -> tuple[int, bytes]:
        self.entered.set()
        time.sleep(self.delay_s)
        return self.status, json.dumps({"route": self.name}).encode()


class Proxy:
    """The product's config for a two-route chain (failures_to_open 1, retry_after 30 s), run by the real nginx through the
    product's own process life (pipelines/fleet/proxy.py)."""

    def __init__(self, folder: Path, ports: list[int], *, max_conns: int = 8, on_http_503: bool = True):
        self.deployment = Deployment.model_validate({
            "name": "unit", "primary": "m@1", "fallbacks": ["m@2"], "circuit_breaker": {"failures_to_open": 1, "retry_after_s": 30},
            "rules": {"overload": {"on_http_503": on_http_503}}})
        self.layout = ProxyLayout(prefix=folder, listen_host="127.0.0.1", listen_port=free_port(), sentinel_port=free_port(),
                                  client_key=secrets.token_urlsafe(32))
        self.labels = ["primary", "fallback-1"]
        self.write(ports, max_conns)
        self.nginx = NginxProcess(Path(NGINX or "nginx"), self.layout)
        self.nginx.start()
        self.counter = TrafficCounter(self.labels, self.layout.sentinel_port)
        self.ports = {port: index for index, port in enumerate(ports)}

    def write(self, ports: list[int], max_conns: int) -> None:
        upstreams = [Upstream(label=label, address=f"127.0.0.1:{port}", api_key="k", timeout_s=5.0, max_conns=max_conns)
                     for label, port in zip(self.labels, ports, strict=True)]
        write_config(self.layout, render_config(self.deployment, self.layout, upstreams))
        check_config(Path(NGINX or "nginx"), self.layout)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.layout.listen_port}{path}"

    def ask(self, client: httpx.Client | None = None) -> httpx.Response:
        send = client.post if client is not None else httpx.post
        return send(self.url("/v1/completions"), json={"prompt": "x"}, headers={"Authorization": f"Bearer {self.layout.client_key}"},
                    timeout=10)

    def reload(self) -> None:
        assert self.nginx.reload()

    def traffic(self):
        time.sleep(0.3)  # nginx writes its log lines as each request ends
        self.counter.feed(LogTail(self.layout.access_log).new_lines(), LogTail(self.layout.error_log).new_lines(), self.ports)
        return self.counter.traffic

    def breaker_opened(self) -> bool:
        return "upstream server temporarily disabled" in self.layout.error_log.read_text()

    def stop(self) -> None:
        self.nginx.stop()


@pytest.fixture
def routes() -> Iterator[list[StandIn]]:
    servers = [StandIn("primary"), StandIn("fallback-1")]
    yield servers
    for server in servers:
        server.close()


@pytest.fixture
def proxy(tmp_path: Path, routes: list[StandIn]) -> Iterator[Proxy]:
    running = Proxy(tmp_path / "run", [server.port for server in routes])
    yield running
    running.stop()


def test_a_busy_route_is_passed_over_without_opening_its_breaker_and_a_failing_one_opens_it(proxy: Proxy, routes: list[StandIn]) -> None:
    primary, _ = routes
    for busy in (503, 429):
        primary.status = busy
        answers = [proxy.ask() for _ in range(5)]  # failures_to_open is 1: one counted failure would open the breaker
        assert [(answer.status_code, answer.headers["X-Quantgate-Route"]) for answer in answers] == [(200, "fallback-1")] * 5
    assert not proxy.breaker_opened()
    primary.status = 200
    assert proxy.ask().headers["X-Quantgate-Route"] == "primary"  # still tried first: its breaker never opened
    primary.status = 500
    assert proxy.ask().headers["X-Quantgate-Route"] == "fallback-1"
    primary.status = 200
    assert proxy.breaker_opened() and proxy.ask().headers["X-Quantgate-Route"] == "fallback-1"  # open: passed over for 30 s

    traffic = proxy.traffic()
    first = traffic.routes[0]
    assert first.busy == 10 and first.answered == 1 and sum(first.failed.values()) == 1 and first.skipped_breaker_open == 1
    assert [(event.route, event.kind) for event in traffic.breaker] == [("primary", "opened")]
    assert traffic.failed == {} and traffic.answered == traffic.requests == 13


@pytest.mark.slow
def test_a_route_at_max_conns_is_passed_over_without_opening_its_breaker(tmp_path: Path, routes: list[StandIn]) -> None:
    primary, _ = routes
    proxy = Proxy(tmp_path / "run", [server.port for server in routes], max_conns=1)
    primary.delay_s = 3.0
    try:
        with ThreadPoolExecutor(1) as pool:
            primary.entered.clear()
            held = pool.submit(proxy.ask)  # the primary's one connection
            assert primary.entered.wait(10)
            passed_over = [proxy.ask().headers["X-Quantgate-Route"] for _ in range(2)]
            assert held.result().headers["X-Quantgate-Route"] == "primary" and passed_over == ["fallback-1"] * 2
        primary.delay_s = 0.0
        assert proxy.ask().headers["X-Quantgate-Route"] == "primary" and not proxy.breaker_opened()
        assert proxy.traffic().routes[0].skipped_at_max_conns == 2
    finally:
        proxy.stop()


def test_no_route_answering_is_529_when_one_was_busy_and_503_when_all_were_down(proxy: Proxy, routes: list[StandIn]) -> None:
    primary, fallback = routes
    primary.status, fallback.status = 503, 429
    busy = proxy.ask()
    assert busy.status_code == 529 and busy.json()["error"]["type"] == "busy" and busy.headers["X-Quantgate-Route"] == "none"
    primary.status = 500  # the primary fails (its breaker opens), the fallback is busy: a retry can still succeed
    assert proxy.ask().status_code == 529
    fallback.status = 502
    down = proxy.ask()  # the primary's breaker is open, the fallback fails
    assert down.status_code == 503 and down.json()["error"]["type"] == "unavailable"

    traffic = proxy.traffic()
    assert (traffic.busy, traffic.down, traffic.answered) == (2, 1, 0)
    reasons = list(traffic.failed)
    assert reasons[0].startswith("HTTP 529 (every route busy): primary answered 503 (busy")
    assert reasons[-1].startswith("HTTP 503 (every route down): primary skipped; fallback-1 connection refused or reset")


def test_a_busy_answer_goes_to_the_client_when_the_rules_say_so(tmp_path: Path, routes: list[StandIn]) -> None:
    routes[0].status = 503
    proxy = Proxy(tmp_path / "run", [server.port for server in routes], on_http_503=False)
    try:
        answer = proxy.ask()
        assert answer.status_code == 503 and answer.headers["X-Quantgate-Route"] == "primary"
    finally:
        proxy.stop()


def test_a_reload_starts_every_breaker_closed_and_the_probe_closes_one_without_a_client(proxy: Proxy, routes: list[StandIn]) -> None:
    primary, _ = routes
    primary.status = 500
    proxy.ask()  # opens the primary's breaker
    primary.status = 200
    assert proxy.ask().headers["X-Quantgate-Route"] == "fallback-1"
    probe = httpx.get(proxy.url(f"{PROBE_PREFIX}route0"), timeout=5)
    assert probe.status_code == 502  # within fail_timeout the probe, like a client, is handed to the sentinel
    proxy.reload()
    deadline = time.monotonic() + 10
    while proxy.ask().headers["X-Quantgate-Route"] != "primary":  # the old worker may take a request or two while it exits
        assert time.monotonic() < deadline, "the reload did not close the primary's breaker"
        time.sleep(0.1)
    # The probe, too, may reach the old worker (its breaker still open: 502) until it has exited (CI, 7 December).
    while (status := httpx.get(proxy.url(f"{PROBE_PREFIX}route0"), timeout=5).status_code) != 200:
        assert status == 502 and time.monotonic() < deadline, f"the probe answered {status} after the reload"
        time.sleep(0.1)


@pytest.mark.slow
def test_reloads_under_kept_alive_connections_lose_no_request(proxy: Proxy) -> None:
    """A graceful reload closes the old worker's idle kept-alive connections; a request sent on one at that instant was lost
    (measured with keep-alive on: 6 of 6,148 requests over 12 reloads). The endpoint keeps no client connection alive."""
    stop = threading.Event()
    errors: list[str] = []
    answered = [0]

    def client() -> None:
        with httpx.Client() as session:  # a client that keeps its connection alive when the server lets it
            while not stop.is_set():
                try:
                    answer = proxy.ask(session)
                    assert answer.status_code == 200, answer.text
                    answered[0] += 1
                except (httpx.HTTPError, AssertionError) as error:
                    errors.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60.0
    try:
        for _ in range(10):
            # Each reload under at least 25 fresh requests, however loaded the host (a fixed 0.4 s saw 138 in all at load 12)
            wanted = answered[0] + 25
            while answered[0] < wanted and time.monotonic() < deadline:
                time.sleep(0.05)
            proxy.reload()
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert answered[0] > 200 and errors == [], (answered[0], errors[:5])


def test_a_dead_nginx_is_reaped_with_its_exit_and_starts_again(tmp_path: Path, routes: list[StandIn]) -> None:
    proxy = Proxy(tmp_path / "run", [server.port for server in routes])
    try:
        pid = proxy.nginx.pid
        assert pid is not None and proxy.nginx.exit_code() is None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proxy.nginx.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.nginx.exit_code() == -signal.SIGKILL
        proxy.nginx.stop()  # sweeps the dead master's workers
        assert proxy.nginx.pid is None and not proxy.nginx.reload()
        assert proxy.nginx.start() != pid and proxy.ask().headers["X-Quantgate-Route"] == "primary"
    finally:
        proxy.stop()
