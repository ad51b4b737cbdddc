"""The llama.cpp environment (.venv-llamacpp, built by `scripts/setup_env.sh llamacpp`), driven as a subprocess.

The project never imports llama_cpp: it runs that environment's Python, either on llamacpp_tool.py (quantize,
probe) or on `-m llama_cpp.server` (pipelines/serve/llamacpp.py). Its processes get a small environment of their
own (`clean_environment`): llama-cpp-python's server reads its settings from environment variables of any name
(pydantic-settings without a prefix: MODEL, N_CTX, API_KEY, ...) and uvicorn's address from HOST and PORT, so a
variable a shell happens to set (zsh sets HOST) would change what it serves and where.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

from pipelines.errors import InputError
from pipelines.settings import current as current_settings

TOOL_SCRIPT = Path(__file__).resolve().with_name("llamacpp_tool.py")
TOOL_MARKER = "QUANTGATE-LLAMACPP "
SETUP_HINT = "scripts/setup_env.sh llamacpp (compiles llama.cpp: several minutes; `make bench-speed` runs it)"
# Passed through to llama.cpp's processes; nothing else of the caller's environment is.
_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_CPU_AFFINITY", "GOMP_SPINCOUNT")


def require_llamacpp_env() -> Path:
    """The llama.cpp environment's Python; a missing environment is an InputError saying how to build it."""
    python = current_settings().llamacpp_python
    if not python.exists():
        raise InputError(f"the llama.cpp environment is missing ({python}); run {SETUP_HINT}", file=python)
    return python


def clean_environment(**extra: str) -> dict[str, str]:
    """The environment of every llama.cpp process: a few of the caller's variables, offline flags, and `extra`."""
    env = {name: os.environ[name] for name in _KEPT if name in os.environ}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", DO_NOT_TRACK="1", PYTHONNOUSERSITE="1")
    env.update(extra)
    return env


def run_tool(arguments: list[str], *, log_path: Path, timeout_s: float, request: dict | None = None) -> dict | None:
    """Run llamacpp_tool.py in the llama.cpp environment, its chatter appended to `log_path`; the JSON it printed after
    TOOL_MARKER, or None when it prints none (quantize). A failure is an InputError naming the log."""
    python = require_llamacpp_env()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # -P: the script's folder (pipelines/models, with its own gguf.py) must not shadow the modules llama_cpp imports
    command = [str(python), "-P", str(TOOL_SCRIPT), *arguments]
    with log_path.open("a") as log:
        try:
            result = subprocess.run(command, input=json.dumps(request) if request is not None else None, stdout=subprocess.PIPE,
                                    stderr=log, text=True, timeout=timeout_s, env=clean_environment())
        except subprocess.TimeoutExpired:
            raise InputError(f"llama.cpp's {arguments[0]} did not finish within {timeout_s:.0f} s", file=log_path) from None
    if result.returncode != 0:
        raise InputError(f"llama.cpp's {arguments[0]} failed (exit code {result.returncode}): {_last_line(log_path)}", file=log_path)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(TOOL_MARKER):
            return json.loads(line[len(TOOL_MARKER):])
    return None


def _last_line(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


@lru_cache(maxsize=1)
def llamacpp_version() -> str:
    """llama-cpp-python's version in its environment (part of the GGUF cache key: its quantizer wrote the files)."""
    code = "from importlib.metadata import version; print(version('llama-cpp-python'))"
    result = subprocess.run([str(require_llamacpp_env()), "-c", code], capture_output=True, text=True, check=True, env=clean_environment())
    return result.stdout.strip()
