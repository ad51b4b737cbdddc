"""`quantize serve drill`: prove the deployment has no single point of failure, on the running deployment itself.

A bounded load (a fixed number of completions at a fixed concurrency, each with a client timeout; the whole drill
bounded in time) goes through the deployment's endpoint while the drill, in order:

1. SIGKILLs the primary's vLLM API server (a crash), counts the requests in flight at that moment, and waits until the
   supervisor has restarted it and the primary answers a request again (the breaker closed);
2. SIGSTOPs the primary's whole process group (a hang: the port still accepts connections, nothing answers) for
   `hang_s`, SIGCONTs it, and waits until the primary answers again.

Every request is recorded at the client (sent, answered with which route: the proxy's X-Quantgate-Route header, or
failed and why); the breaker's open and close times come from the supervisor's reading of nginx's logs (state.json).
Loopback only: the endpoint is the deployment's own, on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from pydantic import Field

from pipelines.console.output import progress
from pipelines.errors import InputError, QuantGateError, ServeError
from pipelines.fleet.nginx import ROUTE_HEADER
from pipelines.fleet.state import ServeState, read_state, supervisor_alive
from pipelines.fleet.traffic import BreakerEvent
from pipelines.schema import StrictModel

PROMPTS = ("September 24, 2020", "14.02.2018", "March 12, 2018", "5 May 2020", "April 14, 2029", "2 January 2021", "07/11/2019")
MAX_REQUESTS = 100_000
MAX_DRILL_S = 3600.0
POLL_S = 0.5
STORY_EVENTS = 4  # the supervisor's last events in a failed drill's message


class DrillSettings(StrictModel):
    requests: int = Field(default=5000, ge=1, le=MAX_REQUESTS, description="the most completions the drill sends; it stops sooner, once "
                                                                           "the route recovered from the last fault")
    concurrency: int = Field(default=2, ge=1, le=64)
    rate: float = Field(default=10.0, gt=0, le=10_000, allow_inf_nan=False, description="requests sent per second, at most")
    max_tokens: int = Field(default=12, ge=1, le=4096)
    client_timeout_s: float = Field(default=60.0, gt=0, le=600, allow_inf_nan=False)
    warmup_s: float = Field(default=5.0, ge=0, le=600, allow_inf_nan=False, description="load before the first fault")
    hang_s: float = Field(default=20.0, gt=0, le=600, allow_inf_nan=False, description="how long the primary stays stopped")
    recover_s: float = Field(default=600.0, gt=0, le=MAX_DRILL_S, allow_inf_nan=False, description="longest wait for the primary to answer again")
    route: str = Field(default="primary", description="the route the faults hit")


class Sent(StrictModel):
    started: float
    ended: float
    status: int | None
    route: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class Fault(StrictModel):
    kind: str
    at: float
    pid: int
    in_flight: int = Field(description="requests the client had in flight at that moment")
    recovered_at: float | None = Field(default=None, description="when the route answered a request sent after the fault ended")


class DrillReport(StrictModel):
    deployment: str
    endpoint: str
    settings: DrillSettings
    started_at: float
    ended_at: float
    sent: int
    answered: int
    answered_by: dict[str, int]
    failed: dict[str, int] = Field(description="why -> requests the client got no answer for")
    faults: list[Fault]
    breaker: list[BreakerEvent]
    restarts: int
    latency_p50_s: float | None
    latency_max_s: float | None


class Load:
    """`settings.concurrency` workers sending completions until `settings.requests` were sent or `stop` is set."""

    def __init__(self, state: ServeState, key: str, settings: DrillSettings):
        self.url = f"{state.endpoint}/completions"
        self.model = state.served_model_name
        self.headers = {"Authorization": f"Bearer {key}"}
        self.settings = settings
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent: list[Sent] = []
        self.in_flight: dict[int, float] = {}
        self.count = 0
        self.next_at = time.monotonic()

    def _next(self) -> int | None:
        """The next request's number, once the rate allows it; None when the drill is over."""
        with self.lock:
            if self.stop.is_set() or self.count >= self.settings.requests:
                return None
            self.count += 1
            at, self.next_at = max(self.next_at, time.monotonic()), max(self.next_at, time.monotonic()) + 1 / self.settings.rate
        time.sleep(max(0.0, at - time.monotonic()))
        return None if self.stop.is_set() else self.count

    def worker(self) -> None:
        with httpx.Client(timeout=self.settings.client_timeout_s) as client:
            while (number := self._next()) is not None:
                self._send(client, number)

    def _send(self, client: httpx.Client, number: int) -> None:
        body = {"model": self.model, "prompt": f"Date: {PROMPTS[number % len(PROMPTS)]}\nISO date:", "max_tokens": self.settings.max_tokens,
                "temperature": 0, "stop": ["\n"]}
        started = time.time()
        with self.lock:
            self.in_flight[number] = started
        try:
            answer = client.post(self.url, json=body, headers=self.headers)
            record = Sent(started=started, ended=time.time(), status=answer.status_code, route=answer.headers.get(ROUTE_HEADER),
                          error=None if answer.is_success else answer.text[:200])
        except httpx.HTTPError as error:
            record = Sent(started=started, ended=time.time(), status=None, route=None, error=f"{type(error).__name__}: {error}"[:200])
        with self.lock:
            self.in_flight.pop(number, None)
            self.sent.append(record)

    def answered_by_since(self, route: str, since: float) -> bool:
        with self.lock:
            return any(item.route == route and item.ok and item.started >= since for item in self.sent)


