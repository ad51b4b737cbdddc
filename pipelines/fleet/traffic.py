"""What the proxy did with each request, read from its logs: which route answered, which failed and why, when a breaker
opened and when it closed.

nginx's access log (pipelines/fleet/nginx.py LOG_FIELDS) gives, per request, every upstream it tried:
`$upstream_addr` = "127.0.0.1:41001, 127.0.0.1:41999 : 127.0.0.1:41002" and `$upstream_status` = "504, 503 : 200":
groups separated by " : " are the routes in chain order (each location hands over to the next), and within a group
the route's server and then the sentinel. A group whose first address is the sentinel, or that is the upstream's
name ("route0": no live upstreams), is a route that did not take the request: its breaker was open or it was at
max_conns. nginx's error log says which: "upstream server temporarily disabled" is the moment max_fails was reached
(the breaker opens), with the server's address; the breaker closes with the first request that route answers again
(a client's, or the supervisor's probe: nginx.py PROBE_PREFIX), or when nginx reloads (every breaker starts closed).

Overload is not failure: a route whose server answered 503 or 429 was busy (its queue full), not failed; a request no
route answered ends 529 when a route was busy, 503 when every route was down (nginx.py's verdict).

Reads are bounded: a line longer than MAX_LINE is skipped, each read takes at most MAX_READ bytes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import Field

from pipelines.errors import InputError
from pipelines.files.run_input import read_regular_from
from pipelines.schema import StrictModel

MAX_LINE = 16 * 1024
UNKNOWN_FAILURE = "failures"
NOT_TRAFFIC = ("/health", "/metrics")  # the proxy's own probes and series: not requests of the deployment's clients
PROBE_PREFIX = "/quantgate-probe/"  # the supervisor's half-open tries (nginx.py): not traffic, but an answer closes a breaker
BUSY = (503, 429)  # a route's own "busy" answers (vLLM's full queue answers 503)
BUSY_STATUS = 529  # what the client gets when no route answered and one was busy (NVIDIA Dynamo's convention; 503: all down)
MAX_READ = 8 * 1024 * 1024
_DISABLED = re.compile(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d) \[warn\] .*upstream server temporarily disabled.*upstream: \"http://[^:/\"]+:(\d+)/")
_WHY = {
    502: "connection refused or reset (server down)",
    504: "timed out",
    503: "answered 503 (busy: its queue is full)",
    429: "answered 429 (busy)",
    500: "answered 500 (engine failed)",
    499: "client closed the connection",
}


def why(status: int) -> str:
    return _WHY.get(status, f"HTTP {status}")


class Hop(StrictModel):
    """What one route did with one request."""

    route: int
    outcome: Literal["answered", "busy", "failed", "skipped"]
    status: int | None = Field(description="the route's server's answer; None when it was not tried")


class Request(StrictModel):
    at: float = Field(ge=0, description="epoch seconds when nginx finished the request")
    uri: str
    status: int
    route: str = Field(description="the label of the last route tried")
    hops: list[Hop]
    time_s: float = Field(ge=0)  # a negative or non-finite duration is no request nginx logged: the line is not ours

    @property
    def started(self) -> float:
        return self.at - self.time_s

    @property
    def answered_by(self) -> int | None:
        last = self.hops[-1] if self.hops else None
        return last.route if last is not None and last.outcome == "answered" else None


class Opening(StrictModel):
    """A breaker opening, from the error log: the second it happened and the server's port."""

    at: float
    port: int


def _statuses(text: str) -> list[int | None]:
    return [int(part) if part.strip().isdigit() else None for part in text.split(",")]


