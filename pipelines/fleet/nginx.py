"""The proxy: Debian's nginx, run as a foreground process with its own prefix, config, pid and logs in the run folder.

The chain is a sequence of locations, one per route, each with its own upstream and its own timeouts:

    location /                -> upstream route0 { server PRIMARY max_fails=F fail_timeout=T max_conns=C; server SENTINEL backup; }
        error_page 500 502 503 504 429 = @route1
    location @route1          -> upstream route1 { server FALLBACK1 ...; server SENTINEL backup; }
        error_page 500 502 503 504 429 = @verdict    (the last route)
    location @verdict         -> 529 {"error": ... busy} when a route answered 503/429 (busy), else 503 {"error": ... down}

- The circuit breaker is nginx's passive health check: `max_fails` failures (connection refused or reset, a timeout,
  a 500/502/504) within `fail_timeout` mark the server down for `fail_timeout`; then one live request tries it again.
  nginx ignores max_fails for an upstream of one server, hence a `backup` sentinel in every upstream: a server
  block of this nginx on loopback that answers 502 at once. A request the route cannot take (server down, breaker
  open, max_conns reached) goes to the sentinel, whose 502 hands it to the next route's location.
- Overload is not failure. A route's queue is vLLM's own (`--max-num-queued-reqs` = max_num_seqs + the rules'
  max_queue): a full one answers 503 at once. 503 and 429 are NOT in `proxy_next_upstream` (nginx counts every status
  listed there toward max_fails, measured): they are intercepted by `error_page` and handed to the next route, and
  nginx frees the server as a success. `max_conns` (the queue + max_num_seqs + 16) is a backstop above vLLM's queue:
  only a server that no longer answers at all (hung) fills it. When no route answers, `@verdict` tells the client which it
  was: 529 when a route said it was busy (a retry later can succeed), 503 when every route was down.
- Reloads (a route restarted on a new port) do not drop requests: the endpoint does not keep client connections alive
  (`keepalive_timeout 0`). A graceful reload closes the old worker's idle kept-alive connections at once, and a client
  that sends its next request on one at that instant gets a reset it cannot safely retry (a POST): 6 errors in 6,148
  requests over 12 reloads with keep-alive on, 0 in 4,432 with it off (tests/unit/fleet/test_fleet_nginx.py). A
  reload also gives every upstream a fresh zone: every breaker closes (nginx's failure counters start at zero).
- The upstream side keeps connections alive for fewer seconds (4) than vLLM's uvicorn (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
  5 s), so nginx never reuses a connection the server is closing (that failure would count against the route).
- `/quantgate-probe/routeN` (loopback only, no key): the route's /health through its own upstream, what the
  supervisor sends once a second while a route's breaker is open and its server answers again: the half-open try is
  the probe's, not a client's, so the breaker closes within fail_timeout + a second of the route's recovery.
- `proxy_next_upstream ... non_idempotent`: a completion is safe to send again (it changes nothing), so a POST that
  failed before any byte of the answer reached the client is retried down the chain; once the answer has started
  (a stream), it cannot be.
- Timeouts per route: `proxy_read_timeout`/`proxy_send_timeout` = the route's timeout (a non-streamed answer arrives
  whole, after generation), `proxy_connect_timeout` from the rules.
- Authentication: every vLLM server has its own API key (pipelines/serve/serving.py); each location adds its route's
  `Authorization` header, and clients send the deployment's own key to nginx, checked in a `map`. The file holds
  keys: it is written 0600. `/health` needs no key (it says whether any route answers).
- The access log is one JSON object per request: the route that answered and every upstream tried with its status
  (pipelines/fleet/traffic.py reads it for `serve status` and the breaker's open and close times).
"""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

from pydantic import Field

from pipelines.files.atomic import write_text_atomic
from pipelines.fleet.deployment import Deployment
from pipelines.fleet.traffic import BUSY, BUSY_STATUS, PROBE_PREFIX
from pipelines.schema import StrictModel
from pipelines.serve.health import HEALTH_TIMEOUT_S, LOOPBACK
from pipelines.serve.serving import ServeSettings

