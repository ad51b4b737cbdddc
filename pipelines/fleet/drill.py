"""`quantize serve drill`: prove the deployment has no single point of failure, on the running deployment itself.

A bounded load (a fixed number of completions at a fixed concurrency, each with a client timeout; the whole drill
bounded in time) goes through the deployment's endpoint while the drill, in order:

1. SIGKILLs the primary's vLLM API server (a crash), counts the requests in flight at that moment, and waits until the
   supervisor has restarted it and the primary answers a request again (the breaker closed);
2. SIGSTOPs the primary's whole process group (a hang: the port still accepts connections, nothing answers) for
   `hang_s`, SIGCONTs it, and waits until the primary answers again.

Every request is recorded at the client (sent, answered with which route: the proxy's X-Quantgate-Route header, or
failed and why); the breaker's open and close times come from the supervisor's reading of nginx's logs (state.json).
Loopback only: the endpoint is the deployment's own, on an IPv4 loopback address; the key is read from the run folder's
own key file (never a path the state names), and a pid is signalled only when it is the server the live supervisor
started (pipelines/fleet/run_files.py): the state file is input, not an order.

The verdict is a list of criteria, each with its measured figure and its limit; the drill passes when all hold:
- a working fallback: at least one route after the faulted one is up before any fault (else no fault is run: the
  chain would have nothing to fall back to, and the drill fails at once);
- no request lost: every request sent got an answer (0 lost);
- the crash: the supervisor restarted the route within recover_s, and the route answered again within its breaker's
  bound (state.json's breaker_close_bound_s, supervisor.breaker_close_bound_s) after the restart;
- the hang: the route answered again within that bound after SIGCONT.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
from pydantic import Field

from pipelines.console.output import progress
from pipelines.errors import InputError, QuantGateError, ServeError
from pipelines.fleet.nginx import ROUTE_HEADER
from pipelines.fleet.run_files import loopback_endpoint, read_client_key
from pipelines.fleet.state import CLIENT_KEY_FILE, STATE_FILE, RouteState, ServeState, read_state, route_process_verified, supervisor_alive
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
    ended_at: float | None = Field(default=None, description="when the fault ended: the restart done (a crash), SIGCONT (a hang); "
                                                             "None when the route was not restarted within recover_s")
    recovered_at: float | None = Field(default=None, description="when the route answered a request sent after the fault ended")
    story: str = Field(default="", description="where the route was and what the supervisor said, when it did not come back")


class Criterion(StrictModel):
    """One pass criterion of the drill: its measured figure against its limit."""

    name: str
    measured: float | None = Field(description="None: not measured (the step before it failed)")
    rule: Literal["at most", "at least"]
    limit: float
    unit: str
    passed: bool
    detail: str = ""


def criterion(name: str, measured: float | None, rule: Literal["at most", "at least"], limit: float, unit: str, detail: str = "") -> Criterion:
    holds = measured is not None and (measured <= limit if rule == "at most" else measured >= limit)
    return Criterion(name=name, measured=measured, rule=rule, limit=limit, unit=unit, passed=holds, detail=detail)


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
    criteria: list[Criterion]
    passed: bool = Field(description="every criterion held: exit 0; else exit 1")

    @property
    def lost(self) -> int:
        return self.sent - self.answered


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
    if not route_process_verified(state, route):
        raise InputError(f"route {label}'s pid {route.pid} is not the server its supervisor started (start time, command line or parent "
                         "differ from what it recorded); nothing signalled", file=folder / STATE_FILE, field="pid")
    return route.pid, state


def _wait(what: str, done: Callable[[], bool], deadline: float, load: Load) -> bool:
    """Whether `done` came true by the deadline; an error when the load ran out first (the drill could not tell)."""
    while time.time() < deadline:
        if done():
            return True
        if load.count >= load.settings.requests and not load.in_flight:
            raise ServeError(f"drill: the load ran out ({load.settings.requests} requests) before {what}; give it more with --requests")
        time.sleep(POLL_S)
    return False


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


def _fallbacks_up(state: ServeState, label: str) -> tuple[int, str]:
    """How many routes after `label` in the chain are up, and what the others are doing."""
    index = next(index for index, route in enumerate(state.routes) if route.label == label)
    after = state.routes[index + 1:]
    down = "; ".join(f"{route.label} {route.status}{f' ({route.why})' if route.why else ''}" for route in after if route.status != "up")
    return sum(route.status == "up" for route in after), down or f"{len(after)} fallback(s) up"


def run_drill(folder: Path, settings: DrillSettings) -> DrillReport:
    """The drill on the deployment whose run folder is `folder` (module docstring); bounded by recover_s per fault."""
    state = read_state(folder)
    if not supervisor_alive(state) or state.phase != "serving":
        raise InputError(f"deployment {state.name!r} is not serving ({state.phase}); start it with `quantize serve FILE`", field="DEPLOYMENT")
    _, state = _route_pid(folder, settings.route)
    began = time.time()
    up, why = _fallbacks_up(state, settings.route)
    if not up:  # a fault now is an outage the drill would cause: the verdict is known
        return _report(state, settings, [], [], began, fallbacks=(up, why))
    loopback_endpoint(state.endpoint, folder / STATE_FILE)
    load = Load(state, read_client_key(folder, CLIENT_KEY_FILE), settings)
    faults: list[Fault] = []
    with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
        for _ in range(settings.concurrency):
            pool.submit(load.worker)
        try:
            time.sleep(settings.warmup_s)
            faults.append(_crash(folder, load, settings))
            if faults[0].ended_at is not None:
                faults.append(_hang(folder, load, settings))
        finally:
            load.stop.set()
    time.sleep(2 * POLL_S + 1.0)  # the supervisor folds the proxy's logs once a second
    final = read_state(folder)
    return _report(final, settings, load.sent, faults, began, fallbacks=(up, why))


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

    fault = Fault(kind="SIGKILL (crash)", at=at, pid=pid, in_flight=in_flight)
    if not _wait(f"the restart of {settings.route}", restarted, deadline, load):
        return fault.model_copy(update={"story": _route_story(folder, settings.route)})
    back = time.time()
    progress(f"drill: {settings.route} restarted after {back - at:.1f} s; waiting for it to answer")
    answered = _wait(f"an answer from {settings.route} after its restart", lambda: load.answered_by_since(settings.route, back),
                     back + settings.recover_s, load)
    return fault.model_copy(update={"ended_at": back, "recovered_at": time.time() if answered else None,
                                    "story": "" if answered else _route_story(folder, settings.route)})


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
    answered = _wait(f"an answer from {settings.route} after SIGCONT", lambda: load.answered_by_since(settings.route, resumed),
                     resumed + settings.recover_s, load)
    return Fault(kind=f"SIGSTOP for {settings.hang_s:g} s (hang)", at=at, pid=pid, in_flight=in_flight, ended_at=resumed,
                 recovered_at=time.time() if answered else None, story="" if answered else _route_story(folder, settings.route))


def _criteria(state: ServeState, settings: DrillSettings, lost: int, faults: list[Fault], fallbacks: tuple[int, str]) -> list[Criterion]:
    """The verdict's criteria (module docstring), in the order the drill meets them."""
    route: RouteState = next(route for route in state.routes if route.label == settings.route)
    bound = route.breaker_close_bound_s or settings.recover_s
    out = [criterion("a working fallback", fallbacks[0], "at least", 1, "routes up after " + settings.route, fallbacks[1])]
    if not fallbacks[0]:
        return out
    out.append(criterion("no request lost", lost, "at most", 0, "requests"))
    crash = faults[0] if faults else None
    restart = crash.ended_at - crash.at if crash is not None and crash.ended_at is not None else None
    out.append(criterion(f"crash: {settings.route} restarted", restart, "at most", settings.recover_s, "s", crash.story if crash else ""))
    for fault, what in ((crash, "crash"), (faults[1] if len(faults) > 1 else None, "hang")):
        took = fault.recovered_at - fault.ended_at if fault is not None and fault.recovered_at and fault.ended_at else None
        out.append(criterion(f"{what}: {settings.route} answered again (its breaker closed)", took, "at most", round(bound, 1), "s",
                             fault.story if fault is not None and took is None else "after the restart" if what == "crash" else "after SIGCONT"))
    return out


def _report(state: ServeState, settings: DrillSettings, sent: list[Sent], faults: list[Fault], began: float, *,
            fallbacks: tuple[int, str]) -> DrillReport:
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
    criteria = _criteria(state, settings, len(sent) - sum(answered_by.values()), faults, fallbacks)
    return DrillReport(
        deployment=state.name, endpoint=state.endpoint, settings=settings, started_at=began, ended_at=time.time(), sent=len(sent),
        answered=sum(answered_by.values()), answered_by=answered_by, failed=failed, faults=faults, breaker=breaker,
        restarts=sum(route.restarts for route in state.routes),
        latency_p50_s=latencies[len(latencies) // 2] if latencies else None, latency_max_s=latencies[-1] if latencies else None,
        criteria=criteria, passed=all(item.passed for item in criteria),
    )
