"""A server's death said by its cause: read from the end of its console log (bounded), a known cause or a traceback's
last line, else how it ended with its last lines; never "(no log)" while a log exists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fakes import write_serve_python

from pipelines.errors import ServeError
from pipelines.serve import death, serving

PORT_IN_USE = """INFO 12-07 10:00:00 [api_server.py:1] vLLM API server version 0.32.0
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/uvicorn/server.py", line 161, in startup
    server = await loop.create_server(
OSError: [Errno 98] Address already in use
"""


def test_an_empty_console_says_how_the_server_ended(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("")
    assert death.death_cause(log, -9) == f"no output; killed by signal 9 (SIGKILL) (log: {log})"
    assert death.death_cause(log, 0).startswith("no output; exited 0")


def test_a_console_without_a_cause_gives_its_last_lines_each_bounded(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("INFO starting\n" + "x" * 100_000 + "\nINFO Shutting down\nINFO Application shutdown complete.\n")
    line = death.death_cause(log, 0)
    assert line.startswith("exited 0; last lines: x") and line.endswith(f"INFO Shutting down | INFO Application shutdown complete. (log: {log})")
    assert "INFO starting" not in line and len(line) < 600


def test_a_port_in_use_is_named(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(PORT_IN_USE)
    assert death.death_cause(log, 1) == f"port in use: OSError: [Errno 98] Address already in use (log: {log})"


def test_out_of_memory_is_named_without_a_traceback(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("INFO loading weights\nterminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n")
    assert death.death_cause(log, -6).startswith("out of memory: what():  std::bad_alloc")


def test_no_log_is_said_as_such_with_its_path(tmp_path: Path) -> None:
    assert death.death_cause(tmp_path / "gone.log", 0) == f"no console log at {tmp_path / 'gone.log'}; exited 0"


def test_only_the_consoles_tail_is_read_and_a_link_is_not_followed(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with log.open("wb") as handle:
        handle.write(PORT_IN_USE.encode())  # beyond the tail: not read
        handle.truncate(8 * 1024**3)  # 8 GiB, sparse
        handle.seek(0, os.SEEK_END)
        handle.write(b"INFO last words\n")
    line = death.death_cause(log, 0)
    assert line.startswith("exited 0; last lines: ") and line.endswith(f"INFO last words (log: {log})") and "port in use" not in line
    link = tmp_path / "link.log"
    link.symlink_to(tmp_path / "outside.log")
    (tmp_path / "outside.log").write_text(PORT_IN_USE)
    assert death.death_cause(link, 0).startswith("no console log at")


def test_a_server_killed_with_no_output_is_reported_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    write_serve_python(tmp_path / "venv", "#!/bin/sh\nkill -9 $$\n")
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path / "venv"))
    with pytest.raises(ServeError, match=r"exit code -9\): no output; killed by signal 9 \(SIGKILL\) \(log: "), \
            serving.vllm_server(model, log_path=tmp_path / "server.log"):
        pass


# vLLM 0.32 on CPU, its worker SIGKILLed (as the OOM killer does): the API server then exited 0 (measured, 7 December 2026).
ENGINE = "(EngineCore pid=7147) ERROR 12-07 20:25:34 [core.py:1512] "
WORKER_KILLED = "\n".join([
    "(EngineCore pid=7147) ERROR 12-07 20:25:34 [multiproc_executor.py:315] "
    "Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.",
    ENGINE + "EngineCore encountered a fatal error.",
    ENGINE + "Traceback (most recent call last):",
    ENGINE + '  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 1702, in _handle_client_request',
    ENGINE + '    raise RuntimeError("Executor failed.")',
    ENGINE + "RuntimeError: Executor failed.",
    "(APIServer pid=6718) INFO 12-07 20:25:35 [launcher.py:110] Shutting down FastAPI HTTP server.",
]) + "\n"


def test_a_killed_worker_is_named_before_the_engines_wrapper(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(WORKER_KILLED)
    line = death.death_cause(log, 0)
    assert line.startswith("a server process was killed: Worker proc VllmWorker-0 died unexpectedly")
    assert "Then: RuntimeError: Executor failed." in line
