"""`quantize serve DEPLOYMENT.yaml`: every route's vLLM server and the nginx in front of them, kept running until stopped.

Order of work, so that bad input starts nothing: the file is parsed, every route resolved and verified
(pipelines/fleet/routes.py), the chain's memory checked against the machine (fit.py), nginx found, the endpoint's
port checked, and a config of the final shape checked with `nginx -t`; only then do servers start, one after the
other (each waits for /health and confirms it is ours), then nginx, on a config rewritten with the real ports and
keys and checked again.

While serving, once a second: a route whose server died is restarted (rules.server_death) on a new port, with a new
key, and nginx reloaded (SIGHUP) on the rewritten, re-checked config (a reload starts every breaker closed: the restarted
route takes the next request); a server silent on /health for `hung_after_s` is restarted too; a route whose breaker is
open is probed through nginx (nginx.py PROBE_PREFIX), so the half-open try after fail_timeout is the supervisor's, and
the breaker closes within `breaker_close_bound_s` of the route's recovery without a client request; nginx itself is
restarted if it dies; the proxy's logs are folded into the deployment's traffic (traffic.py) and state.json is rewritten.

Each version route's golden set is its health check beside /health (pipelines/fleet/health.py): a route that answers but
disagrees beyond the recorded tolerance is taken out of the chain (nginx `down`, reloaded) until a later probe agrees.

A fallback that cannot start (its server dies at start-up) does not stop the deployment: it serves degraded, the route
`dead` with why, restarted under rules.server_death like any dead route, and `serve status` says the chain has no
working fallback. A primary that cannot start is an error (exit 2): there is nothing to serve it with.

Every process started here dies with this one, however it ends: each vLLM server through the product's own
`vllm_server` (its process group, parent-death signal and watchdog: pipelines/serve/serving.py and reclaim.py), nginx
through its process life in proxy.py, the same guarantees. A server's health is the product's one probe (serve/health.py).
Ctrl-C and SIGTERM (`quantize serve stop` sends it) stop them all.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
from pydantic import Field

from pipelines.canary.golden import GoldenSet
from pipelines.console.output import progress
from pipelines.errors import InputError, ServeError
from pipelines.files.atomic import storage_error, write_text_atomic
from pipelines.fleet.cores import CorePlan, allowed_cores, plan_cores
from pipelines.fleet.deployment import Deployment
from pipelines.fleet.fit import FitReport, check_fit
from pipelines.fleet.health import CanaryChecks, Probed, load_goldens
from pipelines.fleet.metrics import RouteSeries, write_metrics
from pipelines.fleet.nginx import (
    PROBE_PREFIX,
    PROBE_TIMEOUT_S,
    ProxyLayout,
    Upstream,
    max_conns,
    render_config,
    write_config,
)
from pipelines.fleet.proxy import NginxProcess, ProxyError, check_config, find_nginx
from pipelines.fleet.routes import ResolvedRoute, resolve_routes
from pipelines.fleet.run_files import process_identity
from pipelines.fleet.state import (
    CLIENT_KEY_FILE,
    PortEra,
    ProxyState,
    RouteState,
    ServeState,
    read_state,
    run_dir,
    supervisor_alive,
    write_state,
)
from pipelines.fleet.traffic import LogTail, TrafficCounter
from pipelines.hardware.targets import installed_target
from pipelines.registry.store import Registry
from pipelines.schema import StrictModel
from pipelines.serve.health import healthy
from pipelines.serve.reclaim import exit_description
from pipelines.serve.serving import (
    LOOPBACK,
    RunningServer,
    ServeSettings,
    free_port,
    log_tail,
    vllm_server,
)

TICK_S = 1.0
WARM_UP_TIMEOUT_S = 120.0  # a first completion slower than this is a server to let the breaker judge
RESTART_STARTUP_FACTOR = 4.0
RESTART_STARTUP_FLOOR_S = 120.0
PLACEHOLDER_KEY = "k" * len(secrets.token_urlsafe(32))  # as long as a real key: nginx's map buckets depend on it


class Prepared(StrictModel):
    """Everything checked before anything starts."""

    deployment: Deployment
    source: Path
    routes: list[ResolvedRoute]
    fit: FitReport
    nginx: Path
    nginx_check: str
    cores: CorePlan | None = None  # each route's cores on a CPU host (cores.py); None on a GPU
    goldens: list[GoldenSet | None] = Field(default_factory=list, description="each route's golden set (health.py); none: not probed")


def prepare(deployment: Deployment, source: Path, registry: Registry, *, nginx: str | None = None) -> Prepared:
    """Verify every route, the fit, nginx, the endpoint's port and a config of the final shape; start nothing."""
    folder = run_dir(deployment.name)
    if (folder / "state.json").is_file() and supervisor_alive(previous := read_state(folder)):
        raise InputError(f"deployment {deployment.name!r} is already running (pid {previous.supervisor_pid}); `quantize serve stop "
                         f"{deployment.name}` first", file=source, field="name")
    routes = resolve_routes(deployment, registry, source=source)
    routes, cores = _pin_cores(routes)
    fit = check_fit(routes, source=source)
    binary = find_nginx(nginx)
    if not port_free(deployment.listen.host, deployment.listen.port):
        raise InputError(f"port {deployment.listen.port} on {deployment.listen.host} is already in use", file=source, field="listen.port")
    check = _dry_check(deployment, routes, binary)
    goldens = load_goldens(routes, deployment.rules.canary_every_s)
    return Prepared(deployment=deployment, source=source, routes=routes, fit=fit, nginx=binary, nginx_check=check, cores=cores, goldens=goldens)


