"""llamacpp_server without llama.cpp: its command line, its bad input (refused before anything starts), and its
lifecycle against a stand-in `python -m llama_cpp.server` (stdlib only): ready once /v1/models with our key lists our
name, the key in the environment and never on the command line, a small environment, stopped however the block ends."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from pipelines.errors import InputError, ServeError
from pipelines.serve import llamacpp
from pipelines.serve.serving import RunningServer

# Answers /v1/models only with the key from API_KEY (llama-cpp-python's server guards every route with it);
# FAKE_LLAMACPP_MODE (install_fake) exit dies at start, other-name lists another model (then it is not our server).
FAKE_SERVER = textwrap.dedent(
    """
    import argparse, json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    parser = argparse.ArgumentParser()
    parser.add_argument("-m")
    parser.add_argument("--port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--model_alias")
    args, _ = parser.parse_known_args()
    mode = os.environ.get("FAKE_LLAMACPP_MODE", "ours")
    print("fake llama.cpp starting", json.dumps(sys.argv), json.dumps(sorted(os.environ)), flush=True)
    if mode == "exit":
        print("ValueError: Model path does not exist", flush=True)
        sys.exit(1)
    name = args.model_alias if mode == "ours" else "someone-else"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.headers.get("Authorization") != "Bearer " + os.environ["API_KEY"]:
                self.send_response(401); self.end_headers(); return
            body = json.dumps({"data": [{"id": name}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    HTTPServer((args.host, args.port), Handler).serve_forever()
    """
)


def install_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str = "ours") -> Path:
    """A stand-in .venv-llamacpp whose python runs FAKE_SERVER in `mode` (set in the wrapper: the server's environment
    is not the test's)."""
    venv = tmp_path / "venv-llamacpp"
    script = tmp_path / "fake_llamacpp_server.py"
    script.write_text(FAKE_SERVER)
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\nFAKE_LLAMACPP_MODE={mode} exec "{sys.executable}" "{script}" "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("QUANTGATE_LLAMACPP_VENV", str(venv))
    return venv


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return install_fake(tmp_path, monkeypatch)


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


def _serve(gguf: Path, tmp_path: Path, **overrides: object) -> AbstractContextManager[llamacpp.LlamaCppServer]:
    arguments: dict = {"log_path": tmp_path / "logs" / "server.log", "threads": 2, "ctx": 512, "parallel": 8, "startup_timeout_s": 20.0}
    return llamacpp.llamacpp_server(gguf, **{**arguments, **overrides})


def test_the_launcher_runs_llama_cpps_server_and_imports_nothing_of_ours() -> None:
    text = llamacpp.LAUNCHER.read_text()
    assert 'runpy.run_module("llama_cpp.server"' in text and "validate" in text and "pipelines" not in text.split('"""', 2)[2]


def test_the_command_serves_on_loopback_with_streams_never_interrupted() -> None:
    command = llamacpp.server_command(Path("py"), Path("m.gguf"), port=8123, served_name="q8", threads=3, ctx=1024)
    assert command[:2] == ["py", str(llamacpp.LAUNCHER)] and llamacpp.LAUNCHER.is_file()
    pairs = dict(zip(command[2::2], command[3::2], strict=True))
    assert pairs == {"--model": "m.gguf", "--model_alias": "q8", "--host": "127.0.0.1", "--port": "8123", "--n_threads": "3",
                     "--n_threads_batch": "3", "--n_ctx": "1024", "--use_mlock": "false", "--interrupt_requests": "false"}
    assert not any("key" in part for part in command)


def test_fixed_length_outputs_ask_for_min_tokens_and_no_repetition_penalty() -> None:
    assert llamacpp.fixed_length_body(128) == {"min_tokens": 128, "repeat_penalty": 1.0}
    with pytest.raises(InputError):
        llamacpp.fixed_length_body(0)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"threads": 0}, "threads"), ({"ctx": True}, "ctx"), ({"parallel": -1}, "parallel"), ({"threads": 2.5}, "threads"),
     ({"ctx": 10**9}, "ctx")],
)
def test_bad_numbers_are_refused_before_anything_starts(gguf: Path, tmp_path: Path, overrides: dict, field: str) -> None:
    with pytest.raises(InputError) as caught, _serve(gguf, tmp_path, **overrides):
        pass
    assert caught.value.field == field
    assert not (tmp_path / "logs").exists()


def test_a_missing_or_foreign_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found"), _serve(tmp_path / "none.gguf", tmp_path):
        pass
    (tmp_path / "model.safetensors").write_bytes(b"{}")
    with pytest.raises(InputError, match="not a GGUF"), _serve(tmp_path / "model.safetensors", tmp_path):
        pass


def test_without_the_environment_it_says_how_to_build_it(gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTGATE_LLAMACPP_VENV", str(tmp_path / "none"))
    with pytest.raises(InputError, match="scripts/setup_env.sh llamacpp"), _serve(gguf, tmp_path):
        pass


def test_a_port_in_use_is_refused(gguf: Path, tmp_path: Path, fake_env: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ServeError, match="already in use"), _serve(gguf, tmp_path, port=taken.getsockname()[1]):
            pass


def test_the_server_is_ready_with_our_key_and_stopped_after_the_block(
    gguf: Path, tmp_path: Path, fake_env: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOST", "0.0.0.0")  # uvicorn would listen there; the server's environment leaves it out
    with _serve(gguf, tmp_path, served_name="q4", model_dir=tmp_path) as server:
        assert isinstance(server, RunningServer)  # what the load test drives
        assert (server.serves_at_once, server.parallel, server.model_dir, server.gguf) == (1, 8, tmp_path, gguf)
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1" and server.startup_s > 0
        assert httpx.get(f"{server.base_url}/models", headers=server.auth_headers).json()["data"][0]["id"] == "q4"
        assert httpx.get(f"{server.base_url}/models").status_code == 401
        server.check_alive()
        pgid = os.getpgid(server.process.pid)
        assert pgid == server.process.pid != os.getpgid(0)  # a process group of its own
        log = server.log_path.read_text()
        assert server.api_key not in log and '"API_KEY"' in log and '"HOST"' not in log
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_the_server_is_stopped_when_the_block_raises(gguf: Path, tmp_path: Path, fake_env: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), _serve(gguf, tmp_path) as server:
        raise RuntimeError("boom")
    assert server.process.poll() is not None


def test_a_server_that_dies_at_start_is_reported_with_its_log(gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake(tmp_path, monkeypatch, "exit")
    with pytest.raises(ServeError, match="llama.cpp server for model.gguf died .exit code 1.*Model path does not exist"), _serve(gguf, tmp_path):
        pass


def test_a_server_that_does_not_list_our_name_is_not_ours(gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake(tmp_path, monkeypatch, "other-name")
    with pytest.raises(ServeError, match="did not answer /v1/models within 1 s"), _serve(gguf, tmp_path, startup_timeout_s=1.0):
        pass
