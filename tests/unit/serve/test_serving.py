"""The server lifecycle without vLLM: process-group clean-up, start-up failure detection, settings, the API key,
and what happens to the server's process group when its starter is SIGKILLed (parent-death signal + watchdog)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from fakes import STARVE_SOURCE, write_serve_python

from pipelines.errors import InputError, ServeError
from pipelines.evaluation import divergence, evaluate
from pipelines.serve import serving

REPO = Path(__file__).resolve().parents[3]

# A stand-in for vLLM's api_server (stdlib only): /health without a key, /v1/models only with the key from
# VLLM_API_KEY, as vLLM 0.32 does (vllm/entrypoints/serve/middleware/authenticate.py guards /v1 only).
# FAKE_VLLM_MODE=foreign-key answers 401 to our key; other-name lists another model: both are not our server.
FAKE_VLLM = textwrap.dedent(
    """
    import argparse, json, os
    from http.server import BaseHTTPRequestHandler, HTTPServer

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    parser.add_argument("--served-model-name")
    parser.add_argument("--model")
    args, _ = parser.parse_known_args()
    key, mode = os.environ.get("VLLM_API_KEY"), os.environ.get("FAKE_VLLM_MODE", "ours")
    print("fake vLLM starting", flush=True)
    starved_before = os.environ.get("FAKE_VLLM_STARVED_MARK", "")
    if mode == "starved" or (mode == "starved-once" and not os.path.exists(starved_before)):
        open(starved_before, "w").close() if starved_before else None
        exec(open(os.environ["FAKE_VLLM_STARVE"]).read())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                return self.send(200, {})
            if self.path == "/v1/models":
                if mode == "foreign-key" or self.headers.get("Authorization") != f"Bearer {key}":
                    return self.send(401, {"error": "Unauthorized"})
                name = "someone-else" if mode == "other-name" else args.served_model_name
                return self.send(200, {"object": "list", "data": [{"id": name, "root": args.model}]})
            self.send(404, {})

        def send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    """
)


def _alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _cmdlines() -> dict[int, bytes]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                found[int(entry.name)] = (entry / "cmdline").read_bytes()
    return found


def _watchdogs_of(pid: int) -> list[int]:
    """Live watchdogs started by process `pid` (`python -m pipelines.serve.reclaim watchdog --parent PID ...`)."""
    needle = f"watchdog\0--parent\0{pid}\0".encode()
    return [p for p, cmdline in _cmdlines().items() if needle in cmdline and _alive(p)]


def _wait_for(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """The serve environment's python replaced by the stand-in server; returns a model folder to serve."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    write_serve_python(tmp_path / "venv", f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path / "venv"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


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
    assert not _alive(child_pid) or Path(f"/proc/{child_pid}/stat").read_text().split()[2] == "Z"


def test_startup_failure_is_reported_with_the_log_tail(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    write_serve_python(tmp_path / "venv", "#!/bin/sh\necho 'ValueError: this model is broken' >&2\nexit 3\n")
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path / "venv"))
    with pytest.raises(ServeError, match=r"exit code 3.*this model is broken"), serving.vllm_server(model, log_path=tmp_path / "server.log"):
        pass
    assert _watchdogs_of(os.getpid()) == []


def test_hang_at_startup_times_out_and_the_process_is_gone(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    write_serve_python(tmp_path / "venv", f"#!/bin/sh\necho $$ > {tmp_path}/pid\nexec sleep 60\n")
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path / "venv"))
    settings = serving.ServeSettings(startup_timeout_s=1.5)
    with pytest.raises(ServeError, match="did not become healthy"), serving.vllm_server(model, log_path=tmp_path / "server.log", settings=settings):
        pass
    pid = int((tmp_path / "pid").read_text())
    time.sleep(0.2)
    assert not _alive(pid)


# These run without a serve environment (tests/unit/conftest.py points QUANTGATE_SERVE_VENV at a missing
# folder): the caller's own input is checked before the environment is looked for.
def test_not_a_model_folder_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match=r"no config\.json"), serving.vllm_server(tmp_path, log_path=tmp_path / "log"):
        pass


def test_a_missing_serve_environment_is_reported_once_the_input_is_good(tmp_path, no_serve_environment):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ServeError, match="serve environment is missing") as caught, serving.vllm_server(model, log_path=tmp_path / "log"):
        pass
    assert caught.value.file == str(no_serve_environment / "bin" / "python")


