"""The supervisor of `quantize serve` with stand-in vLLM servers (small Python HTTP servers in their own process groups,
started with the product's start_process_group) and the real nginx: requests reach the primary with its key, a killed
primary is restarted on a new port and nginx reloaded, a stopped (hung) one is passed over by the breaker and taken
back, `serve status` says which route is live and why, and the end of the supervisor leaves no process behind.
The real thing (vLLM, the demo model's signed versions) is tests/integration/test_fleet_e2e.py."""

from __future__ import annotations

import _thread
import json
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pipelines.canary.golden import GoldenSet
from pipelines.canary.probe import CanaryResult
from pipelines.cli import build_parser, main
from pipelines.errors import ServeError
from pipelines.fleet import health as health_module
from pipelines.fleet import metrics as metrics_module
from pipelines.fleet import supervisor as supervisor_module
from pipelines.fleet.deployment import Deployment, ServerDeath
from pipelines.fleet.drill import DrillSettings, run_drill
from pipelines.fleet.fit import FitReport
from pipelines.fleet.routes import ResolvedRoute
from pipelines.fleet.state import ServeState, read_state, run_dir
from pipelines.fleet.status import status_report
from pipelines.fleet.supervisor import Prepared, Supervisor
from pipelines.serve.reclaim import describe_group, group_members
from pipelines.serve.serving import RunningServer, ServeSettings, free_port, start_process_group, stop_process_group

NGINX = shutil.which("nginx", path="/usr/sbin:/usr/bin:/sbin:/bin")
pytestmark = pytest.mark.skipif(NGINX is None, reason="Debian's nginx is not installed (make setup)")

# A stand-in for vLLM's OpenAI server: /health, and completions that need the key and name the server that answered.
STAND_IN = r"""
import http.server, json, os, sys
KEY, NAME = os.environ["VLLM_API_KEY"], sys.argv[2]
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/metrics":
            data = f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name="{NAME}"}} 0.0\n'.encode()
            self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
            return
        self._send(200, {}) if self.path == "/health" else self._send(404, {})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": "key"})
        self._send(200, {"choices": [{"text": NAME}]})
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@contextmanager
def stand_in_server(model_dir: Path, *, log_path: Path, settings=None, served_name: str = "model", port=None, while_waiting=None,
                    non_finite_literals: bool = True, start_up_s: float = 0.0) -> Iterator[RunningServer]:
    """Like vllm_server; `start_up_s` makes its start-up last that long, with `while_waiting` called as vllm_server calls it."""
    assert not non_finite_literals, "a production route must keep vLLM's standard-JSON answer to a NaN"
    deadline = time.monotonic() + start_up_s
    while time.monotonic() < deadline:
        if while_waiting is not None:
            while_waiting()
        time.sleep(0.1)
    port = free_port()
    key = secrets.token_urlsafe(32)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process, watchdog = start_process_group([sys.executable, "-c", STAND_IN, str(port), model_dir.name],
                                            env={**os.environ, "VLLM_API_KEY": key}, log_path=log_path)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield RunningServer(model_dir=model_dir, served_name=served_name, port=port, log_path=log_path, process=process, startup_s=0.1,
                            api_key=key)
    finally:
        stop_process_group(process, grace_s=2)
        watchdog.stop()


def route(index: int, label: str, folder: Path) -> ResolvedRoute:
    folder.mkdir(parents=True, exist_ok=True)
    return ResolvedRoute(index=index, field="primary" if index == 0 else f"fallbacks[{index - 1}]", label=label, kind="version", ref=f"m@{index + 1}",
                         model="m", version=index + 1, model_dir=folder, identity=label, verified="stand-in", serve=ServeSettings(max_num_seqs=4),
                         timeout_s=1.0, timeout_basis="set in the test")


@pytest.fixture(autouse=True)
def python_sigint_handler() -> Iterator[None]:
    """The tests stop the supervisor with _thread.interrupt_main(), which does nothing when SIGINT is not handled by
    Python: in the full suite something earlier in the same process had left SIGINT ignored, and the crash-and-hang test
    never ended (CI, 3 December; also under pytest-xdist). Python's own handler for the test, the previous one after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Prepared:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setattr(supervisor_module, "vllm_server", stand_in_server)
    monkeypatch.setattr(supervisor_module, "TICK_S", 0.2)
    monkeypatch.setattr(metrics_module, "RESCRAPE_S", 0.0)
    deployment = Deployment.model_validate({"name": "unit", "primary": "m@1", "fallbacks": ["m@2"], "listen": {"port": free_port()},
                                            "circuit_breaker": {"failures_to_open": 1, "retry_after_s": 2}})
    routes = [route(0, "primary", tmp_path / "primary-model"), route(1, "fallback-1", tmp_path / "fallback-model")]
    return Prepared(deployment=deployment, source=tmp_path / "unit.yaml", routes=routes, fit=FitReport(routes=[], required_bytes=0, available_bytes=1,
                    machine="test"), nginx=Path(NGINX or "nginx"), nginx_check="nginx -t: ok")


