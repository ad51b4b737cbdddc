"""A running deployment's record: its run folder and state.json, written by `quantize serve` and read by `serve status`
and `serve stop`.

    artifacts/serve/<name>/          the run folder (the previous one is kept as <name>.previous)
        state.json                   this module's ServeState, rewritten (write-then-rename) whenever something changes
        client-key                   the key clients send to the endpoint (0600)
        nginx.conf nginx.pid access.log error.log tmp/      the proxy (pipelines/fleet/nginx.py)
        <label>-server.log           each route's vLLM log (a restarted server appends its own after the last)

No key is in state.json. The state is read as input (pipelines/fleet/run_files.py): the NAME is a safe path component
under artifacts/serve, the file a bounded regular file (never a link or a FIFO) naming its own folder. A supervisor is
alive, and signalled by `serve stop`, only when its pid is the process the supervisor recorded itself as: the same
/proc start time and command line (a forged state naming another process, or recording no start time, is never obeyed).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from pipelines.errors import InputError
from pipelines.files.atomic import write_json_atomic
from pipelines.files.run_input import read_regular
from pipelines.files.safepath import safe_component
from pipelines.fleet.routes import Latency
from pipelines.fleet.run_files import is_own_group_leader, is_recorded_process
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
    process_started: float | None = Field(default=None, description="its vLLM server's /proc start time: the drill signals only that process")
    cmdline: list[str] = Field(default_factory=list, description="its vLLM server's command line, as /proc gave it at the start")
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
    supervisor_cmdline: list[str] = Field(default_factory=list, description="the supervisor's command line from /proc: with the start "
                                                                          "time, what makes a pid the supervisor's")
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
    return serve_root() / safe_component(name, "DEPLOYMENT")


def write_state(folder: Path, state: ServeState) -> None:
    write_json_atomic(folder / STATE_FILE, state.model_dump(mode="json"))


def read_state(folder: Path) -> ServeState:
    path = folder / STATE_FILE
    if folder.is_symlink():
        raise InputError("the deployment's run folder is a symbolic link; refused", file=folder)
    data = read_regular(path, "deployment state", MAX_STATE_BYTES)
    try:
        state = ServeState.model_validate_json(data)
    except ValidationError as error:
        raise InputError(f"not a deployment state this quantgate reads ({error.errors()[0]['msg']})", file=path) from None
    if state.name != folder.name:
        raise InputError(f"names deployment {state.name[:80]!r}, not its own folder's {folder.name!r}; refused", file=path, field="name")
    return state


def find_state(name: str | None) -> tuple[Path, ServeState]:
    """The named deployment's state, or the only one there is; an InputError listing them otherwise."""
    root = serve_root()
    if name is not None:
        folder = run_dir(name)
        if not os.path.lexists(folder / STATE_FILE):
            raise InputError(f"no deployment {name!r} has run here ({folder} has no {STATE_FILE})", field="DEPLOYMENT")
        return folder, read_state(folder)
    folders = sorted(path.parent for path in root.glob(f"*/{STATE_FILE}") if not path.parent.name.endswith(".previous")) if root.is_dir() else []
    running = [folder for folder in folders if supervisor_alive(read_state(folder))]
    chosen = running or folders
    if len(chosen) != 1:
        names = ", ".join(folder.name for folder in chosen) or "none"
        raise InputError(f"name the deployment (deployments here: {names})", field="DEPLOYMENT")
    return chosen[0], read_state(chosen[0])


def supervisor_alive(state: ServeState) -> bool:
    """Whether the state's supervisor runs: its pid is the process it recorded (start time and command line)."""
    return state.phase != "stopped" and is_recorded_process(state.supervisor_pid, state.supervisor_started, state.supervisor_cmdline)


def route_process_verified(state: ServeState, route: RouteState) -> bool:
    """Whether the route's pid is the server its live supervisor started: recorded start time and command line, the
    supervisor's child, leading its own process group (so a group signal reaches that server and nothing else)."""
    return (supervisor_alive(state) and route.pid is not None and is_recorded_process(route.pid, route.process_started, route.cmdline)
            and is_own_group_leader(route.pid, state.supervisor_pid))


def stop_deployment(folder: Path, state: ServeState, *, timeout_s: float = 120.0) -> float:
    """SIGTERM the deployment's supervisor (it stops every process it started) and wait until it is gone; the seconds it took."""
    if not supervisor_alive(state):
        raise InputError(f"deployment {state.name!r} is not running: pid {state.supervisor_pid} is not the supervisor it recorded (gone, or "
                         "another process: its start time or command line differ, or none was recorded); nothing signalled", file=folder / STATE_FILE)
    began = time.monotonic()
    try:
        os.kill(state.supervisor_pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0.0
    while time.monotonic() - began < timeout_s:
        if not supervisor_alive(state):
            return time.monotonic() - began
        time.sleep(0.2)
    raise InputError(f"deployment {state.name!r} did not stop within {timeout_s:.0f} s (pid {state.supervisor_pid})", file=folder / STATE_FILE)