def test_the_serve_environment_is_read_from_the_settings_when_serving_not_at_import(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path / "elsewhere"))
    command = serving._command(tmp_path, "model", 8000, serving.ServeSettings())
    assert command[0] == str(tmp_path / "elsewhere" / "bin" / "python")


def test_the_server_lists_as_many_logprobs_as_the_kl_asks_for(tmp_path):
    command = serving._command(tmp_path, "model", 8000, serving.ServeSettings())
    assert command[command.index("--max-logprobs") + 1] == str(divergence.TOP_K)


def test_taken_port_is_refused(tmp_path, monkeypatch):
    import socket

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with socket.socket() as sock:
        sock.bind((serving.LOOPBACK, 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServeError, match=f"port {port}"), serving.vllm_server(model, log_path=tmp_path / "log", port=port):
            pass


def test_cache_fields_exclude_timeouts():
    fields = serving.ServeSettings(startup_timeout_s=5).cache_fields()
    assert "startup_timeout_s" not in fields and "request_timeout_s" not in fields
    assert fields["dtype"] == "bfloat16"  # fp16 breaks vLLM CPU int8 W8A8; AMX is hidden instead


def test_log_tail_prefers_error_lines(tmp_path):
    # More lines after the error than the tail holds: only a tail that picks error lines still shows it.
    noise = [f"INFO shutting down, step {i}" for i in range(3 * 8)]
    log = tmp_path / "log"
    log.write_text("\n".join(["INFO starting", "ValueError: bad config", *noise]) + "\n")
    assert serving.log_tail(log) == "ValueError: bad config"
    log.write_text("\n".join(noise) + "\n")  # no error line: the last lines
    assert serving.log_tail(log, 2) == f"{noise[-2]} | {noise[-1]}"
    assert serving.log_tail(tmp_path / "missing") == f"(no log at {tmp_path / 'missing'})"


def test_the_key_is_in_the_servers_environment_never_on_a_command_line_nor_in_repr(tmp_path, fake_vllm):
    log = tmp_path / "server.log"
    with serving.vllm_server(fake_vllm, log_path=log, served_name="candidate") as server:
        key = server.api_key
        assert key and len(key) >= 32
        environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
        assert f"VLLM_API_KEY={key}".encode() in environ
        assert [pid for pid, cmdline in _cmdlines().items() if key.encode() in cmdline] == []
        assert key not in repr(server) and key not in str(server)
        assert "api_key" not in server.model_dump() and key not in server.model_dump_json(exclude={"process"})
        assert server.auth_headers == {"Authorization": f"Bearer {key}"}
        assert len(_watchdogs_of(os.getpid())) == 1
    assert key not in log.read_text()


def test_every_server_gets_its_own_key(tmp_path, fake_vllm):
    keys = set()
    for number in range(2):
        with serving.vllm_server(fake_vllm, log_path=tmp_path / f"{number}.log") as server:
            keys.add(server.api_key)
    assert len(keys) == 2


def test_lm_eval_gets_the_key_in_its_environment_not_its_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "a-real-openai-key")
    server = serving.RunningServer.model_construct(
        model_dir=tmp_path, served_name="candidate", port=8000, log_path=tmp_path / "log", process=None,
        startup_s=0.0, request_timeout_s=60.0, api_key="the-servers-key",
    )
    command = evaluate.lm_eval_command(server, tmp_path, ["task"], tmp_path, tmp_path)
    assert not any("the-servers-key" in part for part in command)
    assert evaluate.lm_eval_environment(server)["OPENAI_API_KEY"] == "the-servers-key"
    # a server without a key: no key at all, and never the user's OpenAI key
    server.api_key = None
    assert "OPENAI_API_KEY" not in evaluate.lm_eval_environment(server)
    assert evaluate.lm_eval_environment(server)["DISABLE_MULTIPROC"] == "1"  # no Pool workers to outlive quantize


@pytest.mark.parametrize("mode", ["foreign-key", "other-name"])
def test_a_foreign_process_answering_health_is_refused(tmp_path, fake_vllm, monkeypatch, mode):
    monkeypatch.setenv("FAKE_VLLM_MODE", mode)
    started = serving.vllm_server(fake_vllm, log_path=tmp_path / "server.log", served_name="candidate")
    with pytest.raises(ServeError, match="is not the vLLM server started for this run") as caught, started:
        pytest.fail("a foreign server was accepted")
    assert ("HTTP 401" if mode == "foreign-key" else "someone-else") in str(caught.value)
    assert _watchdogs_of(os.getpid()) == []


