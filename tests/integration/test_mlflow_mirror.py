"""The registry's mirror against a real MLflow tracking server: .venv-mlflow's `mlflow server`, its backend store on the
session's throwaway PostgreSQL cluster (tests/conftest.py `postgres`), artifacts served by the server itself from a
temporary folder. The server is started once for this file on a free port and killed however the tests end.

Registry versions are made as the unit tests make them (tests/signed_versions.py: signed bundles, no vLLM run); the
promotions, alias moves and rollbacks go through the real CLI verbs with `--mlflow URL`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import httpx
import pytest
from signed_versions import make_candidate

from pipelines.cli import main
from pipelines.paths import REPO_ROOT
from pipelines.registry.mirror import pending_records
from pipelines.registry.store import Registry

MLFLOW = REPO_ROOT / ".venv-mlflow" / "bin" / "mlflow"
START_TIMEOUT_S = 300
MODEL = "mirror-llama"
_MIRROR_SECONDS = re.compile(r"mirrored to MLflow at \S+ in ([0-9.]+) s")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _kill(process: subprocess.Popen) -> None:
    """The server and its uvicorn worker (its own process group)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)


class MlflowServer:
    def __init__(self, backend_store: str, folder: Path) -> None:
        self.backend_store, self.folder = backend_store, folder
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.process: subprocess.Popen | None = None
        self.start_s: float | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        started = time.monotonic()
        log = (self.folder / "server.log").open("ab")
        self.process = subprocess.Popen(
            [str(MLFLOW), "server", "--backend-store-uri", self.backend_store, "--serve-artifacts",
             "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1",
             "--port", self.url.rsplit(":", 1)[1], "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"},
        )
        weakref.finalize(self, _kill, self.process)  # at interpreter exit too, whatever ended the session
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.process.poll() is not None:
                pytest.fail(f"mlflow server exited ({self.process.returncode}): {self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.start_s = time.monotonic() - started
                    print(f"\nmlflow server ({self.backend_store.split(':')[0]} store) up in {self.start_s:.1f} s", file=sys.stderr)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"mlflow server not up within {START_TIMEOUT_S} s: {self._log_tail()}")

    def stop(self) -> None:
        if self.process is not None:
            _kill(self.process)

    def _log_tail(self) -> str:
        return (self.folder / "server.log").read_text(errors="replace")[-1500:]


@pytest.fixture(scope="module")
def mlflow_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Started lazily (the first test shows a promotion while it is down); killed when the module ends, however."""
    build = subprocess.run([str(REPO_ROOT / "scripts" / "setup_env.sh"), "mlflow"], capture_output=True, text=True, check=False)
    if build.returncode != 0:
        pytest.fail(f"scripts/setup_env.sh mlflow failed: {build.stderr.strip()}")
    folder = tmp_path_factory.mktemp("mlflow")
    try:
        # SQLAlchemy 2.1 takes postgresql:// as psycopg 3; .venv-mlflow has psycopg2 (requirements/mlflow.txt).
        backend = request.getfixturevalue("postgres").create_database("mlflow").replace("postgresql://", "postgresql+psycopg2://", 1)
    except pytest.FixtureLookupError:  # before the PostgreSQL fixture existed: the server's own SQLite store
        backend = f"sqlite:///{folder / 'mlflow.db'}"
    server = MlflowServer(backend, folder)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def registry_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.delenv("QUANTGATE_MLFLOW", raising=False)
    return tmp_path


def promote_and_time(registry: Registry, model: str, number: int, url: str, capsys: pytest.CaptureFixture) -> float:
    """`quantize registry promote ... --mlflow URL`: exit 0, one mirror line; returns the mirror's own seconds."""
    code = main(["registry", "promote", model, str(number), "--reason", "gate passed", "--registry", str(registry.path),
                 "--mlflow", url, "--json"])
    err = capsys.readouterr().err
    assert code == 0, err
    seconds = _MIRROR_SECONDS.findall(err)
    assert len(seconds) == 1, err
    return float(seconds[0])


def client_for(url: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=url, registry_uri=url)


