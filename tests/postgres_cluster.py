"""A throwaway PostgreSQL cluster for tests: Debian's PostgreSQL binaries, a Unix socket in a temporary folder, no TCP.

`postgres_cluster(root)` runs initdb (trust authentication, superuser `postgres`) and `pg_ctl start` with
`-k SOCKETDIR -c listen_addresses=` and yields a PostgresCluster whose `.url(dbname)` a client (psycopg, SQLAlchemy,
the registry's QUANTGATE_REGISTRY) connects with. The cluster is stopped however the test ends: `pg_ctl stop -m
immediate` in a finally block, and the same stop registered with weakref.finalize, which also runs at interpreter
exit (a KeyboardInterrupt past the finally, a fixture torn down by xdist's shutdown). Only a SIGKILL of the test
process itself leaves a postmaster behind; its folder is under the test's temporary root.

PostgreSQL refuses to run as root: as root, the binaries run as the `postgres` user (runuser) in a folder made
theirs. Pytest's temporary root is 0700 and root's, so the cluster then lives in a folder of its own under the
system's temporary folder, removed with the cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import urllib.parse
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def find_pg_bin(versions_root: Path = Path("/usr/lib/postgresql")) -> Path:
    """QUANTGATE_PG_BIN, else the newest Debian PostgreSQL's bin folder (the `postgresql` package installs the release's
    own major version: 15 on bookworm, 17 on trixie), else the folder of an `initdb` on PATH."""
    if override := os.environ.get("QUANTGATE_PG_BIN"):
        return Path(override)
    installed = [path.parent for path in versions_root.glob("*/bin/initdb") if path.parent.parent.name.isdigit()]
    if installed:
        return max(installed, key=lambda folder: int(folder.parent.name))
    on_path = shutil.which("initdb")
    return Path(on_path).resolve().parent if on_path else versions_root / "15" / "bin"


PG_BIN = find_pg_bin()
SUPERUSER = "postgres"
START_TIMEOUT_S = 60
# A test cluster holds nothing worth a fsync; the registry's own durability is PostgreSQL's, not under test here.
_SERVER_OPTIONS = "-c listen_addresses= -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=60"


def postgres_available() -> bool:
    return (PG_BIN / "initdb").is_file() and (PG_BIN / "pg_ctl").is_file()


def _as_server_user(argv: list[str]) -> list[str]:
    return ["runuser", "-u", SUPERUSER, "--", *argv] if os.geteuid() == 0 else argv


def _run(argv: list[str]) -> None:
    done = subprocess.run(_as_server_user(argv), capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}")


@dataclass(frozen=True)
class PostgresCluster:
    folder: Path
    data_dir: Path
    socket_dir: Path

    def url(self, dbname: str = "postgres") -> str:
        """A libpq URL for `dbname` over the cluster's Unix socket (no password: trust authentication)."""
        return f"postgresql://{SUPERUSER}@/{dbname}?host={urllib.parse.quote(str(self.socket_dir), safe='/')}"

    def create_database(self, name: str) -> str:
        """CREATE DATABASE `name` (a plain identifier); returns its URL."""
        if not name.replace("_", "").isalnum():
            raise ValueError(f"not a plain database name: {name!r}")
        _run([str(PG_BIN / "createdb"), "-h", str(self.socket_dir), "-U", SUPERUSER, name])
        return self.url(name)


def _stop(data_dir: Path, folder: Path, remove: bool) -> None:
    if (data_dir / "postmaster.pid").exists():
        subprocess.run(_as_server_user([str(PG_BIN / "pg_ctl"), "stop", "-D", str(data_dir), "-m", "immediate", "-w"]),
                       capture_output=True, timeout=START_TIMEOUT_S, check=False)
    if remove:
        shutil.rmtree(folder, ignore_errors=True)


def _cluster_folder(root: Path) -> tuple[Path, bool]:
    """Where the cluster lives, and whether it is ours to remove (the system temp folder, as root)."""
    if os.geteuid() != 0:
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="pg-", dir=root)), False
    folder = Path(tempfile.mkdtemp(prefix="quantgate-pg-"))
    shutil.chown(folder, SUPERUSER, SUPERUSER)
    return folder, True


@contextmanager
def postgres_cluster(root: Path) -> Iterator[PostgresCluster]:
    """A running cluster for the duration of the block; stopped (immediately) however the block ends."""
    folder, remove = _cluster_folder(root)
    cluster = PostgresCluster(folder=folder, data_dir=folder / "data", socket_dir=folder / "sock")
    stopper = weakref.finalize(cluster, _stop, cluster.data_dir, folder, remove)
    try:
        _run(["mkdir", "-p", str(cluster.socket_dir)])
        _run([str(PG_BIN / "initdb"), "-D", str(cluster.data_dir), "-A", "trust", "-U", SUPERUSER, "-E", "UTF8", "--no-sync"])
        _run([str(PG_BIN / "pg_ctl"), "start", "-D", str(cluster.data_dir), "-w", "-t", str(START_TIMEOUT_S),
              "-l", str(folder / "server.log"), "-o", f"-k {cluster.socket_dir} {_SERVER_OPTIONS}"])
        yield cluster
    finally:
        stopper()