def test_a_normal_stop_leaves_no_process_and_no_shim(tmp_path, fake_vllm):
    with serving.vllm_server(fake_vllm, log_path=tmp_path / "server.log") as server:
        pid = server.process.pid
        environ = dict(
            item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
        )
        shim = Path(environ[b"PYTHONPATH"].decode())
        assert shim.name.startswith(f"quantgate-vllm-{os.getpid()}-") and (shim / "sitecustomize.py").is_file()
        watchdogs = _watchdogs_of(os.getpid())
        assert len(watchdogs) == 1
    assert not _alive(pid) and not shim.exists()
    assert not any(_alive(p) for p in watchdogs)


PARENT = textwrap.dedent(
    """
    # Stands in for `quantize`: starts a process group through serving's own start function, then waits to be killed.
    import json, os, sys, time
    from pathlib import Path
    from pipelines.serve.serving import start_process_group

    out = Path(sys.argv[1])
    process, watchdog = start_process_group(
        [sys.executable, str(out / "server.py")], env=dict(os.environ), log_path=out / "server.log", grace_s=float(sys.argv[2]),
    )
    (out / "parent.json").write_text(json.dumps({"server": process.pid, "watchdog": watchdog.process.pid}))
    time.sleep(300)
    """
)
# Stands in for vLLM: an API server whose children (engine core, workers) are not its starter's children;
# one of them ignores SIGTERM, as a stuck worker would.
SERVER = textwrap.dedent(
    """
    import json, subprocess, sys, time
    from pathlib import Path

    children = [
        subprocess.Popen(["sleep", "300"]),
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"]),
    ]
    (Path(sys.argv[0]).parent / "children.json").write_text(json.dumps([c.pid for c in children]))
    time.sleep(300)
    """
)


def _start_parent(tmp_path: Path, grace_s: float) -> tuple[subprocess.Popen, dict, list[int]]:
    (tmp_path / "parent.py").write_text(PARENT)
    (tmp_path / "server.py").write_text(SERVER)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path), str(grace_s)], cwd=REPO)
    _wait_for(lambda: (tmp_path / "children.json").is_file() and (tmp_path / "children.json").read_text(), 30)
    _wait_for(lambda: (tmp_path / "parent.json").is_file() and (tmp_path / "parent.json").read_text(), 30)
    return parent, json.loads((tmp_path / "parent.json").read_text()), json.loads((tmp_path / "children.json").read_text())


def test_sigkill_of_the_starter_stops_the_whole_group(tmp_path):
    grace_s = 1.0
    parent, pids, children = _start_parent(tmp_path, grace_s)
    everything = [pids["server"], pids["watchdog"], *children]
    assert all(_alive(pid) for pid in everything)
    time.sleep(0.3)  # the watchdog is past its start-up
    parent.kill()
    parent.wait()
    took = _wait_for(lambda: not any(_alive(pid) for pid in everything), grace_s + 5)
    # the SIGTERM-ignoring child is what takes the grace period; the rest dies at once
    assert took < grace_s + 2
    assert "process group" in (tmp_path / "server.log").read_text()


def test_a_grandchild_that_honours_sigterm_dies_at_once(tmp_path):
    parent, pids, children = _start_parent(tmp_path, grace_s=30.0)
    time.sleep(0.3)
    parent.kill()
    parent.wait()
    took = _wait_for(lambda: not _alive(pids["server"]) and not _alive(children[0]), 5)
    assert took < 2
    assert _alive(children[1])  # the stubborn one waits for SIGKILL after the grace period
    os.kill(children[1], signal.SIGKILL)
    _wait_for(lambda: not _alive(pids["watchdog"]), 5)


def test_the_server_gets_a_parent_death_signal(tmp_path):
    # the child reads its own parent-death signal: prctl(PR_GET_PDEATHSIG = 2) through libc
    script = "import ctypes; v = ctypes.c_int(0); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value, flush=True)"
    process, watchdog = serving.start_process_group([sys.executable, "-c", script], env=dict(os.environ), log_path=tmp_path / "log")
    process.wait(timeout=30)
    watchdog.stop()
    assert (tmp_path / "log").read_text().split() == [str(int(signal.SIGTERM))]


