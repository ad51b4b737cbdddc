"""llama-cpp-python's OpenAI-compatible server on a GGUF file: the CPU peer `make bench-speed` measures beside vLLM.

`llamacpp_server` has vllm_server's contract: `python -m llama_cpp.server` from .venv-llamacpp (never imported here),
on loopback, with a fresh API key handed over in its environment (API_KEY: llama-cpp-python's settings read it like
--api_key, which `ps` would show), in a process group of its own with a parent-death signal and a watchdog
(pipelines/serve/reclaim.py), its output in a log file, ready once GET /v1/models with the key lists the served name,
and stopped however the block ends. The process gets a small environment of its own (models.llamacpp_env).

What the server does, measured with llama-cpp-python 0.3.36 (docs/llamacpp.md):
- one request at a time: a lock around its one llama_context; concurrent requests queue (SERVES_AT_ONCE);
- `interrupt_requests` (on by default) ends a streaming response as soon as another request waits, which would cut
  every stream short under a concurrent load test: it is always started with it off;
- `ignore_eos` is not one of its request fields and is dropped silently; `min_tokens` is, and stops EOS until that
  many tokens came: a load test asks for `min_tokens` = `max_tokens` (fixed_length_body) to get fixed-length outputs;
- it samples with repeat_penalty 1.1 unless asked otherwise (vllm bench sends vLLM's `repetition_penalty`, which it
  ignores), hence `repeat_penalty: 1.0` there too;
- starlette-context in front of its routes answers 400 to an X-Request-ID that is not a UUID, and vllm bench sends one
  with every request: it is started through llamacpp_launch.py, which turns that check off;
- a stream (`stream: true`) sends one chunk per token, then one with empty text and the finish reason, and no usage
  chunk (`stream_options` is ignored): vllm bench counts output tokens by tokenizing the text with its --tokenizer (the
  server's `model_dir`);
- `threads` = every core starves the server's own Python thread (uvicorn, which writes each token to the stream) of a
  core while llama.cpp's OpenMP workers spin between tokens: on a 2-core host a 64-token stream of the demo model took
  2.1 s with 2 threads and 0.2 s with 1 (0.6 s with 2 and OMP_WAIT_POLICY=PASSIVE, which the server's environment
  passes through). Give it the cores less one, as vLLM's CPU build keeps one for itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pipelines.errors import InputError, ServeError
from pipelines.models.llamacpp_env import clean_environment, require_llamacpp_env
from pipelines.serve.serving import (
    LOOPBACK,
    RunningServer,
    failure_line,
    free_port,
    new_api_key,
    port_is_free,
    start_process_group,
    stop_process_group,
)

LAUNCHER = Path(__file__).with_name("llamacpp_launch.py")
SERVES_AT_ONCE = 1  # llama-cpp-python's server: requests beyond this wait for the lock
MAX_THREADS = 1024
MAX_PARALLEL = 4096
MAX_CONTEXT = 1 << 20
STARTUP_TIMEOUT_S = 300.0


class LlamaCppServer(RunningServer):
    """A running llama-cpp-python server: `model_dir` is the tokenizer's folder (the HF model the GGUF was written
    from; vllm bench counts tokens with it), `gguf` the file served."""

    gguf: Path
    threads: int
    ctx: int
    parallel: int  # requests the caller sends at once
    serves_at_once: int = SERVES_AT_ONCE  # requests the server computes at once: the rest queue

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise ServeError(f"llama.cpp server for {self.gguf.name} died (exit code {self.process.returncode}): "
                             f"{failure_line(self.log_path, self.process.returncode)}", file=self.log_path)

    def check_engine(self) -> None:
        self.check_alive()


def fixed_length_body(output_len: int) -> dict[str, float | int]:
    """The request fields that make llama-cpp-python's completion what `vllm bench serve --ignore-eos` asks of vLLM:
    `output_len` tokens whatever the model says, no repetition penalty (`vllm bench serve --extra-body`)."""
    return {"min_tokens": _positive("output_len", output_len, MAX_CONTEXT), "repeat_penalty": 1.0}


def _positive(name: str, value: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise InputError(f"must be a whole number from 1 to {maximum}, not {value!r}", field=name)
    return value


def server_command(python: Path, gguf: Path, *, port: int, served_name: str, threads: int, ctx: int) -> list[str]:
    """`python -m llama_cpp.server` for `gguf` on loopback: `threads` for decode and prompt, a context of `ctx` tokens
    (the one llama_context every request shares, one at a time), no memory lock, streams never interrupted."""
    return [
        str(python), str(LAUNCHER),  # llama_cpp.server, accepting vllm bench's request ids (llamacpp_launch.py)
        "--model", str(gguf),
        "--model_alias", served_name,
        "--host", LOOPBACK,
        "--port", str(port),
        "--n_threads", str(threads),
        "--n_threads_batch", str(threads),
        "--n_ctx", str(ctx),
        "--use_mlock", "false",
        "--interrupt_requests", "false",
    ]


def require_gguf(gguf: Path) -> Path:
    gguf = Path(gguf)
    if not gguf.is_file():
        raise InputError("GGUF file not found", file=gguf)
    with gguf.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise InputError("not a GGUF file", file=gguf)
    return gguf


def _wait_until_ready(server: LlamaCppServer, timeout_s: float) -> None:
    """Until GET /v1/models with our key lists our name: a foreign process on the port never passes (no key, no name)."""
    deadline = time.monotonic() + timeout_s
    url = f"{server.base_url}/models"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            server.check_alive()
            try:
                response = client.get(url, headers=server.auth_headers)
                names = [model.get("id") for model in response.json().get("data", [])] if response.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                names = []
            if server.served_name in names:
                return
            time.sleep(0.25)
    raise ServeError(f"llama.cpp server did not answer /v1/models within {timeout_s:.0f} s: {failure_line(server.log_path)}",
                     file=server.log_path)


@contextmanager
def llamacpp_server(
    gguf: Path, *, log_path: Path, threads: int, ctx: int, parallel: int, model_dir: Path | None = None,
    served_name: str = "model", port: int | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[LlamaCppServer]:
    """Serve `gguf` with llama-cpp-python for the duration of the block (a LlamaCppServer); stopped however the block
    ends, and when this process dies. `parallel` is the number of requests the caller will send at once: the server
    takes them one at a time (SERVES_AT_ONCE), which a comparison must say."""
    gguf = require_gguf(gguf)
    threads, ctx = _positive("threads", threads, MAX_THREADS), _positive("ctx", ctx, MAX_CONTEXT)
    parallel = _positive("parallel", parallel, MAX_PARALLEL)
    if port is None:
        port = free_port()
    elif not port_is_free(port):
        raise ServeError(f"port {port} on {LOOPBACK} is already in use", field="port")
    python = require_llamacpp_env()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    api_key = new_api_key()
    started = time.monotonic()
    command = server_command(python, gguf, port=port, served_name=served_name, threads=threads, ctx=ctx)
    process, watchdog = start_process_group(command, env=clean_environment(API_KEY=api_key), log_path=log_path)
    try:
        server = LlamaCppServer(model_dir=model_dir or gguf.parent, served_name=served_name, port=port, log_path=log_path,
                                process=process, startup_s=0.0, api_key=api_key, gguf=gguf, threads=threads, ctx=ctx,
                                parallel=parallel)
        _wait_until_ready(server, startup_timeout_s)
        server.startup_s = time.monotonic() - started
        yield server
    finally:
        stop_process_group(process)
        watchdog.stop()
