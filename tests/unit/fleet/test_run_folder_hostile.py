"""A deployment's run folder is input: a forged state.json, a FIFO log, a /dev/zero key are refused, never obeyed.

Real processes (`sleep`) stand in for the pids a forged state names: the test checks they are still alive afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.files.run_input import read_regular_tail
from pipelines.fleet.drill import DrillSettings, run_drill
from pipelines.fleet.run_files import process_identity, read_client_key
from pipelines.fleet.state import CLIENT_KEY_FILE, STATE_FILE, ProxyState, RouteState, ServeState, find_state, write_state
from pipelines.fleet.status import status_report
from pipelines.fleet.traffic import LogTail


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    folder = tmp_path / "artifacts" / "serve"
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A process nobody should signal: a child of this test, leading its own group, like a route's server."""
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    deadline = time.monotonic() + 5
    while process_identity(process.pid) is None or process_identity(process.pid)[1] != ["sleep", "60"]:  # type: ignore[index]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield process
    process.kill()
    process.wait()


def _route(label: str, pid: int | None, started: float | None = None, cmdline: list[str] | None = None) -> RouteState:
    return RouteState(label=label, ref=f"m@{label}", kind="version", model="m", version=1, model_dir="/models/m", verified="ok",
                      status="up", port=1, pid=pid, process_started=started, cmdline=cmdline or [], log="x.log", timeout_s=10,
                      timeout_basis="test", max_num_seqs=1, max_conns=1, vllm_args="")


def _state(name: str, supervisor: int, started: float | None, cmdline: list[str], routes: list[RouteState], **extra: str) -> ServeState:
    return ServeState(name=name, deployment_file="d.yaml", served_model_name="m", endpoint=extra.get("endpoint", "http://127.0.0.1:1/v1"),
                      client_key_file=extra.get("client_key_file", "/dev/zero"), supervisor_pid=supervisor, supervisor_started=started,
                      supervisor_cmdline=cmdline, started_at=time.time(), phase="serving", routes=routes,
                      proxy=ProxyState(conf="n.conf", access_log=extra.get("access_log", "/dev/zero"), error_log="e.log", sentinel_port=1))


def _write(root: Path, state: ServeState) -> Path:
    folder = root / state.name
    folder.mkdir(exist_ok=True)
    write_state(folder, state)
    return folder


def _me() -> tuple[float, list[str]]:
    identity = process_identity(os.getpid())
    assert identity is not None
    return identity


def test_stop_never_signals_a_pid_whose_start_time_is_unrecorded(root: Path, sleeper: subprocess.Popen) -> None:
    _write(root, _state("forged", sleeper.pid, None, ["sleep", "60"], []))
    assert main(["serve", "stop", "forged"]) == 2
    time.sleep(0.2)
    assert sleeper.poll() is None


def test_stop_never_signals_a_pid_whose_command_line_differs(root: Path, sleeper: subprocess.Popen) -> None:
    started, _ = process_identity(sleeper.pid)  # type: ignore[misc]
    _write(root, _state("forged", sleeper.pid, started, ["quantize", "serve", "d.yaml"], []))
    assert main(["serve", "stop", "forged"]) == 2
    time.sleep(0.2)
    assert sleeper.poll() is None


def test_stop_signals_the_process_the_state_recorded(root: Path, sleeper: subprocess.Popen) -> None:
    started, cmdline = process_identity(sleeper.pid)  # type: ignore[misc]
    _write(root, _state("mine", sleeper.pid, started, cmdline, []))
    assert main(["serve", "stop", "mine"]) == 0
    assert sleeper.wait(timeout=5) == -15


