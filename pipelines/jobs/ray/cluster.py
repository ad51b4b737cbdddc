"""The driver's connection to Ray: an existing cluster (`--ray-address host:port | ray://host:port | auto`) or,
without an address, a local one started for the job (small object store, no dashboard). An address that
does not answer is refused in seconds, before any work. Workers get the driver's environment (the artifacts
root, the registry, offline flags...) through the job's runtime environment.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pipelines.errors import InputError
from pipelines.jobs.ray.address import ADDRESS_FIELD, check_address
from pipelines.jobs.ray.leftovers import end_session_processes, session_processes
from pipelines.jobs.ray.probe import ProbeWritten, check_probes, new_nonce, write_probe
from pipelines.jobs.ray.worker import DRIVER_SET_THREADS
from pipelines.serve.reclaim import owner_alive
from pipelines.settings import current as current_settings

PROBE_TIMEOUT_S = 120.0
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2  # results are small pydantic models; the data is on the shared store
# Ray's deepest socket is <root>/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store: about 65 characters below
# the root, within the 107 bytes of a unix socket's path.
MAX_SESSION_ROOT_CHARS = 40
SESSION_LINK_PREFIX = "quantgate-ray-"


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


@contextmanager
def connected(address: str | None) -> Iterator[Any]:
    """Ray, connected for the block; on the way out (an error, SIGTERM) the tasks still pending are cancelled
    (their workers and, through their watchdogs, their vLLM servers stopped) and the connection closed. The address is
    checked before Ray is imported; a runtime started here keeps its session folder under the artifacts root and ends
    with the block, none of its processes left (pipelines/jobs/ray/leftovers.py)."""
    field = ADDRESS_FIELD if address is not None else "RAY_ADDRESS"
    address = address if address is not None else os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        check_address(address, field)
    import ray  # heavy: imported when used, after the address is checked

    options: dict[str, Any] = {"runtime_env": {"env_vars": worker_environment()}, "logging_level": logging.WARNING}
    temp_dir: Path | None = None
    with ExitStack() as cleanup:
        if address is None:  # "local": a new Ray for this job, never one another user started on this machine
            temp_dir = cleanup.enter_context(session_root())
            options.update(object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False, _temp_dir=str(temp_dir))
        try:
            ray.init(address=address or "local", **options)
        except (ConnectionError, RuntimeError, ValueError, OSError) as error:
            reason = " ".join(str(error.__cause__ or error).split())  # Ray's own cause (an auth token refused...) says more
            raise InputError(f"cannot connect to the Ray cluster at {address or 'local'}: {reason[:400]}", field=field) from None
        try:
            yield ray
        finally:
            _shutdown(ray, temp_dir)


def _shutdown(ray: Any, session_root: Path | None) -> None:
    """Disconnect; a runtime started for the job (`session_root`) is stopped with every process of it (leftovers.py)."""
    processes = session_processes(session_root) if session_root is not None else []
    try:
        ray.shutdown()
    finally:
        end_session_processes(processes)


@contextmanager
def session_root() -> Iterator[Path]:
    """Where a Ray runtime started for the job keeps its sessions (logs, sockets, spilled objects): <artifacts>/ray, never
    the system's temporary folder. Ray puts unix sockets about 65 characters deep in it, and a socket's path is limited to
    107 bytes: a root too deep for that is reached through a short link in the system's temporary folder
    (`quantgate-ray-<pid>`, removed when the job ends, and by the next job if this one was killed), the files stay under it."""
    root = current_settings().artifacts_dir.resolve() / "ray"
    root.mkdir(parents=True, exist_ok=True)
    if len(str(root)) <= MAX_SESSION_ROOT_CHARS:
        yield root
        return
    reclaim_session_links()
    link = Path(tempfile.gettempdir()) / f"{SESSION_LINK_PREFIX}{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(root, target_is_directory=True)
    try:
        yield link
    finally:
        link.unlink(missing_ok=True)


def reclaim_session_links() -> list[Path]:
    """Remove the short links to session roots that killed jobs left in the system's temporary folder (their pid gone)."""
    removed = []
    for link in Path(tempfile.gettempdir()).glob(f"{SESSION_LINK_PREFIX}*"):
        pid = link.name.removeprefix(SESSION_LINK_PREFIX)
        if link.is_symlink() and pid.isdigit() and not owner_alive(int(pid), link.lstat().st_mtime):
            link.unlink(missing_ok=True)
            removed.append(link)
    return removed


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