def ask(port: int, key: str) -> tuple[int, str | None, str]:
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return answer.status_code, answer.headers.get("X-Quantgate-Route"), answer.text


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


START_TIMEOUT_S = 300.0  # the stand-ins and nginx start in a second alone, and took 39 s beside the rest of the suite (CI)


def supervise_while(prepared: Prepared, drive) -> tuple[ServeState, dict[str, object]]:
    """The supervisor in the main thread (where it must start its children: their parent-death signal follows the thread)
    while `drive(folder, seen)` runs in another once the deployment serves; Ctrl-C ends it when `drive` returns or fails
    (its exception is `seen["error"]`)."""
    folder = run_dir(prepared.deployment.name)
    supervisor = Supervisor(prepared)
    seen: dict[str, object] = {}
    finished = threading.Event()

    def target() -> None:
        try:
            wait_until(lambda: (folder / "state.json").is_file() and read_state(folder).phase == "serving", timeout_s=START_TIMEOUT_S)
            drive(folder, seen)
        except BaseException as error:
            seen["error"] = error
        finally:
            stop_once_serving(supervisor, finished)

    threading.Thread(target=target, daemon=True).start()
    try:
        return supervisor.run(), seen
    finally:
        finished.set()


def stop_once_serving(supervisor: Supervisor, finished: threading.Event) -> None:
    """Ctrl-C for the supervisor once it serves, and again after 10 s if it still serves, until its run() has returned.
    Not while it starts: there Ctrl-C is an interruption out of run() (exit 2), which would end the test run itself. A CI
    run lost the one Ctrl-C a driver sent when its 30 s wait for "serving" ran out during a start-up under load (39 s):
    the supervisor then served for ever."""
    while not finished.is_set():
        if supervisor.state.phase != "serving":
            finished.wait(0.1)
            continue
        _thread.interrupt_main()
        waited = time.monotonic() + 10.0
        while supervisor.state.phase == "serving" and time.monotonic() < waited:
            time.sleep(0.1)