def _route_pid(folder: Path, label: str) -> tuple[int, ServeState]:
    state = read_state(folder)
    route = next((route for route in state.routes if route.label == label), None)
    if route is None:
        raise InputError(f"deployment {state.name!r} has no route {label!r} (routes: {', '.join(r.label for r in state.routes)})", field="--route")
    if route.pid is None or route.status != "up":
        raise ServeError(f"route {label} of {state.name!r} is not up ({route.status}: {route.why})")
    return route.pid, state


def _wait(what: str, done: Callable[[], bool], deadline: float, load: Load, folder: Path) -> None:
    while time.time() < deadline:
        if done():
            return
        if load.count >= load.settings.requests and not load.in_flight:
            raise ServeError(f"drill: the load ran out ({load.settings.requests} requests) before {what}; give it more with --requests")
        time.sleep(POLL_S)
    raise ServeError(f"drill: {what} did not happen within recover_s ({load.settings.recover_s:g} s); {_route_story(folder, load.settings.route)}")


def _route_story(folder: Path, label: str) -> str:
    """Where the route is and what the supervisor said last: what a failed drill needs to be explained."""
    try:
        state = read_state(folder)
    except QuantGateError as error:
        return f"the deployment's state could not be read ({error.one_line()})"
    route = next((route for route in state.routes if route.label == label), None)
    said = " | ".join(event.text for event in state.events[-STORY_EVENTS:])
    where = f"{label} is {route.status} after {route.restarts} restart(s){f' ({route.why})' if route.why else ''}" if route else f"no route {label}"
    return f"{where}; the supervisor said: {said}"


def run_drill(folder: Path, settings: DrillSettings) -> DrillReport:
    """The drill on the deployment whose run folder is `folder` (module docstring); bounded by recover_s per fault."""
    state = read_state(folder)
    if not supervisor_alive(state) or state.phase != "serving":
        raise InputError(f"deployment {state.name!r} is not serving ({state.phase}); start it with `quantize serve FILE`", field="DEPLOYMENT")
    key = Path(state.client_key_file).read_text().strip()
    load = Load(state, key, settings)
    began = time.time()
    faults: list[Fault] = []
    with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
        for _ in range(settings.concurrency):
            pool.submit(load.worker)
        try:
            time.sleep(settings.warmup_s)
            faults.append(_crash(folder, load, settings))
            faults.append(_hang(folder, load, settings))
        finally:
            load.stop.set()
    time.sleep(2 * POLL_S + 1.0)  # the supervisor folds the proxy's logs once a second
    final = read_state(folder)
    return _report(final, settings, load.sent, faults, began)


def _crash(folder: Path, load: Load, settings: DrillSettings) -> Fault:
    pid, state = _route_pid(folder, settings.route)
    restarts = next(route.restarts for route in state.routes if route.label == settings.route)
    with load.lock:
        in_flight = len(load.in_flight)
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    progress(f"drill: SIGKILL to {settings.route}'s vLLM (pid {pid}) with {in_flight} requests in flight")
    deadline = at + settings.recover_s

    def restarted() -> bool:
        route = next(route for route in read_state(folder).routes if route.label == settings.route)
        return route.restarts > restarts and route.status == "up"

    _wait(f"the restart of {settings.route}", restarted, deadline, load, folder)
    back = time.time()
    progress(f"drill: {settings.route} restarted after {back - at:.1f} s; waiting for it to answer")
    _wait(f"an answer from {settings.route} after its restart", lambda: load.answered_by_since(settings.route, back), deadline, load, folder)
    return Fault(kind="SIGKILL (crash)", at=at, pid=pid, in_flight=in_flight, recovered_at=time.time())


def _hang(folder: Path, load: Load, settings: DrillSettings) -> Fault:
    pid, _ = _route_pid(folder, settings.route)
    group = os.getpgid(pid)
    with load.lock:
        in_flight = len(load.in_flight)
    at = time.time()
    os.killpg(group, signal.SIGSTOP)
    progress(f"drill: SIGSTOP to {settings.route}'s process group {group} for {settings.hang_s:g} s")
    try:
        time.sleep(settings.hang_s)
    finally:
        os.killpg(group, signal.SIGCONT)
    resumed = time.time()
    progress(f"drill: SIGCONT to {settings.route}; waiting for it to answer again")
    _wait(f"an answer from {settings.route} after SIGCONT", lambda: load.answered_by_since(settings.route, resumed), resumed + settings.recover_s,
          load, folder)
    return Fault(kind=f"SIGSTOP for {settings.hang_s:g} s (hang)", at=at, pid=pid, in_flight=in_flight, recovered_at=time.time())


def _report(state: ServeState, settings: DrillSettings, sent: list[Sent], faults: list[Fault], began: float) -> DrillReport:
    answered_by: dict[str, int] = {}
    failed: dict[str, int] = {}
    for item in sent:
        if item.ok:
            answered_by[item.route or "?"] = answered_by.get(item.route or "?", 0) + 1
        else:
            why = f"HTTP {item.status}: {item.error}" if item.status is not None else item.error or "no answer"
            failed[why] = failed.get(why, 0) + 1
    latencies = sorted(item.ended - item.started for item in sent if item.ok)
    breaker = [event for event in (state.traffic.breaker if state.traffic else []) if event.at >= began - 1]
    return DrillReport(
        deployment=state.name, endpoint=state.endpoint, settings=settings, started_at=began, ended_at=time.time(), sent=len(sent),
        answered=sum(answered_by.values()), answered_by=answered_by, failed=failed, faults=faults, breaker=breaker,
        restarts=sum(route.restarts for route in state.routes),
        latency_p50_s=latencies[len(latencies) // 2] if latencies else None, latency_max_s=latencies[-1] if latencies else None,
    )