ACCESS_LOG = "access.log"
ROUTE_HEADER = "X-Quantgate-Route"
FAILURE_STATUSES = "500 502 504"  # a route's failure: counted toward its breaker (proxy_next_upstream)
BUSY_STATUSES = " ".join(map(str, BUSY))  # a busy route's answer: handed down the chain, never counted (rules.overload.on_http_503)
SENTINEL_STATUS = 502  # not 503: the verdict reads a 503 or 429 in $upstream_status as a route's own "busy"
PROBE_TIMEOUT_S = HEALTH_TIMEOUT_S  # the half-open try through nginx is the product's health probe
BACKSTOP_BURST = 16  # max_conns's room above vLLM's queue for requests it is answering 503 (max_conns below)
UPSTREAM_KEEPALIVE_S = 4  # below vLLM's uvicorn keep-alive (5 s): nginx never reuses a connection the server is closing
MAX_BODY = "16m"  # a request body larger than this is refused by nginx (413) before any route sees it
LOG_FIELDS = (
    '{"t":$msec,"id":"$request_id","route":"$qg_route","method":"$request_method","uri":"$uri","status":$status,'
    '"upstreams":"$upstream_addr","upstream_status":"$upstream_status","upstream_time":"$upstream_response_time","time":$request_time}'
)


class Upstream(StrictModel):
    """One route as the proxy sees it: where its server listens (host:port) and its key (or a ${VARIABLE} a template fills in)."""

    label: str
    address: str
    api_key: str
    timeout_s: float
    max_conns: int
    down: bool = Field(default=False, description="out of the chain (nginx `down`): its canary disagreed (pipelines/fleet/health.py)")


class Chain(StrictModel):
    """What goes inside nginx's `http {}` for a deployment, wherever it runs: this machine or a Kubernetes pod."""

    listen: str = Field(description="host:port, or a port")
    sentinel_port: int
    client_key: str
    access_log: str
    upstreams: list[Upstream] = Field(min_length=1)
    metrics_file: str | None = Field(default=None, description="the deployment's own Prometheus series, served at /metrics")


class ProxyLayout(StrictModel):
    """Where this nginx keeps its files (all in the run folder) and the ports it listens on."""

    prefix: Path
    listen_host: str
    listen_port: int
    sentinel_port: int
    client_key: str

    @property
    def conf(self) -> Path:
        return self.prefix / "nginx.conf"

    @property
    def pid(self) -> Path:
        return self.prefix / "nginx.pid"

    @property
    def access_log(self) -> Path:
        return self.prefix / ACCESS_LOG

    @property
    def error_log(self) -> Path:
        return self.prefix / "error.log"

    @property
    def metrics(self) -> Path:
        return self.prefix / "metrics.prom"

    @property
    def temp(self) -> Path:
        return self.prefix / "tmp"


def max_conns(serve: ServeSettings) -> int:
    """nginx's cap on the requests a route holds: a backstop above vLLM's own queue (max_num_queued_reqs), which answers 503
    first (busy); only a server that stopped answering (hung) fills nginx's, whose requests then skip it (module docstring).
    Its margin holds a burst of requests vLLM is turning away: with a margin of max_num_seqs alone, 24 clients at once on
    routes of 2 filled it with 503s in flight, and 6 of 72 requests were told "every route down" instead of busy (measured,
    docs/fleet.md)."""
    return (serve.max_num_queued_reqs or serve.max_num_seqs) + serve.max_num_seqs + BACKSTOP_BURST


def _seconds(value: float) -> str:
    """An nginx time: whole milliseconds."""
    return f"{max(1, round(value * 1000))}ms"


def _worker_user() -> str:
    """nginx's workers run as whoever runs `quantize serve`: a master started by root would switch them to `nobody`, who
    cannot read the run folder (the metrics file, the temp folders) nor should need to; a non-root master cannot switch."""
    if os.geteuid() != 0:
        return ""
    return f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};\n"


