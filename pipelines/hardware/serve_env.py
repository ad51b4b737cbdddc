"""The channel into the serve environment (.venv-serve, vLLM's pins): its Python, the environment every process of it runs
with (the shim alone on PYTHONPATH, the emulation's caps, no telemetry), the probe script run there and its answer line,
and the on-disk cache of what was learnt through it (beside the serve environment: the facts are its own)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from pipelines.errors import ServeError
from pipelines.files.atomic import StorageError, write_text_atomic
from pipelines.hardware.emulation import CpuIsa, emulated_class, emulation_env, shim_source
from pipelines.settings import current as current_settings

PROBE_SCRIPT = Path(__file__).with_name("serve_probe.py")
PROBE_MARKER = "QUANTGATE-PROBE "  # serve_probe.py's MARKER: it imports nothing of ours (tests/unit/hardware pins both)


def cache_dir() -> Path:
    """Beside the serve environment (the facts are its own), else under the artifacts root."""
    settings = current_settings()
    folder = settings.serve_venv_dir / ".quantgate-hardware"
    if os.access(settings.serve_venv_dir, os.W_OK):
        return folder
    return settings.artifacts_dir / "cache" / "hardware"


def store_cache(path: Path, text: str) -> None:
    """Write a cache file atomically; a cache that cannot be written costs a re-read, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except (OSError, StorageError):  # write_text_atomic reports a refused write as a StorageError
        pass  # a cache that cannot be written costs a re-read, nothing else


def require_serve_env() -> Path:
    """The serve environment's Python; a missing environment is a ServeError saying how to build it."""
    python = current_settings().serve_python
    if not python.exists():
        raise ServeError(
            f"the serve environment is missing ({python}); run `make setup` (or scripts/setup_env.sh serve)",
            file=python,
        )
    return python


def serve_process_env(shim_dir: Path, emulated: CpuIsa | None, *, non_finite_literals: bool = True) -> dict[str, str]:
    """The environment of every process of the serve environment (servers, the probe, vllm bench): the shim
    (sitecustomize) alone on PYTHONPATH, temporary files under shim_dir/tmp, no telemetry, the emulation caps;
    non_finite_literals: see emulation.shim_source."""
    (shim_dir / "sitecustomize.py").write_text(shim_source(emulated, non_finite_literals=non_finite_literals))
    scratch = shim_dir / "tmp"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(TMPDIR=str(scratch), TEMP=str(scratch), TMP=str(scratch))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    env.update(emulation_env(emulated))
    env["PYTHONPATH"] = str(shim_dir)  # only the shim: nothing of the project environment leaks in
    return env


def run_probe(request: dict, *, timeout_s: float) -> dict:
    """Run serve_probe.py in the serve environment, under the servers' own shim and environment."""
    python = require_serve_env()
    emulated = emulated_class()
    scratch = cache_dir()
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probe-", dir=scratch) as folder:
        env = serve_process_env(Path(folder), emulated)
        try:
            result = subprocess.run(
                # -P: the script's own folder (this package) must not shadow the modules vLLM imports (`kernels`)
                [str(python), "-P", str(PROBE_SCRIPT)], input=json.dumps(request), capture_output=True, text=True,
                timeout=timeout_s, env=env,
            )
        except subprocess.TimeoutExpired as error:
            raise ServeError(f"the kernel probe did not finish within {timeout_s:.0f} s", file=PROBE_SCRIPT) from error
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(PROBE_MARKER):
            return json.loads(line[len(PROBE_MARKER):])
    tail = " | ".join(result.stderr.strip().splitlines()[-3:])[-400:]
    raise ServeError(f"the kernel probe failed in the serve environment (exit code {result.returncode}): {tail}", file=PROBE_SCRIPT)
