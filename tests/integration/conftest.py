"""Session fixtures for the end-to-end tests: the real `quantize` command on the demo model, each run once.

Everything writes under one temporary folder (QUANTGATE_ARTIFACTS, QUANTGATE_REGISTRY), never into the
repository's artifacts/. The runs share that folder on purpose: the first run scores the 16-bit baseline,
every later run (and the job) reuses its cached scores and the quantized artifacts, which is what keeps
this suite at a few minutes on a 2-core machine. Each fixture runs its command once per session and
the tests read its exit code, JSON, gate.json, run folder and registry.

Every command gets its own marker in the environment, which vLLM and lm-eval inherit: after a command
returns, no process carrying its marker may be alive (servers are always stopped).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from pipelines.evalsets import discover_eval_sets
from pipelines.paths import DEMO_EVAL_SETS, DEMO_MODEL_DIR, REPO_ROOT
from pipelines.registry import Registry

MARKER = "QUANTGATE_TEST_COMMAND"
CLI_TIMEOUT_S = 1200
CI_GATE_SCRIPT = REPO_ROOT / "scripts" / "ci_gate_example.sh"
QUANTIZE = Path(sys.executable).with_name("quantize")  # the console script `pip install -e .` puts beside python


@dataclass
class CommandRun:
    """One finished command: what it printed, how it exited, which run folders it created."""

    argv: list[str]
    code: int
    stdout: str
    stderr: str
    wall_s: float
    marker: str
    new_runs: list[Path] = field(default_factory=list)

    @property
    def json(self) -> dict:
        return json.loads(self.stdout)

    @property
    def error_line(self) -> str:
        """The CLI's one-line error (`quantize: error: ...`), or '' when there is none."""
        return next((line for line in self.stderr.splitlines() if line.startswith("quantize: error:")), "")

    def describe(self) -> str:
        return f"{' '.join(self.argv)} -> exit {self.code}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def processes_with_marker(marker: str) -> list[str]:
    """Live processes whose environment carries `marker` (vLLM servers, engine cores, lm-eval)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if process.environ().get(MARKER) == marker and process.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


class Workspace:
    """A temporary artifacts root and registry, and the commands run against them."""

    def __init__(self, root: Path):
        self.root = root
        self.artifacts = root / "artifacts"
        self.registry_path = root / "registry.db"
        self.runs_dir = self.artifacts / "runs"
        self.env = {
            **os.environ,
            "QUANTGATE_ARTIFACTS": str(self.artifacts),
            "QUANTGATE_REGISTRY": str(self.registry_path),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }

    def registry(self) -> Registry:
        return Registry(self.registry_path)

    def run_folders(self) -> set[Path]:
        return set(self.runs_dir.iterdir()) if self.runs_dir.is_dir() else set()

    def run(
        self, argv: list[str], *, timeout_s: float = CLI_TIMEOUT_S, env: dict[str, str] | None = None,
        terminate_when: Callable[[str], bool] | None = None, grace_s: float = 3.0,
    ) -> CommandRun:
        """Run `argv` to its end (killed after `timeout_s`). With `terminate_when`, send SIGTERM (what a
        scheduler sends) `grace_s` after the command's stderr so far satisfies it."""
        marker, before, started = uuid.uuid4().hex, self.run_folders(), time.monotonic()
        process = subprocess.Popen(
            argv, cwd=REPO_ROOT, env={**self.env, **(env or {}), MARKER: marker}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )
        watchdog = threading.Timer(timeout_s, process.kill)
        watchdog.start()
        try:
            head = _terminate_when(process, terminate_when, grace_s) if terminate_when else ""
            out, rest = process.communicate()
        finally:
            watchdog.cancel()
        run = CommandRun(
            argv=argv, code=process.returncode, stdout=out, stderr=head + rest,
            wall_s=round(time.monotonic() - started, 1), marker=marker, new_runs=sorted(self.run_folders() - before),
        )
        sys.stderr.write(f"[integration] {' '.join(argv[1:])}: exit {run.code} in {run.wall_s} s\n")
        return run

    def quantize(self, *args: str, terminate_when: Callable[[str], bool] | None = None) -> CommandRun:
        return self.run([str(QUANTIZE), *args], terminate_when=terminate_when)


def _terminate_when(process: subprocess.Popen, condition: Callable[[str], bool], grace_s: float) -> str:
    """Read the process's stderr until `condition` holds on it, then SIGTERM it; returns what was read."""
    stderr = ""
    for line in process.stderr:
        stderr += line
        if condition(stderr):
            time.sleep(grace_s)
            process.send_signal(signal.SIGTERM)
            break
    return stderr


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the demo model is missing ({DEMO_MODEL_DIR}); the end-to-end tests run on it")
    if not QUANTIZE.exists():
        pytest.fail(f"{QUANTIZE} is missing: install the package into the project environment (make setup)")
    return Workspace(tmp_path_factory.mktemp("quantgate"))


@pytest.fixture(scope="session")
def eval_set_names() -> list[str]:
    return list(DEMO_EVAL_SETS)


@pytest.fixture(scope="session")
def smallest_set(eval_set_names: list[str]) -> str:
    """The eval set with the fewest items: for checks that need one set, not all of them."""
    sets = {s.name: s.num_items for s in discover_eval_sets()}
    return min(eval_set_names, key=lambda name: (sets[name], name))


@pytest.fixture(scope="session")
def w8a8_run(workspace: Workspace) -> CommandRun:
    """The first run of the session: quantizes, scores the 16-bit baseline on every set (cold cache)."""
    return workspace.quantize("--recipe", "w8a8", "--eval-sets", ",".join(DEMO_EVAL_SETS), "--json")


@pytest.fixture(scope="session")
def aggressive_run(workspace: Workspace, w8a8_run: CommandRun) -> CommandRun:
    """The negative control under the default policy, after w8a8: a warm run (the baseline's scores are cached)."""
    return workspace.quantize("--recipe", "aggressive", "--eval-sets", ",".join(DEMO_EVAL_SETS), "--json")


@pytest.fixture(scope="session")
def broken_model(workspace: Workspace) -> Path:
    """The demo model with an architecture no vLLM knows: passes every check before serving, fails to start."""
    folder = workspace.root / "broken-model"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def broken_start_run(workspace: Workspace, w8a8_run: CommandRun, broken_model: Path, smallest_set: str) -> CommandRun:
    return workspace.quantize(
        "gate", "--artifact", str(broken_model), "--baseline", str(DEMO_MODEL_DIR), "--eval-sets", smallest_set, "--json",
        "--allow-unverified",
    )


@pytest.fixture(scope="session")
def self_gate_run(workspace: Workspace, broken_start_run: CommandRun, smallest_set: str) -> CommandRun:
    """The CI example script gating the 16-bit model against itself; it runs after the failed start on purpose.
    Without the load test (it would start the baseline server once more; test_loadtest_e2e.py covers it)."""
    return workspace.run(
        ["bash", str(CI_GATE_SCRIPT), str(DEMO_MODEL_DIR), str(DEMO_MODEL_DIR), "--eval-sets", smallest_set, "--allow-unverified",
         "--no-loadtest"],
        env={"QUANTIZE": str(QUANTIZE), "PYTHON": sys.executable},
    )


@pytest.fixture(scope="session")
def no_process_left():
    """assert_no_process_left(run): nothing the command started (vLLM, engine core, lm-eval) is still alive."""

    def check(run: CommandRun) -> None:
        left = processes_with_marker(run.marker)
        assert left == [], f"processes of `{' '.join(run.argv[1:])}` still running: {left}"

    return check
