"""`quantize` SIGKILLed in the middle of scoring: nothing it started survives, and what it left on disk is reclaimed.

A real run on the demo model (one vLLM start: the baseline, on the smallest eval set) in an artifacts root
of its own, killed with SIGKILL (no Python clean-up runs, as with the OOM killer) while lm-eval scores. The
server's parent-death signal and its watchdog must take down the API server, engine core, workers, the
watchdog itself and lm-eval within 30 s; the key must not be on any command line; the staging folder it left
(with the server's shim folder and temporary files inside it) is removed by reclaim_stale once it is stale.

What must die is every descendant of `quantize` at the moment of the kill, plus every process carrying
the run's marker. The marker alone would miss vLLM's engine core and workers: they rename themselves
(`VLLM::EngineCore`, `VLLM::Worker`, setproctitle), which overwrites what /proc/<pid>/environ shows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from helpers import MARKER, QUANTIZE, Workspace, processes_with_marker

from pipelines.paths import DEMO_MODEL_DIR, REPO_ROOT
from pipelines.serve.reclaim import SHIM_PREFIX, reclaim_stale

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 600
DEATH_TIMEOUT_S = 30


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if process.environ().get(MARKER) == marker and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE  # is_running: not a reused pid
    except psutil.NoSuchProcess:
        return False


def _wait_for_scoring(quantize: subprocess.Popen, marker: str) -> list[psutil.Process]:
    """Every process of the run once lm-eval is running against the server (or fail with the run's output)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if quantize.poll() is not None:
            out, err = quantize.communicate()
            pytest.fail(f"quantize ended (exit {quantize.returncode}) before scoring started:\n{out[-2000:]}\n{err[-3000:]}")
        processes = _marked(marker)
        if any("lm_eval" in _cmdline(p) for p in processes):
            time.sleep(2.0)  # lm-eval is under way: its requests are in the engine
            return _marked(marker)
        time.sleep(0.2)
    quantize.kill()
    pytest.fail(f"scoring did not start within {START_TIMEOUT_S} s")


@pytest.fixture
def lifecycle_workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the demo model is missing ({DEMO_MODEL_DIR})")
    if not QUANTIZE.exists():
        pytest.fail(f"{QUANTIZE} is missing: install the package into the project environment (make setup)")
    return Workspace(tmp_path_factory.mktemp("lifecycle"))


def test_sigkill_of_quantize_leaves_no_process_and_reclaim_removes_its_folders(lifecycle_workspace: Workspace, smallest_set: str):
    workspace = lifecycle_workspace
    tmp_root = workspace.root / "tmp"  # quantize's TMPDIR: where serving puts its shim folder
    tmp_root.mkdir()
    marker = uuid.uuid4().hex
    quantize = subprocess.Popen(
        [str(QUANTIZE), "gate", "--artifact", str(DEMO_MODEL_DIR), "--baseline", str(DEMO_MODEL_DIR),
         "--recipe-name", "lifecycle", "--allow-unverified", "--eval-sets", smallest_set, "--no-registry"],
        cwd=REPO_ROOT, env={**workspace.env, MARKER: marker, "TMPDIR": str(tmp_root)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )
    try:
        processes = _wait_for_scoring(quantize, marker)
    except BaseException:
        quantize.kill()
        raise
    tree = psutil.Process(quantize.pid).children(recursive=True)
    everything = {p.pid: p for p in [*tree, *processes] if p.pid != quantize.pid}
    commands = {pid: _cmdline(p) for pid, p in everything.items()}
    kinds = " ".join(commands.values())
    for kind in ("vllm.entrypoints.openai.api_server", "VLLM::EngineCore", "VLLM::Worker", "lm_eval", "pipelines.serve.reclaim watchdog"):
        assert kind in kinds, f"no {kind} among {commands}"
    server = next(p for p in processes if "vllm.entrypoints.openai.api_server" in _cmdline(p))
    key = server.environ()["VLLM_API_KEY"]
    assert key and not [pid for pid, command in commands.items() if key in command], "the API key is on a command line"
    assert not [p.pid for p in psutil.process_iter() if key in _cmdline(p)]

    quantize.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out, err = quantize.communicate()
    assert key not in out + err, "the API key is printed"
    while time.monotonic() - killed < DEATH_TIMEOUT_S:
        if not any(_alive(p) for p in everything.values()) and not processes_with_marker(marker):
            break
        time.sleep(0.1)
    took = time.monotonic() - killed
    left = [commands[pid] for pid, p in everything.items() if _alive(p)] + processes_with_marker(marker)
    sys.stderr.write(f"[lifecycle] {len(everything)} processes of the killed run gone in {took:.1f} s: {sorted(commands.values())}\n")
    assert left == [], f"still running {took:.0f} s after SIGKILL of quantize: {left}"

    # What the dead run left: its staging folder (logs, tasks), holding the server's shim folder and the server's own
    # temporary files (shim/tmp: vLLM's rendezvous file, torch's caches); nothing of the server in the system's TMPDIR.
    (staging,) = list(workspace.runs_dir.glob(f".*-lifecycle-{quantize.pid}-*.tmp"))
    (shim,) = list(staging.glob(f"{SHIM_PREFIX}{quantize.pid}-*"))
    assert (shim / "tmp").is_dir() and not list(tmp_root.glob(f"{SHIM_PREFIX}*"))
    server_log = (staging / "baseline-server.log").read_text()
    assert "quantgate watchdog: process" in server_log
    sys.stderr.write(f"[lifecycle] {next(line for line in server_log.splitlines() if 'quantgate watchdog' in line)}\n")
    leaked = [str(path) for path in staging.rglob("*") if path.is_file() and key in path.read_text(errors="replace")]
    assert leaked == [], f"the API key is written in {leaked}"

    # Changed less than a minute ago: not taken (a run may be starting up); a minute later, reclaimed.
    for folder in (staging, shim):
        os.utime(folder, None)
    assert reclaim_stale(workspace.runs_dir, tmp_root) == []
    old = time.time() - 120
    for folder in (staging, shim):
        os.utime(folder, (old, old))
    assert reclaim_stale(workspace.runs_dir, tmp_root) == [staging]  # the shim goes with the run folder that holds it
    assert not staging.exists() and not shim.exists()