def test_die_with_parent_kills_a_direct_child_when_the_parent_is_sigkilled(tmp_path):
    # lm-eval's case: a direct child of quantize, no process group of its own.
    parent = subprocess.Popen(
        [
            sys.executable, "-c",
            "import signal, subprocess, sys, time\n"
            "from pipelines.serve.reclaim import die_with_parent\n"
            "child = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_parent(signal.SIGKILL))\n"
            f"open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
            "time.sleep(300)\n",
        ],
        cwd=REPO,
    )
    _wait_for(lambda: (tmp_path / "child").is_file() and (tmp_path / "child").read_text(), 30)
    child = int((tmp_path / "child").read_text())
    assert _alive(child)
    parent.kill()
    parent.wait()
    assert _wait_for(lambda: not _alive(child), 5) < 1


def test_the_watchdog_leaves_when_the_group_ends_by_itself(tmp_path):
    process, watchdog = serving.start_process_group(["sleep", "0.5"], env=dict(os.environ), log_path=tmp_path / "log")
    process.wait(timeout=10)
    assert watchdog.process.wait(timeout=5) == 0
    watchdog.stop()


@pytest.fixture
def starving(tmp_path, monkeypatch, fake_vllm) -> Path:
    """The stand-in server starves itself for real at its start (fakes.STARVE_SOURCE) in FAKE_VLLM_MODE starved or
    starved-once; the starvation window is shortened to 3 s (a starved process gets about 0.01 s of CPU in it, a healthy
    one at least 0.05 s unless some 60 processes share the 2 cores)."""
    source = tmp_path / "starve.py"
    source.write_text(STARVE_SOURCE)
    monkeypatch.setenv("FAKE_VLLM_STARVE", str(source))
    monkeypatch.setenv("FAKE_VLLM_STARVED_MARK", str(tmp_path / "starved-once"))
    monkeypatch.setattr(serving, "STARVED_WINDOW_S", 3.0)
    monkeypatch.setattr(serving, "STARVED_MIN_CPU_S", 0.05)
    return fake_vllm


def _fake_servers(tmp_path: Path) -> list[int]:
    needle = str(tmp_path / "fake_vllm.py").encode()
    return [pid for pid, cmdline in _cmdlines().items() if needle in cmdline and _alive(pid)]


@pytest.mark.slow
def test_a_start_up_starved_of_cpu_is_started_again_and_serves(tmp_path, starving, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_MODE", "starved-once")
    with serving.vllm_server(starving, log_path=tmp_path / "server.log") as server:
        assert httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5).status_code == 200
        assert _fake_servers(tmp_path) == [server.process.pid]  # the starved one is gone
    said = capsys.readouterr().err
    assert "vLLM was starved during start-up: runnable for" in said and f"(start 2 of {serving.STARVED_STARTS})" in said, said
    assert _fake_servers(tmp_path) == [] and _watchdogs_of(os.getpid()) == []


@pytest.mark.slow
def test_a_start_up_starved_every_time_waits_out_its_time_out_on_the_last_start_and_leaves_nothing(tmp_path, starving, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_MODE", "starved")
    settings = serving.ServeSettings(startup_timeout_s=8)
    with pytest.raises(ServeError, match=r"did not become healthy within 8 s \(\d+ python R \d\.\d s CPU"), \
            serving.vllm_server(starving, log_path=tmp_path / "server.log", settings=settings):
        pass
    said = capsys.readouterr().err
    assert said.count("vLLM was starved during start-up") == 1 and f"(start 2 of {serving.STARVED_STARTS})" in said, said
    _wait_for(lambda: _fake_servers(tmp_path) == [] and _watchdogs_of(os.getpid()) == [], 15)


def test_a_16_bit_kv_cache_unlike_the_servers_dtype_is_refused_before_a_server_starts(tmp_path, fake_vllm, monkeypatch):
    # vLLM's CPU attention read a bfloat16 cache beside float32 attention back wrong (docs/formats.md): the rule on the class
    # refuses the recipe; this one the server whose dtype was overridden
    monkeypatch.setattr(serving, "served_kv_cache_dtype", lambda folder: "bfloat16")
    with pytest.raises(ServeError) as raised, serving.vllm_server(fake_vllm, log_path=tmp_path / "server.log",
                                                                   settings=serving.ServeSettings(dtype="float32")):
        pass
    assert raised.value.field == "dtype" and "its KV cache is bfloat16 but this server computes in float32" in raised.value.message
    assert not (tmp_path / "server.log").exists() and _fake_servers(tmp_path) == []
    with serving.vllm_server(fake_vllm, log_path=tmp_path / "server.log", settings=serving.ServeSettings(dtype="bfloat16")) as server:
        assert server.process.poll() is None