def test_crash_and_hang_fail_over_and_come_back(prepared: Prepared) -> None:
    port = prepared.deployment.listen.port

    def drive(folder: Path, seen: dict[str, object]) -> None:
        key = (folder / "client-key").read_text().strip()
        seen["healthy"] = ask(port, key)
        seen["no key"] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={}, timeout=5).status_code
        first = read_state(folder).routes[0]
        assert first.pid, first  # kill(0) would signal the test run's own process group
        os.kill(first.pid, signal.SIGKILL)  # a crash
        seen["after crash"] = ask(port, key)
        wait_until(lambda: read_state(folder).routes[0].restarts == 1 and read_state(folder).routes[0].status == "up")
        restarted = read_state(folder).routes[0]
        seen["new port"] = restarted.port != first.port
        wait_until(lambda: ask(port, key)[1] == "primary")
        assert restarted.pid, restarted
        group = os.getpgid(restarted.pid)
        os.killpg(group, signal.SIGSTOP)  # a hang: connections are accepted, nothing answers
        seen["during hang"] = [ask(port, key)[1] for _ in range(3)]
        seen["status"] = status_report(read_state(folder))
        wait_until(lambda: 'quantgate_deployment_degraded{deployment="unit"} 1.0' in metrics(port))
        seen["metrics"] = metrics(port)
        os.killpg(group, signal.SIGCONT)
        wait_until(lambda: ask(port, key)[1] == "primary")
        time.sleep(1.0)  # the supervisor folds the logs
        seen["groups"] = [first.pid, group]

    final, seen = supervise_while(prepared, drive)

    assert "error" not in seen, seen.get("error")
    assert seen["healthy"][:2] == (200, "primary") and "primary-model" in seen["healthy"][2]
    assert seen["no key"] == 401
    assert seen["after crash"][:2] == (200, "fallback-1")
    assert seen["new port"] is True
    assert seen["during hang"][-1] == "fallback-1"
    status = seen["status"]
    assert status.degraded and status.live_route == "fallback-1" and "primary" in status.why
    assert 'quantgate_route_live{deployment="unit",route="fallback-1"} 1.0' in seen["metrics"]
    assert 'quantgate_route_breaker_open{deployment="unit",route="primary"} 1.0' in seen["metrics"]
    # each route's own vLLM series, relabeled (the hung primary keeps its last page)
    assert 'vllm:num_requests_running{deployment="unit",model_name="primary-model",route="primary"} 0.0' in seen["metrics"]
    assert 'vllm:num_requests_running{deployment="unit",model_name="fallback-model",route="fallback-1"} 0.0' in seen["metrics"]
    traffic = final.traffic
    assert traffic is not None and traffic.failed == {} and traffic.refused == {"HTTP 401": 1} and traffic.answered == traffic.requests - 1
    kinds = [(event.route, event.kind) for event in traffic.breaker]
    assert ("primary", "opened") in kinds and kinds[-1] == ("primary", "closed")
    assert final.phase == "stopped" and final.proxy.reloads >= 1
    for group in seen["groups"]:
        assert group_members(group) == []
    assert not httpx_reachable(port)


def test_a_restarted_route_s_silence_is_timed_from_its_own_start(prepared: Prepared) -> None:
    """Its predecessor's silence (the tick that saw /health fail before the exit) must not count: it made the restarted
    primary "hung" 3 s into a 15 s SIGSTOP in the real drill (tests/integration/test_fleet_e2e.py)."""
    supervisor = Supervisor(prepared)
    supervisor.folder.mkdir(parents=True, exist_ok=True)
    server = supervisor.servers[0]
    supervisor.silent_since[0] = time.time() - 3600  # the dead predecessor went silent an hour ago
    try:
        supervisor._start_route(0, server)
        assert server.server is not None
        group = os.getpgid(server.server.process.pid)
        os.killpg(group, signal.SIGSTOP)  # the new server stops answering now
        try:
            supervisor._check_hung(0, server)
        finally:
            os.killpg(group, signal.SIGCONT)
        route_state = supervisor.state.routes[0]
        assert route_state.status == "up" and route_state.restarts == 0, route_state
    finally:
        server.stop()


def test_a_restart_is_given_a_few_times_the_first_start_up_not_the_whole_timeout(tmp_path: Path) -> None:
    server = supervisor_module.RouteServer(route(0, "primary", tmp_path / "m"), "m", tmp_path / "log")
    assert server._settings().startup_timeout_s == 300.0  # the first start: the route's own timeout
    server.first_startup_s = 30.0
    assert server._settings().startup_timeout_s == supervisor_module.RESTART_STARTUP_FLOOR_S == 120.0
    server.first_startup_s = 50.0
    assert server._settings().startup_timeout_s == 200.0
    server.first_startup_s = 100.0
    assert server._settings().startup_timeout_s == 300.0  # never beyond the route's timeout


def test_a_stuck_start_up_names_each_process_of_its_group_with_its_state(tmp_path: Path) -> None:
    process, watchdog = start_process_group([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ), log_path=tmp_path / "log")
    try:
        os.killpg(process.pid, signal.SIGSTOP)
        wait_until(lambda: f"{process.pid} python" in describe_group(process.pid) and " T " in describe_group(process.pid))
        assert describe_group(process.pid).endswith("s CPU")
    finally:
        os.killpg(process.pid, signal.SIGCONT)
        stop_process_group(process, grace_s=2)
        watchdog.stop()
    assert describe_group(process.pid) == "no process left"


def metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def httpx_reachable(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
    except httpx.HTTPError:
        return False
    return True


def test_the_drill_counts_every_request_through_a_crash_and_a_hang(prepared: Prepared, capsys: pytest.CaptureFixture) -> None:
    def drive(folder: Path, seen: dict[str, object]) -> None:
        seen["report"] = run_drill(folder, DrillSettings(requests=3000, concurrency=2, rate=50, warmup_s=1.0, hang_s=3.0, recover_s=30.0))

    _, seen = supervise_while(prepared, drive)
    assert "error" not in seen, seen.get("error")
    report = seen["report"]
    crash, hang = report.faults
    assert report.sent - report.answered <= crash.in_flight
    assert report.answered_by["primary"] > 0 and report.answered_by["fallback-1"] > 0
    assert crash.recovered_at and hang.recovered_at and report.restarts == 1
    kinds = [(event.route, event.kind) for event in report.breaker]
    assert ("primary", "opened") in kinds and kinds[-1] == ("primary", "closed")
    assert [item.name for item in report.criteria] == [
        "a working fallback", "no request lost", "crash: primary restarted", "crash: primary answered again (its breaker closed)",
        "hang: primary answered again (its breaker closed)"]
    # Nothing lost and a working fallback are this test's to assert. How fast the primary answers again is timed on a loaded
    # 2-core CI host (a CI run missed the 6.2 s bound beside the rest of the suite): the drill's verdict to report, judged
    # consistently against the bound, not a timed assertion here.
    assert report.criteria[0].passed and report.criteria[1].passed, report.criteria
    assert report.passed == all(item.passed for item in report.criteria), report.criteria
    bound = report.criteria[-1].limit  # the route's timeout (1 s) + retry_after_s (2 s) + nginx's second + a tick + the probe's 2 s
    closing = report.criteria[-2:]
    assert bound == 6.2 and all(item.measured is not None and item.passed == (item.measured <= bound) for item in closing), closing
    assert main(["serve", "status", "unit"]) == 0
    assert "unit: stopped; live route: none (not running" in capsys.readouterr().out


def test_a_drill_whose_route_never_comes_back_fails_naming_the_criterion_and_where_the_route_is(prepared: Prepared) -> None:
    """A failed drill is a verdict (exit 1), whose criterion names the route's status and the supervisor's last words, not
    just the time-out (CI, 4 December)."""
    deployment = prepared.deployment.model_copy(update={"rules": prepared.deployment.rules.model_copy(
        update={"server_death": ServerDeath(restart=False)})})
    def drive(folder: Path, seen: dict[str, object]) -> None:
        seen["report"] = run_drill(folder, DrillSettings(requests=3000, concurrency=1, rate=20, warmup_s=0.5, hang_s=1.0, recover_s=3.0))

    _, seen = supervise_while(prepared.model_copy(update={"deployment": deployment}), drive)
    assert "error" not in seen, seen.get("error")
    report = seen["report"]
    failed = [item for item in report.criteria if not item.passed]
    assert not report.passed and [item.name for item in failed] == [
        "crash: primary restarted", "crash: primary answered again (its breaker closed)", "hang: primary answered again (its breaker closed)"]
    assert failed[0].measured is None and failed[0].limit == 3.0 and len(report.faults) == 1  # no hang of a route that is not up
    assert re.search(r"^primary is failed after 0 restart\(s\) \(process exited \(killed by SIGKILL\) at [\d:]+; not restarted "
                     r"\(restart: false\)\); the supervisor said: .*primary: process exited", failed[0].detail), failed[0].detail
    assert report.criteria[1].name == "no request lost" and report.criteria[1].passed  # the fallback answered everything


def test_a_fallback_that_cannot_start_serves_degraded_and_its_drill_fails_naming_the_criterion(
        prepared: Prepared, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The fallback's server dies at start-up: `serve` serves the primary alone and says so; the drill runs no fault (it
    would be an outage), exits 1 and names the criterion."""

    def fallback_dies(model_dir: Path, **kwargs):
        if model_dir.name == "fallback-model":
            raise ServeError("vLLM exited at start-up (exit code 1): ValueError: max_model_len is greater than the model's")
        return stand_in_server(model_dir, **kwargs)

    monkeypatch.setattr(supervisor_module, "vllm_server", fallback_dies)
    port = prepared.deployment.listen.port

    def drive(folder: Path, seen: dict[str, object]) -> None:
        key = (folder / "client-key").read_text().strip()
        seen["answer"] = ask(port, key)[:2]
        seen["status"] = status_report(read_state(folder))
        args = build_parser("serve").parse_args(["serve", "drill", "unit", "--json", "--recover-s", "5"])
        seen["drill"] = args.handler(args)  # the command's exit code (main() itself must run in the main thread: its signals)
        seen["events"] = [event.text for event in read_state(folder).events]

    final, seen = supervise_while(prepared, drive)
    assert "error" not in seen, seen.get("error")
    assert seen["answer"] == (200, "primary")
    status = seen["status"]
    assert status.fallbacks_up == 0 and status.live_route == "primary" and "the chain has no working fallback: fallback-1: " in status.why
    assert any(text.startswith("serving degraded: fallback-1 (m@2) did not start: vLLM exited at start-up") for text in seen["events"])
    assert seen["drill"] == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["sent"] == 0 and report["faults"] == []
    assert report["criteria"] == [{"name": "a working fallback", "measured": 0.0, "rule": "at least", "limit": 1.0, "unit": "routes up after primary",
                                   "passed": False, "detail": report["criteria"][0]["detail"]}]
    assert report["criteria"][0]["detail"].startswith("fallback-1 ")
    assert final.routes[0].restarts == 0  # the primary was never touched


@pytest.mark.slow
def test_a_hung_route_s_breaker_closes_after_it_recovers_without_a_client_request(prepared: Prepared) -> None:
    """The supervisor's probe through nginx is the half-open try: no client request has to reach the recovered route."""
    port = prepared.deployment.listen.port

    def drive(folder: Path, seen: dict[str, object]) -> None:
        key = (folder / "client-key").read_text().strip()
        primary = read_state(folder).routes[0]
        assert primary.pid and primary.breaker_close_bound_s, primary
        group = os.getpgid(primary.pid)
        os.killpg(group, signal.SIGSTOP)
        try:
            seen["during hang"] = ask(port, key)[1]  # times out on the primary (1 s), answered by the fallback: the breaker opens
            wait_until(lambda: any(event.kind == "opened" for event in read_state(folder).traffic.breaker))
        finally:
            os.killpg(group, signal.SIGCONT)
        resumed = time.time()
        wait_until(lambda: [event for event in read_state(folder).traffic.breaker if event.kind == "closed"], timeout_s=30)
        closed = next(event for event in read_state(folder).traffic.breaker if event.kind == "closed")
        seen["closed"] = (closed.why, closed.at - resumed, primary.breaker_close_bound_s)
        seen["after"] = ask(port, key)[1]

    _, seen = supervise_while(prepared, drive)
    assert "error" not in seen, seen.get("error")
    assert seen["during hang"] == "fallback-1"
    why, took, bound = seen["closed"]
    assert why == "the supervisor's probe through nginx was answered" and took <= bound, seen["closed"]
    assert seen["after"] == "primary"


def test_nginx_killed_while_a_route_restarts_is_started_again_before_the_route_is_back(prepared: Prepared, monkeypatch) -> None:
    """A route's restart takes as long as vLLM's start-up (30 s to minutes); the supervisor keeps nginx alive meanwhile, or the
    fallback, which is up, is unreachable for that long (a CI run: 139 requests refused while the primary restarted)."""
    starts: list[str] = []

    def slow_restarts(model_dir: Path, **kwargs):
        starts.append(model_dir.name)
        restart = starts.count(model_dir.name) > 1
        return stand_in_server(model_dir, **kwargs, start_up_s=8.0 if restart else 0.0)

    monkeypatch.setattr(supervisor_module, "vllm_server", slow_restarts)
    def drive(folder: Path, seen: dict[str, object]) -> None:
        key = (folder / "client-key").read_text().strip()
        state = read_state(folder)
        primary, nginx = state.routes[0].pid, state.proxy.pid
        assert primary and nginx, state  # kill(0) would signal the test run's own process group
        os.kill(primary, signal.SIGKILL)
        wait_until(lambda: read_state(folder).routes[0].restarts == 1)
        os.kill(nginx, signal.SIGKILL)  # nginx dies while the primary's restart lasts 8 s
        wait_until(lambda: read_state(folder).proxy.pid not in (None, nginx), timeout_s=6)
        seen["primary then"] = read_state(folder).routes[0].status
        seen["answer"] = ask(prepared.deployment.listen.port, key)[:2]
        seen["events"] = [event.text for event in read_state(folder).events]

    _, seen = supervise_while(prepared, drive)
    assert "error" not in seen, seen.get("error")
    assert seen["primary then"] in ("restarting", "starting"), seen
    assert seen["answer"] == (200, "fallback-1")
    assert any(re.search(r"nginx exited \(killed by SIGKILL; its console: .*\); starting it again", text) for text in seen["events"]), seen["events"]


@pytest.mark.slow
def test_a_route_whose_canary_disagrees_leaves_the_chain_until_a_probe_agrees(prepared: Prepared, monkeypatch: pytest.MonkeyPatch) -> None:
    """The golden-set probe (faked here: pipelines/canary has its own tests against a server) as the routes' health check: a
    primary that answers but disagrees is marked down in nginx, the event names the prompts, and it returns on agreement."""
    verdict = {"disagreeing": []}
    asked: list[str] = []

    def fake_probe(base_url: str, *, model: str, golden: GoldenSet, api_key: str | None, timeout_s: float) -> CanaryResult:
        asked.append(base_url)
        wrong = list(verdict["disagreeing"])
        return CanaryResult(healthy=not wrong, disagreeing=wrong, answered=16, total=16, tolerated=0, wall_s=0.1)

    monkeypatch.setattr(health_module, "probe_canary", fake_probe)
    monkeypatch.setattr(supervisor_module, "warm_up", lambda server: 0.0)
    rules = prepared.deployment.rules.model_copy(update={"canary_every_s": 0.3})
    golden = GoldenSet.model_construct()
    prepared = prepared.model_copy(update={"deployment": prepared.deployment.model_copy(update={"rules": rules}), "goldens": [golden, None]})
    port = prepared.deployment.listen.port

    def drive(folder: Path, seen: dict[str, object]) -> None:
        key = (folder / "client-key").read_text().strip()
        wait_until(lambda: read_state(folder).routes[0].canary != "")
        seen["healthy"] = ask(port, key)[1]
        verdict["disagreeing"] = ["p03", "p07"]
        wait_until(lambda: read_state(folder).routes[0].canary_down)
        # nginx's reload is graceful: an old worker may answer a while (under load, after a first fallback answer already)
        wait_until(lambda: [ask(port, key)[1] for _ in range(3)] == ["fallback-1"] * 3, timeout_s=20)
        seen["down"] = [ask(port, key)[1] for _ in range(3)]
        seen["status"] = status_report(read_state(folder))
        verdict["disagreeing"] = []
        wait_until(lambda: not read_state(folder).routes[0].canary_down)
        wait_until(lambda: ask(port, key)[1] == "primary", timeout_s=10)
        time.sleep(1.0)  # the supervisor folds the logs
        state = read_state(folder)
        seen["events"] = [event.text for event in state.events]
        seen["breaker"] = [(event.route, event.kind, event.why) for event in state.traffic.breaker]

    final, seen = supervise_while(prepared, drive)
    assert "error" not in seen, seen.get("error")
    assert seen["healthy"] == "primary" and seen["down"] == ["fallback-1"] * 3
    assert {url.rsplit(":", 1)[0] for url in asked} == {"http://127.0.0.1"} and len(set(asked)) == 1  # the primary only
    status = seen["status"]
    assert status.degraded and status.live_route == "fallback-1"
    assert "out of the chain by its canary (2 of 16 golden prompts disagree beyond tolerance: p03, p07)" in status.why
    assert "primary (m@1): canary: 2 of 16 golden prompts disagree beyond tolerance: p03, p07; taken out of the chain until a probe agrees" \
        in seen["events"]
    assert any(text.startswith("primary (m@1): canary: 16 of 16 golden prompts agree within tolerance; back in the chain") for text in seen["events"])
    opened = [item for item in seen["breaker"] if item[1] == "opened"]
    assert opened == [("primary", "opened", "canary: 2 of 16 golden prompts disagree beyond tolerance: p03, p07")]
    assert seen["breaker"][-1][:2] == ("primary", "closed") and final.proxy.reloads == 2