def _pin_cores(routes: list[ResolvedRoute]) -> tuple[list[ResolvedRoute], CorePlan | None]:
    """On vLLM's CPU build, each route's worker on its own cores (cores.py); a GPU's servers are not pinned."""
    if installed_target().kind != "cpu":
        return routes, None
    plan = plan_cores(allowed_cores(), len(routes))
    pinned = [route.model_copy(update={"serve": route.serve.model_copy(update={"cpu_cores": cores})})
              for route, cores in zip(routes, plan.cores, strict=True)]
    return pinned, plan


def _dry_check(deployment: Deployment, routes: list[ResolvedRoute], binary: Path) -> str:
    """`nginx -t` on the config the chain will have (placeholder ports and keys), in a scratch prefix."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="quantgate-nginx-check-") as scratch:
        layout = ProxyLayout(prefix=Path(scratch), listen_host=deployment.listen.host, listen_port=deployment.listen.port,
                             sentinel_port=free_port(), client_key=PLACEHOLDER_KEY)
        upstreams = [Upstream(label=route.label, address=f"{LOOPBACK}:{free_port()}", api_key=PLACEHOLDER_KEY, timeout_s=route.timeout_s,
                              max_conns=max_conns(route.serve)) for route in routes]
        write_config(layout, render_config(deployment, layout, upstreams))
        return check_config(binary, layout)


def port_free(host: str, port: int) -> bool:
    """Nothing listens on host:port (bound as nginx binds: SO_REUSEADDR, so connections of a previous run in TIME_WAIT do
    not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def breaker_close_bound_s(deployment: Deployment, timeout_s: float) -> float:
    """How long after a route recovers (answers again) its breaker may stay open: its last failure comes at most one
    route timeout after the fault ended, nginx keeps the server down fail_timeout after that (whole seconds: + 1 s), and the
    supervisor's probe tries it within a tick, waiting at most the probe's timeout. A restarted route needs none of it: the
    reload that brings it in starts every breaker closed."""
    return timeout_s + deployment.circuit_breaker.retry_after_s + 1.0 + TICK_S + PROBE_TIMEOUT_S


def warm_up(server: RunningServer) -> float | None:
    """One completion straight to a server that has just passed /health, before it is let into the chain: vLLM's first
    requests on a just-started CPU server took 27-36 s (measured), so a route let in cold times them out, fails them over
    and opens its own breaker (a drill measured the restarted primary answering 39 s after its restart). The seconds it
    took, or None when it did not answer (the route is let in anyway: its breaker is the judge)."""
    started = time.monotonic()
    try:
        httpx.post(f"{server.base_url}/completions", json={"model": server.served_name, "prompt": "Hello", "max_tokens": 1},
                   headers=server.auth_headers, timeout=WARM_UP_TIMEOUT_S).raise_for_status()
    except httpx.HTTPError:
        return None
    return time.monotonic() - started


def vllm_args(route: ResolvedRoute) -> str:
    pinned = [f"VLLM_CPU_OMP_THREADS_BIND={route.serve.cpu_cores}"] if route.serve.cpu_cores is not None else []
    return " ".join([*route.serve.vllm_args(), f"VLLM_CPU_KVCACHE_SPACE={route.serve.cpu_kv_cache_gib}", *pinned])


class RouteServer:
    """One route's vLLM server, started through the product's own `vllm_server` and restartable."""

    def __init__(self, route: ResolvedRoute, served_name: str, log: Path):
        self.route = route
        self.served_name = served_name
        self.log = log
        self.stack: ExitStack | None = None
        self.server: RunningServer | None = None
        self.first_startup_s: float | None = None

    def start(self, while_waiting: Callable[[], None] | None = None) -> RunningServer:
        stack = ExitStack()
        try:
            self.server = stack.enter_context(vllm_server(self.route.model_dir, log_path=self.log, settings=self._settings(),
                                                          served_name=self.served_name, while_waiting=while_waiting,
                                                          non_finite_literals=False))  # production clients expect standard JSON
        except BaseException:
            stack.close()
            raise
        self.stack = stack
        if self.first_startup_s is None:
            self.first_startup_s = self.server.startup_s
        return self.server

    def _settings(self) -> ServeSettings:
        """A restart gets RESTART_STARTUP_FACTOR x the first start-up (at least RESTART_STARTUP_FLOOR_S, at most the
        route's own timeout): a restart that takes longer is stuck, and the next restart is a better bet than waiting
        (measured: one restart in three on the 2-core host printed nothing in 300 s, its neighbours restarted in 45-80 s)."""
        if self.first_startup_s is None:
            return self.route.serve
        deadline = max(RESTART_STARTUP_FLOOR_S, RESTART_STARTUP_FACTOR * self.first_startup_s)
        return self.route.serve.model_copy(update={"startup_timeout_s": min(self.route.serve.startup_timeout_s, deadline)})

    def stop(self) -> None:
        stack, self.stack, self.server = self.stack, None, None
        if stack is not None:
            stack.close()

    def exit_code(self) -> int | None:
        """None while the server runs (or was never started), else its exit code."""
        return self.server.process.poll() if self.server is not None else None

    def healthy(self) -> bool:
        return self.server is not None and healthy(self.server.port)


class Supervisor:
    """The running deployment: its servers, its proxy, its state file."""

    def __init__(self, prepared: Prepared):
        self.prepared = prepared
        deployment = prepared.deployment
        self.deployment = deployment
        self.folder = run_dir(deployment.name)
        self.servers = [RouteServer(route, deployment.model_name, self.folder / f"{route.label}-server.log") for route in prepared.routes]
        self.layout = ProxyLayout(prefix=self.folder, listen_host=deployment.listen.host, listen_port=deployment.listen.port,
                                  sentinel_port=free_port(), client_key=secrets.token_urlsafe(32))
        self.proxy = NginxProcess(prepared.nginx, self.layout)
        self.counter = TrafficCounter([route.label for route in prepared.routes], self.layout.sentinel_port)
        self.access = LogTail(self.layout.access_log)
        self.errors = LogTail(self.layout.error_log)
        self.silent_since: dict[int, float] = {}
        self.route_series = RouteSeries()
        self.canary = CanaryChecks(prepared.goldens or [None] * len(prepared.routes), deployment.rules.canary_every_s, deployment.model_name)
        self.state = self._initial_state()

    # --- the run folder and its state ---------------------------------------------------------------

    def _initial_state(self) -> ServeState:
        me, (started, cmdline) = os.getpid(), process_identity(os.getpid()) or (None, [])
        routes = [
            RouteState(label=route.label, ref=route.ref, kind=route.kind, model=route.model, version=route.version, model_dir=str(route.model_dir),
                       verified=route.verified, log=str(server.log), timeout_s=route.timeout_s, timeout_basis=route.timeout_basis,
                       max_num_seqs=route.serve.max_num_seqs, max_conns=max_conns(route.serve), vllm_args=vllm_args(route),
                       latency=route.latency, breaker_close_bound_s=breaker_close_bound_s(self.deployment, route.timeout_s))
            for route, server in zip(self.prepared.routes, self.servers, strict=True)
        ]
        return ServeState(
            name=self.deployment.name, deployment_file=str(self.prepared.source), served_model_name=self.deployment.model_name,
            endpoint=f"http://{self.layout.listen_host}:{self.layout.listen_port}/v1", client_key_file=str(self.folder / CLIENT_KEY_FILE),
            supervisor_pid=me, supervisor_started=started, supervisor_cmdline=cmdline, started_at=time.time(), routes=routes,
            proxy=ProxyState(conf=str(self.layout.conf), access_log=str(self.layout.access_log), error_log=str(self.layout.error_log),
                             sentinel_port=self.layout.sentinel_port, check=self.prepared.nginx_check),
        )

    def _prepare_folder(self) -> None:
        try:
            if self.folder.exists():
                previous = self.folder.with_name(f"{self.folder.name}.previous")
                shutil.rmtree(previous, ignore_errors=True)
                self.folder.rename(previous)
            self.folder.mkdir(parents=True)
            write_text_atomic(self.folder / CLIENT_KEY_FILE, self.layout.client_key + "\n", mode=0o600)
        except OSError as error:
            raise storage_error(error, self.folder) from error

    def save(self) -> None:
        self.state.traffic = self.counter.traffic
        write_state(self.folder, self.state)
        self.route_series.refresh(self.state)
        write_metrics(self.folder, self.state, self.route_series)

    def note(self, text: str) -> None:
        self.state.note(text)
        progress(text)

    # --- start, serve, stop ---------------------------------------------------------------------------

    def run(self) -> ServeState:
        """Start everything, serve until interrupted (Ctrl-C, SIGTERM), stop everything; the final state."""
        self._prepare_folder()
        self.save()
        try:
            for index, server in enumerate(self.servers):
                self._first_start(index, server)
            self._start_proxy()
            self.state.phase = "serving"
            self.note(f"serving {self.deployment.model_name!r} at {self.state.endpoint} (key: {self.state.client_key_file}); "
                      f"`quantize serve status {self.deployment.name}`, Ctrl-C or `quantize serve stop {self.deployment.name}` to stop")
            self.save()
            self._watch()
        except KeyboardInterrupt:
            if self.state.phase != "serving":  # interrupted while starting: an interruption (exit 2); while serving: how it ends
                raise
        finally:
            self._stop_all()
        return self.state

    def _first_start(self, index: int, server: RouteServer) -> None:
        """The primary must start (else nothing serves it: the error ends `serve`); a fallback that cannot start leaves the
        deployment serving degraded, the route dead and restarted like any dead route (module docstring)."""
        try:
            self._start_route(index, server)
        except ServeError as error:
            if index == 0 or isinstance(error, ProxyError):
                raise
            state = self.state.routes[index]
            server.stop()
            state.status, state.why = "dead", f"did not start: {error.one_line()}"
            self.note(f"serving degraded: {state.label} ({state.ref}) {state.why}")
            self.save()

    def _start_route(self, index: int, server: RouteServer) -> None:
        state = self.state.routes[index]
        state.status = "starting"
        self.save()
        # A new server's silence is timed from its own start: a silence that began before (its predecessor's death, seen
        # on /health a tick before its exit) made the restarted primary "hung" 3 s after a 15 s SIGSTOP (measured).
        self.silent_since.pop(index, None)
        # While one route (re)starts, for up to minutes, the proxy is still watched: it is what every other route is reached by.
        running = server.start(while_waiting=self._keep_proxy if self.proxy.pid is not None else None)
        warm_s = warm_up(running)
        if warm_s is None:
            self.note(f"{state.label}: its first completion did not answer within {WARM_UP_TIMEOUT_S:g} s; let in cold")
        state.status, state.why = "up", ""
        state.port, state.pid, state.started_at, state.startup_s = running.port, running.process.pid, time.time(), running.startup_s
        state.process_started, state.cmdline = process_identity(running.process.pid) or (None, [])
        state.ports = [*state.ports, PortEra(port=running.port, since=time.time())]
        self.save()

    def _upstreams(self) -> list[Upstream]:
        out = []
        for route, server, state in zip(self.prepared.routes, self.servers, self.state.routes, strict=True):
            running = server.server
            # A route without a server (dead, restart failed) keeps its last port: nothing listens there, nginx fails over.
            port = running.port if running is not None else (state.port or free_port())
            key = running.api_key if running is not None and running.api_key else PLACEHOLDER_KEY
            out.append(Upstream(label=route.label, address=f"{LOOPBACK}:{port}", api_key=key, timeout_s=route.timeout_s, max_conns=state.max_conns,
                                down=state.canary_down))
        return out

    def _write_proxy_config(self) -> None:
        write_config(self.layout, render_config(self.deployment, self.layout, self._upstreams()))
        self.state.proxy.check = self.proxy.check()

    def _start_proxy(self) -> None:
        self._write_proxy_config()
        progress(f"starting nginx on {self.layout.listen_host}:{self.layout.listen_port} (config: {self.layout.conf})")
        try:
            self.proxy.start()
        finally:
            self.state.proxy.pid = self.proxy.pid

    def _stop_all(self) -> None:
        if self.state.phase == "stopped":
            return
        self.state.phase = "stopping"
        self.canary.close()
        self.proxy.stop()
        for server, state in zip(self.servers, self.state.routes, strict=True):
            server.stop()
            state.status = "stopped" if state.status != "failed" else state.status
        self._fold_logs()
        self.state.phase, self.state.stopped_at = "stopped", time.time()
        self.state.note("stopped: every server and nginx")
        self.save()

    # --- the watch loop -------------------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            time.sleep(TICK_S)
            for index, server in enumerate(self.servers):
                self._check_route(index, server)
            self._keep_proxy()
            self._probe_open_breakers()
            self._canary_tick()
            self.save()

    def _canary_tick(self) -> None:
        """Take in a finished golden-set probe; start the next one due (health.py: one at a time, in the background)."""
        done = self.canary.finished()
        if done is not None:
            self._canary_verdict(done)
        now = time.monotonic()
        for index, (server, state) in enumerate(zip(self.servers, self.state.routes, strict=True)):
            running = server.server
            if running is not None and state.status == "up" and self.canary.due(index, now):
                self.canary.start(index, running.port, running.api_key, state.timeout_s)
                return

    def _canary_verdict(self, probed: Probed) -> None:
        """A route that answered but disagreed leaves the chain until a probe agrees; a probe without answers decides nothing."""
        state, result = self.state.routes[probed.index], probed.result
        if state.port != probed.port:  # the route was restarted meanwhile: this was its predecessor
            return
        state.canary, state.canary_at = result.summary(), time.time()
        disagrees = result.error is None and not result.healthy
        if disagrees and not state.canary_down:
            state.canary_down = True
            self.note(f"{state.label} ({state.ref}): canary: {result.summary()}; taken out of the chain until a probe agrees")
            self._reload_proxy(f"{state.label} marked down by its canary")
            self.counter.open_breaker(probed.index, time.time(), f"canary: {result.summary()}")
        elif result.healthy and state.canary_down:
            state.canary_down = False
            self.note(f"{state.label} ({state.ref}): canary: {result.summary()}; back in the chain")
            self._reload_proxy(f"{state.label} back: its canary agrees")

    def _probe_open_breakers(self) -> None:
        """Each route whose breaker is open (as the proxy's logs say) and whose server runs: its /health through nginx, which
        is the half-open try once fail_timeout has passed; its answer closes the breaker (traffic.py reads it in the log)."""
        for index, (traffic, state) in enumerate(zip(self.counter.traffic.routes, self.state.routes, strict=True)):
            if traffic.breaker_open_since is None or state.status != "up" or state.canary_down or self.proxy.pid is None:
                continue
            try:
                httpx.get(f"http://{self.layout.listen_host}:{self.layout.listen_port}{PROBE_PREFIX}route{index}", timeout=PROBE_TIMEOUT_S + 1.0)
            except httpx.HTTPError:
                pass  # the proxy's own log has the outcome; a dead proxy is restarted by _check_proxy

    def _fold_logs(self) -> None:
        ports = {era.port: index for index, state in enumerate(self.state.routes) for era in state.ports}
        self.counter.feed(self.access.new_lines(), self.errors.new_lines(), ports)

    def _check_route(self, index: int, server: RouteServer) -> None:
        state = self.state.routes[index]
        code = server.exit_code()
        if code is not None:
            self._route_died(index, server, f"process exited ({exit_description(code)})")
        elif server.server is not None and self.deployment.rules.server_death.hung_after_s is not None:
            self._check_hung(index, server)
        elif server.server is None and state.status == "dead":
            self._restart(index, server)

    def _check_hung(self, index: int, server: RouteServer) -> None:
        hung_after = self.deployment.rules.server_death.hung_after_s
        assert hung_after is not None
        if server.healthy():
            self.silent_since.pop(index, None)
            return
        since = self.silent_since.setdefault(index, time.time())
        if time.time() - since >= hung_after:
            self.silent_since.pop(index, None)
            self._route_died(index, server, f"no answer on /health for {hung_after:g} s (hung)")

    def _route_died(self, index: int, server: RouteServer, why: str) -> None:
        state = self.state.routes[index]
        self.note(f"{state.label} ({state.ref}): {why}")
        server.stop()  # sweeps what is left of its process group
        state.status, state.why, state.pid = "dead", f"{why} at {time.strftime('%H:%M:%S')}", None
        self.save()
        self._restart(index, server)

    def _restart(self, index: int, server: RouteServer) -> None:
        rules = self.deployment.rules.server_death
        state = self.state.routes[index]
        if not rules.restart or state.restarts >= rules.max_restarts:
            if state.status != "failed":
                state.status = "failed"
                state.why += f"; not restarted ({'restart: false' if not rules.restart else f'{rules.max_restarts} restarts used'})"
                self.note(f"{state.label}: {state.why}")
            return
        state.restarts += 1
        state.status = "restarting"
        self.note(f"{state.label}: restarting (restart {state.restarts} of {rules.max_restarts})")
        self.save()
        try:
            self._start_route(index, server)
        except ProxyError:
            raise  # nginx could not be started again while this route started: the deployment's end, not this route's
        except ServeError as error:
            state.status, state.why = "dead", f"restart failed: {error.one_line()}"
            self.note(f"{state.label}: {state.why}")
            return
        self._reload_proxy(f"{state.label} is back on port {state.port}")

    def _reload_proxy(self, why: str) -> None:
        try:
            self._write_proxy_config()
        except InputError as error:
            self.note(f"nginx not reloaded, the new config was refused: {error.one_line()}")
            return
        if self.proxy.pid is not None:
            self._fold_logs()  # the openings before the reload, before the reload closes them
            self.proxy.reload()
            self.state.proxy.reloads += 1
            kept_out = frozenset(index for index, state in enumerate(self.state.routes) if state.canary_down)
            self.counter.reset_breakers(time.time(), f"nginx reloaded ({why}): a reload starts every breaker closed", keep=kept_out)
            self.note(f"nginx reloaded: {why}")

    def _keep_proxy(self) -> None:
        """What the watch loop does for nginx, also done while a route starts: restart it if it died, fold its logs."""
        self._check_proxy()
        self._fold_logs()

    def _check_proxy(self) -> None:
        code = self.proxy.exit_code()
        if code is None:
            return
        said = log_tail(self.proxy.console_log, 2)  # nginx's own words, or its watchdog's if it stopped the group
        self.note(f"nginx exited ({exit_description(code)}; its console: {said}); starting it again")
        self.proxy.stop()
        self._start_proxy()
        self.save()
