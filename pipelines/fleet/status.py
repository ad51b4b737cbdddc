"""`quantize serve status`: which route is live and why, from the deployment's state, a probe of every server and the
proxy's recent log.

A route is live when nginx would send a new request to it: its server runs, answers /health, and its breaker is
closed; the live route is the first such route in chain order, and every route before it says why it is passed
over (its process died, it is being restarted, it does not answer /health: hung, its breaker is open since when and
after which failures, it turned requests away at max_conns). The deployment is degraded when the live route is not
the primary, and says so when no fallback runs (one that could not start: the chain has no working fallback). The
last minute of the access log says which routes actually answered; the traffic tells overload from failure: requests
a route turned away busy (503/429, handed down the chain), and requests no route answered, 529 (one was busy) apart
from 503 (every route down).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import Field

from pipelines.files.run_input import read_regular_tail
from pipelines.fleet.nginx import ACCESS_LOG
from pipelines.fleet.state import Event, RouteState, ServeState, run_dir, supervisor_alive
from pipelines.fleet.traffic import MAX_READ, NOT_TRAFFIC, Request, RouteTraffic, parse_access_line, recent
from pipelines.schema import StrictModel
from pipelines.serve.health import HEALTH_TIMEOUT_S, Health, probe_health

RECENT_S = 60.0
TAIL_BYTES = min(MAX_READ, 2 * 1024 * 1024)


class RouteReport(StrictModel):
    label: str
    ref: str
    serves: str
    port: int | None
    status: str
    health: Health
    breaker: str
    answered: int
    busy: int = Field(description="requests it turned away busy (503/429): handed down the chain, not failures")
    failed: int
    recent_answered: int
    timeout_s: float
    restarts: int
    available: bool
    why: str


class StatusReport(StrictModel):
    name: str
    running: bool
    phase: str
    endpoint: str
    served_model_name: str
    live_route: str | None
    degraded: bool
    why: str
    routes: list[RouteReport]
    requests: int
    answered: int
    failed: dict[str, int]
    busy: int = Field(description="requests no route answered while one was busy: 529")
    down: int = Field(description="requests no route answered, every route down: 503")
    fallbacks_up: int = Field(description="routes after the primary that run (0: the chain has no working fallback)")
    recent_requests: int
    last_answered_by: str | None
    breaker_events: list[str]
    events: list[Event]


def recent_requests(access_log: Path, sentinel_port: int, now: float) -> list[Request]:
    """The last RECENT_S of traffic in the proxy's access log (its last TAIL_BYTES); none before nginx wrote one. A log that
    is not a regular file (a FIFO, a device, a link) is refused without being opened: InputError."""
    if not os.path.lexists(access_log):
        return []
    tail = read_regular_tail(access_log, "proxy's access log", TAIL_BYTES)
    lines = tail.decode("utf-8", errors="replace").splitlines()[1:]  # the first may be cut
    parsed = [parse_access_line(line, sentinel_port) for line in lines]
    return recent([request for request in parsed if request is not None and request.uri not in NOT_TRAFFIC], RECENT_S, now)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(at * 1000) % 1000:03d}"


def _route(state: RouteState, traffic: RouteTraffic | None, health: Health, running: bool, recent_answered: int) -> RouteReport:
    breaker = "closed"
    reasons = []
    if traffic is not None and traffic.breaker_open_since is not None:
        breaker = f"open since {_clock(traffic.breaker_open_since)} ({traffic.last_failure or 'failures'})"
        reasons.append(f"breaker {breaker}")
    if state.status != "up":
        reasons.insert(0, f"{state.status}{': ' + state.why if state.why else ''}")
    elif state.canary_down:
        reasons.insert(0, f"out of the chain by its canary ({state.canary})")
    elif health != "ok":
        reasons.insert(0, {"no answer": f"no answer on /health within {HEALTH_TIMEOUT_S:g} s (hung?)", "refused": "refuses connections"}
                       .get(health, f"/health: {health}"))
    if traffic is not None and traffic.skipped_at_max_conns:
        reasons.append(f"turned {traffic.skipped_at_max_conns} requests away at max_conns (overload)")
    if traffic is not None and traffic.busy:
        reasons.append(f"answered {traffic.busy} requests busy (503/429: its queue full), handed down the chain")
    available = running and state.status == "up" and health == "ok" and breaker == "closed" and not state.canary_down
    serves = f"{state.model} v{state.version}" if state.kind == "version" else f"16-bit base of {state.model} v{state.version}"
    return RouteReport(
        label=state.label, ref=state.ref, serves=serves, port=state.port, status=state.status, health=health, breaker=breaker,
        answered=traffic.answered if traffic else 0, busy=traffic.busy if traffic else 0, failed=sum(traffic.failed.values()) if traffic else 0,
        recent_answered=recent_answered,
        timeout_s=state.timeout_s, restarts=state.restarts, available=available, why="; ".join(reasons) or "serving",
    )


def status_report(state: ServeState) -> StatusReport:
    running = supervisor_alive(state)
    now = time.time()
    window = recent_requests(run_dir(state.name) / ACCESS_LOG, state.proxy.sentinel_port, now) if running else []
    traffic = state.traffic
    rows = []
    for index, route in enumerate(state.routes):
        answered = sum(1 for request in window if request.answered_by == index)
        health = probe_health(route.port if route.status == "up" else None) if running else "not running"
        rows.append(_route(route, traffic.routes[index] if traffic and index < len(traffic.routes) else None, health, running, answered))
    live = next((row for row in rows if row.available), None)
    fallbacks_up = sum(route.status == "up" for route in state.routes[1:])
    if not running:
        why = f"not running ({state.phase}{' at ' + _clock(state.stopped_at) if state.stopped_at else ''})"
    elif live is None:
        why = "no route can answer: " + "; ".join(f"{row.label}: {row.why}" for row in rows)
    else:
        passed = [f"{row.label}: {row.why}" for row in rows[: rows.index(live)]]
        why = f"{live.label} is the first route that runs, answers /health and has its breaker closed" + (
            f"; passed over: {'; '.join(passed)}" if passed else "")
    if running and len(state.routes) > 1 and not fallbacks_up:
        why += "; the chain has no working fallback: " + "; ".join(f"{row.label}: {row.why}" for row in rows[1:])
    return StatusReport(
        name=state.name, running=running, phase=state.phase, endpoint=state.endpoint, served_model_name=state.served_model_name,
        live_route=live.label if live else None, degraded=running and (live is None or live.label != rows[0].label), why=why, routes=rows,
        requests=traffic.requests if traffic else 0, answered=traffic.answered if traffic else 0, failed=dict(traffic.failed) if traffic else {},
        busy=traffic.busy if traffic else 0, down=traffic.down if traffic else 0, fallbacks_up=fallbacks_up,
        recent_requests=len(window), last_answered_by=traffic.last_answered_by if traffic else None,
        breaker_events=[f"{_clock(event.at)} {event.route} {event.kind} ({event.why})" for event in (traffic.breaker if traffic else [])][-20:],
        events=state.events[-10:],
    )
