"""The driver's connection to Ray: an existing cluster (`--ray-address host:port | ray://host:port | auto`) or,
without an address, a local one started for the job (small object store, no dashboard). An address that
does not answer is refused in seconds, before any work. Workers get the driver's environment (the artifacts
root, the registry, offline flags...) through the job's runtime environment.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipelines.errors import InputError
from pipelines.jobs.ray.probe import ProbeWritten, check_probes, new_nonce, write_probe
from pipelines.jobs.ray.worker import DRIVER_SET_THREADS
from pipelines.settings import current as current_settings

CONNECT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 120.0
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2  # results are small pydantic models; the data is on the shared store
ADDRESS_FIELD = "--ray-address"


class Node(dict):
    """An alive node as `ray.nodes()` describes it."""

    @property
    def node_id(self) -> str:
        return str(self["NodeID"])

    @property
    def resources(self) -> dict[str, float]:
        return dict(self.get("Resources", {}))


def worker_environment() -> dict[str, str]:
    """The driver's environment for the workers, the artifacts root and registry pinned to absolute paths (a
    worker's checkout may live elsewhere); Ray's own variables stay the node's."""
    settings = current_settings()
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    env["QUANTGATE_ARTIFACTS"] = str(settings.artifacts_dir.resolve())
    env["QUANTGATE_REGISTRY"] = str(settings.registry_path.resolve())
    env[DRIVER_SET_THREADS] = "1" if "OMP_NUM_THREADS" in os.environ else "0"
    return env


def check_address(address: str) -> None:
    """`auto`, `host:port` or `ray://host:port`; a host:port that refuses a TCP connection is an InputError."""
    if address == "auto":
        return
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if parts.scheme not in ("tcp", "ray") or not host or port is None:
        raise InputError(f"not a Ray address (auto, HOST:PORT or ray://HOST:PORT): {address!r}", field=ADDRESS_FIELD)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise InputError(f"the Ray cluster at {address} is unreachable: {error}", field=ADDRESS_FIELD) from None


@contextmanager
def connected(address: str | None) -> Iterator[Any]:
    """Ray, connected for the block; on the way out (an error, SIGTERM) the tasks still pending are cancelled
    (their workers and, through their watchdogs, their vLLM servers stopped) and the connection closed."""
    import ray  # heavy: imported when used

    address = address if address is not None else os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        check_address(address)
    options: dict[str, Any] = {"runtime_env": {"env_vars": worker_environment()}, "logging_level": logging.WARNING}
    if address is None:  # "local": a new Ray for this job, never one another user started on this machine
        options.update(object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False)
    try:
        ray.init(address=address or "local", **options)
    except (ConnectionError, RuntimeError, ValueError) as error:
        reason = " ".join(str(error.__cause__ or error).split())  # Ray's own cause (an auth token refused...) says more
        raise InputError(f"cannot connect to the Ray cluster at {address}: {reason[:400]}", field=ADDRESS_FIELD) from None
    try:
        yield ray
    finally:
        ray.shutdown()


def alive_nodes(ray: Any) -> list[Node]:
    return [Node(node) for node in ray.nodes() if node.get("Alive")]


def probe_shared_store(ray: Any, root: Path, nodes: list[Node]) -> None:
    """Every node writes a probe under `root`, the driver reads each back (pipelines.jobs.ray.probe)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # heavy: imported when used

    nonce = new_nonce()
    remote = ray.remote(num_cpus=0, max_retries=0)(write_probe)
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote(root, nonce, node.node_id)
        for node in nodes
    ]
    try:
        written: list[ProbeWritten] = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise InputError(f"a node did not answer the shared-store probe within {PROBE_TIMEOUT_S:.0f} s", file=root) from None
    check_probes(root, nonce, written)
