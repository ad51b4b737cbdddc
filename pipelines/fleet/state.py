"""A running deployment's record: its run folder and state.json, written by `quantize serve` and read by `serve status`
and `serve stop`.

    artifacts/serve/<name>/          the run folder (the previous one is kept as <name>.previous)
        state.json                   this module's ServeState, rewritten (write-then-rename) whenever something changes
        client-key                   the key clients send to the endpoint (0600)
        nginx.conf nginx.pid access.log error.log tmp/      the proxy (pipelines/fleet/nginx.py)
        <label>-server.log           each route's vLLM log (a restarted server appends its own after the last)

No key is in state.json. A supervisor is alive when its pid is a live process that started when the state says
(its /proc start time), so a reused pid is never signalled.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Literal

import psutil
from pydantic import Field, ValidationError

from pipelines.errors import InputError
from pipelines.files.atomic import write_json_atomic
from pipelines.files.yamlio import read_user_bytes
from pipelines.fleet.routes import Latency
from pipelines.fleet.traffic import Traffic
from pipelines.schema import StrictModel
from pipelines.settings import current as current_settings

STATE_FILE = "state.json"
CLIENT_KEY_FILE = "client-key"
MAX_STATE_BYTES = 4 * 1024 * 1024
MAX_EVENTS = 200
RouteStatus = Literal["starting", "up", "dead", "restarting", "failed", "stopped"]


class PortEra(StrictModel):
    port: int
    since: float


class RouteState(StrictModel):
    label: str
    ref: str
    kind: Literal["version", "base"]
    model: str
    version: int
    model_dir: str
    verified: str
    status: RouteStatus = "starting"
    why: str = ""
    port: int | None = None
    pid: int | None = None
    log: str
    ports: list[PortEra] = Field(default_factory=list)
    started_at: float | None = None
    startup_s: float | None = None
    restarts: int = 0
    timeout_s: float
    timeout_basis: str
    max_num_seqs: int
    max_conns: int
    vllm_args: str
    latency: Latency | None = None
    breaker_close_bound_s: float | None = Field(default=None, description="the longest its breaker stays open once the route answers "
                                                                          "again (supervisor.breaker_close_bound_s)")
    canary: str = Field(default="", description="the last golden-set probe's summary (pipelines/fleet/health.py); empty: none yet or off")
    canary_at: float | None = None
    canary_down: bool = Field(default=False, description="taken out of the chain (nginx `down`) by a disagreeing canary until one agrees")


class ProxyState(StrictModel):
    pid: int | None = None
    conf: str
    access_log: str
    error_log: str
    sentinel_port: int
    check: str = ""
    reloads: int = 0


class Event(StrictModel):
    at: float
    text: str


class ServeState(StrictModel):
    name: str
    deployment_file: str
    served_model_name: str
    endpoint: str
    client_key_file: str
    supervisor_pid: int
    supervisor_started: float | None = Field(description="the supervisor's start time from /proc (epoch s), to tell a reused pid")
    started_at: float
    phase: Literal["starting", "serving", "stopping", "stopped"] = "starting"
    routes: list[RouteState]
    proxy: ProxyState
    events: list[Event] = Field(default_factory=list)
    traffic: Traffic | None = None
    stopped_at: float | None = None

    def note(self, text: str) -> None:
        self.events = [*self.events, Event(at=time.time(), text=text)][-MAX_EVENTS:]


def serve_root() -> Path:
    return current_settings().artifacts_dir / "serve"


def run_dir(name: str) -> Path:
    return serve_root() / name


def write_state(folder: Path, state: ServeState) -> None:
    write_json_atomic(folder / STATE_FILE, state.model_dump(mode="json"))


def read_state(folder: Path) -> ServeState:
    path = folder / STATE_FILE
    data = read_user_bytes(path, what="deployment state", max_bytes=MAX_STATE_BYTES)
    try:
        return ServeState.model_validate_json(data)
    except ValidationError as error:
        raise InputError(f"not a deployment state this quantgate reads ({error.errors()[0]['msg']})", file=path) from None


def find_state(name: str | None) -> tuple[Path, ServeState]:
    """The named deployment's state, or the only one there is; an InputError listing them otherwise."""
    root = serve_root()
    if name is not None:
        folder = run_dir(name)
        if not (folder / STATE_FILE).is_file():
            raise InputError(f"no deployment {name!r} has run here ({folder} has no {STATE_FILE})", field="DEPLOYMENT")
        return folder, read_state(folder)
    folders = sorted(path.parent for path in root.glob(f"*/{STATE_FILE}") if not path.parent.name.endswith(".previous")) if root.is_dir() else []
    running = [folder for folder in folders if supervisor_alive(read_state(folder))]
    chosen = running or folders
    if len(chosen) != 1:
        names = ", ".join(folder.name for folder in chosen) or "none"
        raise InputError(f"name the deployment (deployments here: {names})", field="DEPLOYMENT")
    return chosen[0], read_state(chosen[0])


def process_start_time(pid: int) -> float | None:
    """When process `pid` started (epoch seconds), or None when there is no such process (or only its zombie)."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def supervisor_alive(state: ServeState) -> bool:
    started = process_start_time(state.supervisor_pid)
    if started is None or state.phase == "stopped":
        return False
    return state.supervisor_started is None or abs(started - state.supervisor_started) < 2.0


def stop_deployment(folder: Path, state: ServeState, *, timeout_s: float = 120.0) -> float:
    """SIGTERM the deployment's supervisor (it stops every process it started) and wait until it is gone; the seconds it took."""
    if not supervisor_alive(state):
        raise InputError(f"deployment {state.name!r} is not running (its supervisor, pid {state.supervisor_pid}, is gone)", file=folder / STATE_FILE)
    began = time.monotonic()
    try:
        os.kill(state.supervisor_pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0.0
    while time.monotonic() - began < timeout_s:
        if process_start_time(state.supervisor_pid) is None:
            return time.monotonic() - began
        time.sleep(0.2)
    raise InputError(f"deployment {state.name!r} did not stop within {timeout_s:.0f} s (pid {state.supervisor_pid})", file=folder / STATE_FILE)
