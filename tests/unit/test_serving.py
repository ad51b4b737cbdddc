"""The server lifecycle without vLLM: process-group clean-up, start-up failure detection, settings."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import serving
from pipelines.errors import InputError, ServeError


def _alive(pid: int) -> bool:
    try:
        import os

        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stop_process_group_kills_children_too(tmp_path):
    # A parent that starts a child which ignores SIGTERM, like an engine core that outlives its API server.
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    pid_file = tmp_path / "child.pid"
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    serving.stop_process_group(parent, grace_s=1.0)
    time.sleep(0.2)
    assert parent.poll() is not None
    assert not _alive(child_pid) or open(f"/proc/{child_pid}/stat").read().split()[2] == "Z"


def test_startup_failure_is_reported_with_the_log_tail(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'ValueError: this model is broken' >&2\nexit 3\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(serving, "SERVE_PYTHON", fake_python)
    with pytest.raises(ServeError, match="exit code 3.*this model is broken"):
        with serving.vllm_server(model, log_path=tmp_path / "server.log"):
            pass


def test_hang_at_startup_times_out_and_the_process_is_gone(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\nexec sleep 60\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(serving, "SERVE_PYTHON", fake_python)
    settings = serving.ServeSettings(startup_timeout_s=1.5)
    with pytest.raises(ServeError, match="did not become healthy"):
        with serving.vllm_server(model, log_path=tmp_path / "server.log", settings=settings):
            pass
    pid = int((tmp_path / "pid").read_text())
    time.sleep(0.2)
    assert not _alive(pid)


def test_not_a_model_folder_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no config.json"):
        with serving.vllm_server(tmp_path, log_path=tmp_path / "log"):
            pass


def test_taken_port_is_refused(tmp_path, monkeypatch):
    import socket

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with socket.socket() as sock:
        sock.bind((serving.LOOPBACK, 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServeError, match=f"port {port}"):
            with serving.vllm_server(model, log_path=tmp_path / "log", port=port):
                pass


def test_cache_fields_exclude_timeouts():
    fields = serving.ServeSettings(startup_timeout_s=5).cache_fields()
    assert "startup_timeout_s" not in fields and "request_timeout_s" not in fields
    assert fields["dtype"] == "bfloat16"  # fp16 breaks vLLM CPU int8 W8A8; AMX is hidden instead


def test_log_tail_prefers_error_lines(tmp_path):
    log = tmp_path / "log"
    log.write_text("INFO starting\nValueError: bad config\nINFO shutting down\n")
    assert "ValueError: bad config" in serving.log_tail(log)
    assert serving.log_tail(Path(tmp_path / "missing")) == "(no log)"