def render_config(deployment: Deployment, layout: ProxyLayout, upstreams: list[Upstream]) -> str:
    """The whole nginx.conf of a deployment on this machine: its files in the run folder, then the chain."""
    temp = layout.temp
    chain = Chain(listen=f"{layout.listen_host}:{layout.listen_port}", sentinel_port=layout.sentinel_port, client_key=layout.client_key,
                  access_log=str(layout.access_log), upstreams=upstreams, metrics_file=str(layout.metrics))
    return (
        f"# Generated by `quantize serve` from deployment {deployment.name!r}; regenerated when a route restarts. Holds API keys: 0600.\n"
        f"{_worker_user()}worker_processes 1;\npid {layout.pid};\nerror_log {layout.error_log} warn;\n"
        "events { worker_connections 1024; }\n\n"
        "http {\n"
        f"    client_body_temp_path {temp / 'body'};\n    proxy_temp_path {temp / 'proxy'};\n    fastcgi_temp_path {temp / 'fastcgi'};\n"
        f"    uwsgi_temp_path {temp / 'uwsgi'};\n    scgi_temp_path {temp / 'scgi'};\n\n"
        + render_chain(deployment, chain) + "}\n"
    )


def render_chain(deployment: Deployment, chain: Chain) -> str:
    """The chain, as the contents of `http {}`: one upstream per route (server + sentinel backup), the sentinel, the key
    check, and the server whose locations hand a request down the routes (the module docstring says why each part)."""
    breaker = deployment.circuit_breaker
    statuses = FAILURE_STATUSES + (f" {BUSY_STATUSES}" if deployment.rules.overload.on_http_503 else "")
    next_upstream = "error timeout " + " ".join(f"http_{status}" for status in FAILURE_STATUSES.split())
    count = len(chain.upstreams)
    lines = [
        f"log_format quantgate escape=json '{LOG_FIELDS}';",
        f"client_max_body_size {MAX_BODY};", "client_body_buffer_size 1m;", "client_body_timeout 60s;", "server_tokens off;", "",
        "map_hash_bucket_size 128;  # a key is 43 characters: longer than the default bucket",
        "map $http_authorization $quantgate_client {", "    default 0;", f'    "Bearer {chain.client_key}" 1;', "}", "",
    ]
    for index, upstream in enumerate(chain.upstreams):
        lines += [
            f"upstream route{index} {{  # {upstream.label}", f"    zone route{index} 64k;",
            f"    server {upstream.address} max_fails={breaker.failures_to_open} fail_timeout={breaker.retry_after_s}s "
            f"max_conns={upstream.max_conns}{' down' if upstream.down else ''};",
            f"    server {LOOPBACK}:{chain.sentinel_port} backup max_fails=0;", "    keepalive 16;",
            f"    keepalive_timeout {UPSTREAM_KEEPALIVE_S}s;", "}", "",
        ]
    lines += [
        "server {  # the backup of every route: a route that cannot take a request hands it to the next",
        f"    listen {LOOPBACK}:{chain.sentinel_port};", "    access_log off;", f"    return {SENTINEL_STATUS};", "}", "",
        "server {", f"    listen {chain.listen};", f"    access_log {chain.access_log} quantgate;",
        "    keepalive_timeout 0;  # a reload closes idle kept-alive connections: a request sent on one at that instant is lost",
        "    recursive_error_pages on;", "    proxy_intercept_errors on;",
        f"    proxy_next_upstream {next_upstream} non_idempotent;", "    proxy_next_upstream_tries 2;",
        "    proxy_http_version 1.1;", "    proxy_buffering off;", f"    proxy_connect_timeout {_seconds(deployment.rules.connect_timeout_s)};",
        '    set $qg_route "";', "",
        *(["    location = /metrics {  # no key, like vLLM's own /metrics: the deployment's series (pipelines/fleet/metrics.py)",
            '        default_type "text/plain; version=0.0.4";', f"        alias {chain.metrics_file};", "    }"] if chain.metrics_file else []),
        "    location = /health {  # no key: whether any route answers", *_indent(_route(0, chain.upstreams[0], count, statuses, "health")), "    }",
        "    location / {", "        if ($quantgate_client = 0) {", "            add_header WWW-Authenticate Bearer always;",
        "            return 401 '{\"error\": \"missing or wrong API key for this deployment\"}\\n';", "        }",
        *_indent(_route(0, chain.upstreams[0], count, statuses, "route")), "    }",
    ]
    for index in range(1, count):
        for kind in ("health", "route"):
            lines += [f"    location @{kind}{index} {{", *_indent(_route(index, chain.upstreams[index], count, statuses, kind)), "    }"]
    for kind in ("health", "route"):
        lines += [f"    location @{kind}_verdict {{", *_indent(_verdict()), "    }"]
    for index, upstream in enumerate(chain.upstreams):
        lines += [f"    location = {PROBE_PREFIX}route{index} {{  # the supervisor's half-open try (module docstring)",
                  *_indent(_probe(index, upstream, deployment)), "    }"]
    lines.append("}")
    return "".join(f"    {line}\n" if line else "\n" for line in lines)


