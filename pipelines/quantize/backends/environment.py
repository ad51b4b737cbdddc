"""A subprocess backend's environment (.venv-NAME): its pins, built on first use by scripts/setup_env.sh NAME, and
the small, offline environment its processes get.

GPTQModel on a host with 2 cores or fewer: its CPU thread pool gets (cores + 1) // 2 workers while its model loader
asks for 2, and `GPTQModel.load` dies ("Virtual pool 'model_loader:cpu' requests 2 workers but parent 'cpu' only
has 1", measured on 2 cores); GPTQMODEL_CPU_WORKERS=2 gives the pool the 2 it needs (docs/backends.md).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.console.output import progress
from pipelines.errors import InputError
from pipelines.quantize.backends.specs import BackendSpec
from pipelines.serve.serving import log_tail
from pipelines.settings import current as current_settings

SETUP_TIMEOUT_S = 3600.0
_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
_GPTQMODEL_MIN_WORKERS = 2


def environment_dir(spec: BackendSpec) -> Path:
    assert spec.environment is not None
    return current_settings().root / f".venv-{spec.environment}"


def pinned_versions(spec: BackendSpec) -> dict[str, str]:
    """The backend's, torch's and transformers' versions as its lock file pins them (part of the artifact's key)."""
    assert spec.environment is not None
    lock = current_settings().root / "requirements" / f"{spec.environment}.lock"
    wanted = {spec.package.lower(), "torch", "transformers"}
    pins: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        name, _, pinned = line.strip().partition("==")
        if pinned and name.lower() in wanted:
            pins[name.lower()] = pinned
    return pins


def ensure_environment(spec: BackendSpec, log_path: Path) -> Path:
    """The backend environment's Python, built first when missing or stale (setup_env.sh is a no-op when its stamp
    matches the pins). A build that fails is an InputError naming the log, before any model is loaded."""
    python = environment_dir(spec) / "bin" / "python"
    stamp = environment_dir(spec) / ".quantgate-stamp"
    if not stamp.is_file():
        progress(f"building the {spec.name} environment {environment_dir(spec).name} (first use; pinned in "
                 f"requirements/{spec.environment}.lock: a few minutes, several GB)")
    started = time.monotonic()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time: two first uses (a bake-off beside a run, Ray workers) would run pip into one folder at once.
    with _locked(environment_dir(spec).with_name(f"{environment_dir(spec).name}.lock")), log_path.open("a") as log:
        try:
            root = current_settings().root
            result = subprocess.run(["bash", str(root / "scripts" / "setup_env.sh"), str(spec.environment)], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=SETUP_TIMEOUT_S, cwd=root)
        except subprocess.TimeoutExpired:
            raise InputError(f"building the {spec.name} environment took over {SETUP_TIMEOUT_S:.0f} s", file=log_path) from None
    if result.returncode != 0 or not python.exists():
        raise InputError(f"the {spec.name} environment could not be built (scripts/setup_env.sh {spec.environment} exit code "
                         f"{result.returncode}): {log_tail(log_path, 1)}", file=log_path, field="backend")
    if time.monotonic() - started > 5:
        progress(f"{environment_dir(spec).name} ready in {time.monotonic() - started:.0f} s")
    return python


def backend_process_env(spec: BackendSpec, scratch: Path) -> dict[str, str]:
    """A few of the caller's variables, offline flags, temporary files under `scratch`, and the backend's own settings."""
    env = {name: os.environ[name] for name in _KEPT if name in os.environ}
    env.update(PYTHONUNBUFFERED="1", PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false", TMPDIR=str(scratch), HOME=os.environ.get("HOME", str(scratch)))
    if spec.name == "gptqmodel" and len(os.sched_getaffinity(0)) <= 3:  # the cores this process may run on
        env["GPTQMODEL_CPU_WORKERS"] = str(_GPTQMODEL_MIN_WORKERS)
    return env


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
