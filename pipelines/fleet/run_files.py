"""What `serve status`, `serve stop` and `serve drill` read from a deployment's run folder is input, never trusted.

Anyone who can write under artifacts/ can forge a state.json, swap a log for a FIFO or the client key for /dev/zero.
So every read is of a regular file named by the folder's own layout (never a path taken from the state), through the
product's one reader of run-folder files (pipelines/files/run_input.py: lstat first, no link, FIFO or device opened,
the same inode re-checked, bounded in bytes). A pid from the
state is signalled only when it is the very process the supervisor started: its start time and command line, read
from /proc now, equal those the supervisor recorded (no recorded start time or command line: never signalled). The
drill's endpoint is the deployment's own loopback listener, and its key the folder's own key file.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from pipelines.errors import InputError
from pipelines.files.run_input import read_regular

MAX_KEY_BYTES = 4096
START_TIME_TOLERANCE_S = 1.0


def read_client_key(folder: Path, file_name: str) -> str:
    """The deployment's client key from the folder's own key file: one short line of URL-safe characters."""
    path = folder / file_name
    data = read_regular(path, "client key file", MAX_KEY_BYTES)
    key = data.decode("ascii", errors="replace").strip()
    if not key or any(not (char.isascii() and (char.isalnum() or char in "-_")) for char in key):
        raise InputError("the client key file does not hold a key this quantgate wrote (one line of letters, digits, '-', '_')", file=path)
    return key


def process_identity(pid: int) -> tuple[float, list[str]] | None:
    """The live process `pid`'s start time (epoch s) and command line; None when there is none (or only its zombie)."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            if process.status() == psutil.STATUS_ZOMBIE:
                return None
            return process.create_time(), process.cmdline()
    except (psutil.Error, OSError, ValueError):
        return None


def is_recorded_process(pid: int | None, started: float | None, cmdline: list[str] | None) -> bool:
    """Whether `pid` is the very process recorded as started at `started` with `cmdline`; an unrecorded one never is."""
    if pid is None or pid <= 1 or started is None or not cmdline:
        return False
    identity = process_identity(pid)
    if identity is None:
        return False
    now_started, now_cmdline = identity
    return abs(now_started - started) < START_TIME_TOLERANCE_S and now_cmdline == cmdline


def is_own_group_leader(pid: int, parent: int) -> bool:
    """Whether `pid` is a child of `parent` leading its own process group (how the supervisor starts each server)."""
    try:
        return psutil.Process(pid).ppid() == parent and os.getpgid(pid) == pid
    except (psutil.Error, OSError):
        return False


def loopback_endpoint(endpoint: str, where: Path) -> str:
    """`endpoint` when it is the supervisor's own shape, http://<IPv4 loopback>:<port>/v1; an InputError otherwise."""
    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname, parts.port
        loopback = host is not None and ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        loopback, port = False, None
    if (not loopback or port is None or parts.scheme != "http" or parts.path != "/v1" or parts.username or parts.password
            or parts.query or parts.fragment):
        shown = endpoint if len(endpoint) <= 80 else endpoint[:77] + "..."
        raise InputError(f"the deployment's endpoint {shown!r} is not a loopback address this quantgate writes (http://127.x.x.x:PORT/v1)"
                         "; refused", file=where, field="endpoint")
    return endpoint