def parse_access_line(line: str, sentinel_port: int) -> Request | None:
    """One access-log line as a Request; None for a line that is not ours (or is cut, or too long)."""
    if len(line) > MAX_LINE:
        return None
    try:
        record = json.loads(line)
        groups = [group.split(",") for group in record["upstreams"].split(" : ")] if record["upstreams"] else []
        statuses = [_statuses(group) for group in record["upstream_status"].split(" : ")] if record["upstream_status"] else []
        hops = [_hop(index, [address.strip() for address in addresses], statuses[index] if index < len(statuses) else [], sentinel_port)
                for index, addresses in enumerate(groups)]
        return Request(at=float(record["t"]), uri=str(record["uri"])[:200], status=int(record["status"]), route=str(record["route"])[:64],
                       hops=hops, time_s=float(record["time"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _hop(route: int, addresses: list[str], statuses: list[int | None], sentinel_port: int) -> Hop:
    first = addresses[0] if addresses else ""
    if not first.startswith("127.") or first.endswith(f":{sentinel_port}"):  # the sentinel, or "routeN": no live upstream
        return Hop(route=route, outcome="skipped", status=None)
    status = statuses[0] if statuses else None
    if status in BUSY:
        return Hop(route=route, outcome="busy", status=status)
    answered = status is not None and status < 500
    return Hop(route=route, outcome="answered" if answered else "failed", status=status)


def parse_error_line(line: str) -> Opening | None:
    match = _DISABLED.match(line[:MAX_LINE])
    if match is None:
        return None
    at = datetime.strptime(match[1], "%Y/%m/%d %H:%M:%S").timestamp()  # nginx writes local time
    return Opening(at=at, port=int(match[2]))


class LogTail:
    """Reads what a log gained since the last call: at most MAX_READ bytes, whole lines only."""

    def __init__(self, path: Path, offset: int = 0):
        self.path = path
        self.offset = offset

    def new_lines(self) -> list[str]:
        """None yet, or nothing readable: no lines. A log swapped for a FIFO, a device or a link is not opened
        (pipelines/fleet/run_files.py): it would block the supervisor, or feed it another file's bytes."""
        try:
            self.offset, data = read_regular_from(self.path, "log", self.offset, MAX_READ)
        except (InputError, OSError):
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].decode("utf-8", errors="replace").splitlines()


class BreakerEvent(StrictModel):
    route: str
    kind: Literal["opened", "closed"]
    at: float
    why: str


class RouteTraffic(StrictModel):
    label: str
    answered: int = 0
    busy: int = Field(default=0, description="requests its server turned away busy (503/429: its queue full), handed down the chain")
    failed: dict[str, int] = Field(default_factory=dict, description="why -> count: the route's server was tried and did not answer")
    skipped_breaker_open: int = 0
    skipped_at_max_conns: int = 0
    breaker_open_since: float | None = None
    last_failure: str | None = None


class Traffic(StrictModel):
    """Everything the proxy did since the deployment started, per route; the breaker's timeline."""

    requests: int = 0
    answered: int = 0
    failed: dict[str, int] = Field(default_factory=dict, description="requests the client got no answer for: why -> count")
    refused: dict[str, int] = Field(default_factory=dict, description="requests the proxy itself turned away (401: no or a wrong key)")
    busy: int = Field(default=0, description="requests no route answered while one was busy: the client got 529")
    down: int = Field(default=0, description="requests no route answered, every route down or failing: the client got 503 (or the "
                                             "last route's own failure)")
    routes: list[RouteTraffic]
    breaker: list[BreakerEvent] = Field(default_factory=list)
    first_at: float | None = None
    last_at: float | None = None
    last_answered_by: str | None = None


class TrafficCounter:
    """Folds access-log requests and error-log openings into Traffic, in the order they happened."""

    def __init__(self, labels: list[str], sentinel_port: int):
        self.labels = labels
        self.sentinel_port = sentinel_port
        self.traffic = Traffic(routes=[RouteTraffic(label=label) for label in labels])

    def feed(self, access_lines: Iterable[str], error_lines: Iterable[str], ports: dict[int, int]) -> None:
        """`ports`: server port -> route index, every port a route has had. Openings and requests are taken in the order
        they started (a request by the time nginx received it: its log time less its duration)."""
        events: list[tuple[float, Opening | Request]] = []
        events += [(opening.at, opening) for opening in filter(None, map(parse_error_line, error_lines)) if opening.port in ports]
        requests = filter(None, (parse_access_line(line, self.sentinel_port) for line in access_lines))
        events += [(request.started, request) for request in requests if request.uri not in NOT_TRAFFIC]
        for _, event in sorted(events, key=lambda pair: pair[0]):
            if isinstance(event, Opening):
                self._open(ports[event.port], event.at)
            elif event.uri.startswith(PROBE_PREFIX):
                self._probed(event)
            else:
                self.add(event)

    def _probed(self, request: Request) -> None:
        """The supervisor's probe of one route through its upstream: an answer from the route's server closes its breaker."""
        if request.route not in self.labels or not request.hops or request.hops[0].outcome != "answered":
            return
        self._close(self.traffic.routes[self.labels.index(request.route)], request, "the supervisor's probe through nginx was answered")

    def _close(self, state: RouteTraffic, request: Request, why: str) -> None:
        # Only a request sent to the route after its breaker opened (nginx's retry after fail_timeout) closes it; one
        # already in flight before the opening second ended proves nothing.
        opened = state.breaker_open_since
        if opened is not None and request.started >= opened + 1:
            state.breaker_open_since = None
            self.traffic.breaker.append(BreakerEvent(route=state.label, kind="closed", at=request.at, why=why))

    def reset_breakers(self, at: float, why: str, keep: frozenset[int] = frozenset()) -> None:
        """nginx reloaded: every route's breaker is closed again (a reload gives each upstream a fresh zone), but those in
        `keep`, which the reloaded config itself keeps out (`down`)."""
        for index, state in enumerate(self.traffic.routes):
            if state.breaker_open_since is not None and index not in keep:
                state.breaker_open_since = None
                self.traffic.breaker.append(BreakerEvent(route=state.label, kind="closed", at=at, why=why))

    def _open(self, route: int, at: float, why: str | None = None) -> None:
        state = self.traffic.routes[route]
        if state.breaker_open_since is None:
            state.breaker_open_since = at
            self.traffic.breaker.append(BreakerEvent(route=state.label, kind="opened", at=at, why=why or state.last_failure or UNKNOWN_FAILURE))

    def open_breaker(self, route: int, at: float, why: str) -> None:
        """The supervisor took the route out of the chain itself (its canary disagreed): its breaker is open, for `why`."""
        self.traffic.routes[route].last_failure = why
        self._open(route, at, why)

    def add(self, request: Request) -> None:
        traffic = self.traffic
        traffic.requests += 1
        traffic.first_at = traffic.first_at if traffic.first_at is not None else request.at
        traffic.last_at = request.at
        for hop in request.hops:
            if hop.route < len(traffic.routes):
                self._hop(traffic.routes[hop.route], hop, request)
        answered = request.answered_by
        if answered is not None and request.status < 500:
            traffic.answered += 1
            traffic.last_answered_by = self.labels[answered] if answered < len(self.labels) else None
        elif not request.hops and request.status < 500:
            traffic.refused[f"HTTP {request.status}"] = traffic.refused.get(f"HTTP {request.status}", 0) + 1
        else:
            reason = self._failure(request)
            traffic.failed[reason] = traffic.failed.get(reason, 0) + 1
            if request.status == BUSY_STATUS:
                traffic.busy += 1
            elif request.status != 499:
                traffic.down += 1

    def _hop(self, state: RouteTraffic, hop: Hop, request: Request) -> None:
        opened = state.breaker_open_since
        if hop.outcome == "answered":
            state.answered += 1
            self._close(state, request, "a request sent after the retry time was answered")
        elif hop.outcome == "busy":
            state.busy += 1
        elif hop.outcome == "failed":
            reason = why(hop.status) if hop.status is not None else "no answer"
            state.failed[reason] = state.failed.get(reason, 0) + 1
            state.last_failure = reason
            self._name_opening(state.label, reason)
        elif opened is not None:
            state.skipped_breaker_open += 1
        else:
            state.skipped_at_max_conns += 1

    def _name_opening(self, label: str, reason: str) -> None:
        """A breaker can open (nginx's error log, whole seconds) before the failing request that opened it is taken in (the
        access log, at its start): the opening gets that failure's reason once it is seen."""
        opened = next((event for event in reversed(self.traffic.breaker) if event.route == label), None)
        if opened is not None and opened.kind == "opened" and opened.why == UNKNOWN_FAILURE:
            opened.why = reason

    def _failure(self, request: Request) -> str:
        if request.status == 499:
            return why(499)
        parts = [f"{self.labels[hop.route] if hop.route < len(self.labels) else hop.route} "
                 f"{'skipped' if hop.outcome == 'skipped' else why(hop.status) if hop.status else 'no answer'}" for hop in request.hops]
        verdict = " (every route busy)" if request.status == BUSY_STATUS else " (every route down)" if request.status == 503 else ""
        return f"HTTP {request.status}{verdict}: " + ("; ".join(parts) if parts else "no route tried")


def recent(requests: list[Request], window_s: float, now: float | None = None) -> list[Request]:
    now = time.time() if now is None else now
    return [request for request in requests if request.at >= now - window_s]