def _indent(lines: list[str]) -> list[str]:
    return [f"        {line}" for line in lines]


def _route(index: int, upstream: Upstream, count: int, statuses: str, kind: str) -> list[str]:
    """The directives of route `index`'s location: its upstream, its key, its timeouts, and where a failure goes next."""
    lines = [f"set $qg_route {upstream.label};", f"proxy_pass http://route{index};", 'proxy_set_header Connection "";']
    if kind == "route":
        lines.append(f'proxy_set_header Authorization "Bearer {upstream.api_key}";')
    lines += [f"proxy_read_timeout {_seconds(upstream.timeout_s)};", f"proxy_send_timeout {_seconds(upstream.timeout_s)};",
              f"add_header {ROUTE_HEADER} $qg_route always;"]
    lines.append(f"error_page {statuses} = @{kind}{index + 1 if index + 1 < count else '_verdict'};")
    return lines


def _verdict() -> list[str]:
    """No route answered: 529 when one said it was busy (a 503 or 429 of its own; the sentinel answers 502), else 503."""
    busy = '{"error": {"type": "busy", "code": 529, "message": "every route of this deployment is busy; retry later"}}'
    down = '{"error": {"type": "unavailable", "code": 503, "message": "no route of this deployment can answer (down or failing)"}}'
    return ["default_type application/json;", f"add_header {ROUTE_HEADER} none always;",
            f'if ($upstream_status ~ "(^|[ ,:])({BUSY_STATUSES.replace(" ", "|")})($|[ ,:])") {{', f"    return {BUSY_STATUS} '{busy}\\n';", "}",
            f"return 503 '{down}\\n';"]


def _probe(index: int, upstream: Upstream, deployment: Deployment) -> list[str]:
    """Route `index`'s /health through its own upstream (its breaker): from loopback only, no retry on another server."""
    return ["allow 127.0.0.0/8;", "deny all;", f"set $qg_route {upstream.label};", f"proxy_pass http://route{index}/health;",
            'proxy_set_header Connection "";', "proxy_next_upstream off;", f"proxy_read_timeout {_seconds(PROBE_TIMEOUT_S)};",
            f"proxy_connect_timeout {_seconds(min(PROBE_TIMEOUT_S, deployment.rules.connect_timeout_s))};"]


def write_config(layout: ProxyLayout, text: str) -> None:
    """The config, written 0600 (it holds keys) through the product's atomic writer (a link at the path is replaced,
    never followed); the temp folders nginx's workers write into."""
    layout.prefix.mkdir(parents=True, exist_ok=True)
    layout.temp.mkdir(exist_ok=True)
    write_text_atomic(layout.conf, text, mode=0o600)
