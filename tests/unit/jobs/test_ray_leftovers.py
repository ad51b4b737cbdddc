"""A Ray runtime started for the job leaves no process behind, however long its agents would have lingered."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pipelines.jobs.ray import cluster, leftovers

# A stand-in for a raylet: names the session root on its command line and starts an agent that retitles itself as Ray's
# do (argv rewritten) and ignores SIGTERM, as a lingering dashboard agent did.
RAYLET = """
import subprocess, sys, time
subprocess.Popen(["bash", "-c", "trap '' TERM; exec -a ray::DashboardAgent sleep 300"])
print("started", flush=True)
time.sleep(300)
"""


def test_an_agent_that_outlives_its_raylet_is_killed_after_the_grace(tmp_path: Path) -> None:
    root = tmp_path / "ray-root"
    raylet = subprocess.Popen([sys.executable, "-c", RAYLET, f"--session-dir={root}/session_x"], stdout=subprocess.PIPE, text=True)
    assert raylet.stdout is not None and raylet.stdout.readline().strip() == "started"
    other = subprocess.Popen(["sleep", "300"])  # a child of the driver that is not Ray's: never touched
    try:
        found = leftovers.session_processes(root)
        (agent,) = [process for process in found if process.pid != raylet.pid]
        assert {process.pid for process in found} == {raylet.pid, agent.pid}
        assert " ".join(agent.cmdline()).startswith("ray::DashboardAgent")
        raylet.kill()  # the runtime's shutdown: the raylet goes, its agent stays
        raylet.wait()
        assert agent.is_running()
        killed = leftovers.end_session_processes(found, grace_s=1.0)
        assert [process.pid for process in killed] == [agent.pid] and not agent.is_running()
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        raylet.kill()
        raylet.wait()


@pytest.mark.slow
def test_a_local_ray_runtime_leaves_no_process_of_its_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with cluster.connected(None) as ray:
        assert ray.get(ray.remote(num_cpus=0)(lambda: 1).remote()) == 1
        root = Path(ray._private.worker._global_node.get_temp_dir_path())  # where this session lives, as Ray sees it
        ours = leftovers.session_processes(root)
        assert any(" ".join(process.cmdline()).startswith("ray::") for process in ours), "the agents and workers are found"
    # right after the block: no process of the session, neither the driver's children nor a retitled agent or worker
    left = [process for process in ours if process.is_running() and process.status() != psutil.STATUS_ZOMBIE]
    assert left == []
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(root) in " ".join(p.info["cmdline"] or [])]
    assert not [p for p in psutil.Process().children(recursive=True) if _command_line(p).startswith("ray::")]


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone since it was listed
        return ""