def test_a_promotion_while_the_server_is_down_succeeds_and_is_mirrored_by_the_retry(mlflow_server: MlflowServer,
                                                                                  registry_root: Path, capsys) -> None:
    mlflow_server.stop()  # down, whatever ran before
    registry, version = make_candidate(registry_root, MODEL, b"weights down")
    started = time.monotonic()
    code = main(["registry", "promote", MODEL, str(version.version), "--reason", "gate passed", "--registry",
                 str(registry.path), "--mlflow", mlflow_server.url])
    lines = [line for line in capsys.readouterr().err.splitlines() if "MLflow" in line]
    assert code == 0 and registry.show(MODEL, version.version).status == "promoted"
    assert len(lines) == 1 and "failed" in lines[0] and "--retry" in lines[0], lines
    print(f"\npromotion with the MLflow server down: {time.monotonic() - started:.1f} s", file=sys.stderr)
    [(_, record)] = pending_records()
    assert (record.model, record.versions, record.tracking) == (MODEL, [version.version], mlflow_server.url)

    mlflow_server.start()
    assert main(["registry", "mirror", "--retry", "--mlflow", mlflow_server.url]) == 0
    assert pending_records() == []
    [mirrored] = client_for(mlflow_server.url).search_model_versions(f"name = '{MODEL}'")
    assert mirrored.tags["quantgate.version"] == str(version.version) and mirrored.tags["gate.verdict"] == "promoted"


def test_promotion_alias_move_and_rollback_are_mirrored(mlflow_server: MlflowServer, registry_root: Path, capsys) -> None:
    mlflow_server.start()
    model = "champion-llama"
    registry, first = make_candidate(registry_root, model, b"weights one")
    _, second = make_candidate(registry_root, model, b"weights two", registry)
    seconds = [promote_and_time(registry, model, first.version, mlflow_server.url, capsys)]
    client = client_for(mlflow_server.url)

    def mlflow_version(number: int):
        found = [v for v in client.search_model_versions(f"name = '{model}'")
                 if v.tags["quantgate.version"] == str(number) and v.tags["quantgate.artifact_hash"] == registry.show(model, number).artifact_hash]
        assert len(found) == 1, found  # one MLflow version per registry version, however often it was mirrored
        return found[0]

    mirrored = mlflow_version(first.version)
    tags = mirrored.tags
    assert tags["gate.verdict"] == "promoted" and tags["gate.tickets.ci_low"] and tags["gate.orders.ci_high"]
    assert tags["quantgate.signature_key"] and tags["quantgate.manifest_hash"] == registry.show(model, first.version).manifest_hash
    run_files = {item.path for item in client.list_artifacts(mirrored.run_id)}
    assert {"bundle", "report.md", "gate.json"} <= run_files
    bundle_files = {Path(item.path).name for item in client.list_artifacts(mirrored.run_id, "bundle")}
    assert {"model.safetensors", "manifest.json", "model.sig", "evidence"} <= bundle_files
    assert mirrored.source.endswith("/bundle") and mirrored.run_id in mirrored.source

    def alias(name: str, *verb: str) -> None:
        assert main(["registry", *verb, "--registry", str(registry.path), "--mlflow", mlflow_server.url]) == 0
        assert "mirrored to MLflow" in capsys.readouterr().err
        target = registry.resolve(model, name)
        assert client.get_model_version_by_alias(model, name).version == mlflow_version(target.version).version

    alias("champion", "alias", model, "champion", str(first.version))
    seconds.append(promote_and_time(registry, model, second.version, mlflow_server.url, capsys))
    alias("champion", "alias", model, "champion", str(second.version))
    alias("champion", "rollback", model, "champion")
    assert registry.resolve(model, "champion").version == first.version
    # Mirroring everything again creates nothing.
    assert main(["registry", "mirror", model, "--registry", str(registry.path), "--mlflow", mlflow_server.url]) == 0
    assert len(client.search_model_versions(f"name = '{model}'")) == 2
    assert pending_records() == []
    print(f"\nmirror time per promotion: {', '.join(f'{s:.1f}' for s in seconds)} s", file=sys.stderr)