@pytest.mark.parametrize("name", ["../../..", "..", "a/b", ".hidden", "x\x00y"])
def test_a_name_that_is_not_a_path_component_is_refused(root: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    (root.parent.parent / STATE_FILE).write_text("{}")
    assert main(["serve", "stop", name]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_state_file_that_is_a_fifo_or_a_link_is_refused_unopened(root: Path, tmp_path: Path) -> None:
    fifo = root / "piped"
    fifo.mkdir()
    os.mkfifo(fifo / STATE_FILE)
    linked = root / "linked"
    linked.mkdir()
    outside = tmp_path / "outside.json"
    write_state(tmp_path, _state("linked", 1, None, [], []))
    (tmp_path / STATE_FILE).rename(outside)
    (linked / STATE_FILE).symlink_to(outside)
    for name in ("piped", "linked"):
        with pytest.raises(InputError, match="not a regular file"):
            find_state(name)


def test_a_state_naming_another_folder_is_refused(root: Path) -> None:
    folder = _write(root, _state("other", 1, None, [], []))
    folder.rename(root / "here")
    with pytest.raises(InputError, match="not its own folder"):
        find_state("here")


def test_the_drill_signals_no_route_pid_its_supervisor_did_not_start(root: Path, sleeper: subprocess.Popen) -> None:
    """Everything recorded right (the start time and command line of a real process) but it is not the supervisor's child."""
    started, cmdline = process_identity(sleeper.pid)  # type: ignore[misc]
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        stranger_started, stranger_cmdline = process_identity(stranger.pid)  # type: ignore[misc]
        routes = [_route("primary", sleeper.pid, started, cmdline), _route("fallback", None)]
        _write(root, _state("drilled", stranger.pid, stranger_started, stranger_cmdline, routes))
        with pytest.raises(InputError, match="not the server its supervisor started"):
            run_drill(root / "drilled", DrillSettings())
        time.sleep(0.2)
        assert sleeper.poll() is None
        routes = [_route("primary", sleeper.pid, None, cmdline), _route("fallback", None)]  # the test is the parent: only the start time
        me_started, me_cmdline = _me()
        _write(root, _state("drilled", os.getpid(), me_started, me_cmdline, routes))
        with pytest.raises(InputError, match="not the server its supervisor started"):
            run_drill(root / "drilled", DrillSettings())
        assert sleeper.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def _verified_routes(sleeper: subprocess.Popen) -> list[RouteState]:
    started, cmdline = process_identity(sleeper.pid)  # type: ignore[misc]
    return [_route("primary", sleeper.pid, started, cmdline), _route("fallback", sleeper.pid, started, cmdline)]


@pytest.mark.parametrize("endpoint", ["http://192.0.2.1:80/v1", "http://example.com:80/v1", "http://u:p@127.0.0.1:1/v1", "file:///etc/v1"])
def test_the_drill_talks_only_to_a_loopback_endpoint(root: Path, sleeper: subprocess.Popen, endpoint: str) -> None:
    me_started, me_cmdline = _me()
    folder = _write(root, _state("drilled", os.getpid(), me_started, me_cmdline, _verified_routes(sleeper), endpoint=endpoint))
    (folder / CLIENT_KEY_FILE).write_text("key\n")
    with pytest.raises(InputError, match="not a loopback address"):
        run_drill(folder, DrillSettings())
    assert sleeper.poll() is None


def test_the_drill_reads_the_key_from_its_own_folder_only(root: Path, sleeper: subprocess.Popen) -> None:
    me_started, me_cmdline = _me()
    secret = root.parent / "secret"
    secret.write_text("not-the-key\n")
    folder = _write(root, _state("drilled", os.getpid(), me_started, me_cmdline, _verified_routes(sleeper), client_key_file=str(secret)))
    (folder / CLIENT_KEY_FILE).symlink_to("/dev/zero")
    with pytest.raises(InputError, match="client key file is not a regular file"):
        run_drill(folder, DrillSettings())
    (folder / CLIENT_KEY_FILE).unlink()
    (folder / CLIENT_KEY_FILE).write_text("k" * 10_000)
    with pytest.raises(InputError, match="at most"):
        read_client_key(folder, CLIENT_KEY_FILE)
    (folder / CLIENT_KEY_FILE).write_text("the-key_1\n")
    assert read_client_key(folder, CLIENT_KEY_FILE) == "the-key_1"


def test_status_refuses_a_fifo_access_log_without_opening_it(root: Path) -> None:
    me_started, me_cmdline = _me()
    folder = _write(root, _state("watched", os.getpid(), me_started, me_cmdline, []))
    os.mkfifo(folder / "access.log")
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(_status_or_error(folder)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "serve status hung on a FIFO access log"
    assert isinstance(outcome[0], InputError) and "not a regular file" in str(outcome[0])


def _status_or_error(folder: Path) -> object:
    try:
        return status_report(find_state(folder.name)[1])
    except InputError as error:
        return error


def test_the_log_tail_reads_only_the_tail(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    with log.open("wb") as handle:
        handle.truncate(8 * 1024**3)  # 8 GiB, sparse
        handle.seek(0, 2)
        handle.write(b"last line\n")
    before = psutil.Process().memory_info().rss
    assert read_regular_tail(log, "log", 1024).endswith(b"last line\n")
    assert psutil.Process().memory_info().rss - before < 64 * 1024**2


def test_the_supervisors_log_tail_skips_a_log_swapped_for_a_fifo_or_a_link(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_text("one\ntwo\npartial")
    tail = LogTail(log)
    assert tail.new_lines() == ["one", "two"]
    log.unlink()
    os.mkfifo(log)
    lines: list[list[str]] = []
    worker = threading.Thread(target=lambda: lines.append(tail.new_lines()), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the supervisor's log tail blocked on a FIFO"
    assert lines == [[]]
    log.unlink()
    (tmp_path / "outside").write_text("secret\n")
    log.symlink_to(tmp_path / "outside")
    assert tail.new_lines() == []
    log.unlink()
    log.write_text("new\n")  # replaced by a shorter file: read from its start
    assert tail.new_lines() == ["new"]
