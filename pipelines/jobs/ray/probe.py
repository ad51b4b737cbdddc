"""The shared store, checked rather than assumed: before any work, a task on every node writes a probe file
with a fresh nonce under the artifacts root, and the driver must read each one back with that nonce. A node
that cannot write there, or whose file the driver cannot see (its path is a local disk, not the NFS share or
PVC the driver sees), fails the job with exit 2 naming the path and the node.
"""

from __future__ import annotations

import platform
import secrets
from pathlib import Path

from pipelines.errors import InputError, QuantGateError
from pipelines.files.atomic import write_text_atomic
from pipelines.schema import StrictModel

PROBE_DIR = ".scaleout-probes"
ADVICE = "mount the same storage (NFS, a ReadWriteMany PVC) at this path on every node (docs/scale-out.md)"


class ProbeWritten(StrictModel):
    node: str  # the Ray node id
    host: str
    path: str | None = None  # the file written, or None with `error`
    error: str | None = None


def new_nonce() -> str:
    return secrets.token_hex(16)


def write_probe(root: Path, nonce: str, node_id: str) -> ProbeWritten:
    """On a node: write `<root>/.scaleout-probes/<nonce>-<node id>` holding the nonce."""
    path = Path(root) / PROBE_DIR / f"{nonce}-{node_id}"
    try:
        write_text_atomic(path, nonce)
    except (OSError, QuantGateError) as error:  # a disk error arrives as a StorageError naming errno and path
        return ProbeWritten(node=node_id, host=platform.node(), error=str(error))
    return ProbeWritten(node=node_id, host=platform.node(), path=str(path))


def check_probes(root: Path, nonce: str, written: list[ProbeWritten]) -> None:
    """On the driver: every node's probe read back with the nonce (and removed); else InputError naming the node."""
    try:
        for probe in written:
            where = f"node {probe.host} (Ray node {probe.node[:12]})"
            if probe.path is None:
                raise InputError(f"the artifacts root is not writable on {where}: {probe.error}; {ADVICE}", file=root)
            if _read(Path(probe.path)) != nonce:
                raise InputError(
                    f"the artifacts root is not shared: {where} wrote {probe.path}, which this machine ({platform.node()}) "
                    f"cannot read back; {ADVICE}", file=root,
                )
    finally:
        for probe in written:
            if probe.path is not None:
                Path(probe.path).unlink(missing_ok=True)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
