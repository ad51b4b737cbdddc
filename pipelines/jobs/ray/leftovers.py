"""A Ray runtime started for the job ends with it: none of its processes is left once `ray.shutdown()` returns.

Measured: Ray's dashboard and runtime-env agents outlived the driver by 30-180 s. They are the raylet's children and
retitle themselves (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`, workers `ray::IDLE`), so their command lines no longer
name the session. The session's processes are therefore taken before the shutdown, from the process tree: the driver's
children whose command line names the job's session root (GCS, raylet, monitors, dashboard) and those processes'
descendants titled `ray::`. What is still running RAY_EXIT_GRACE_S after the shutdown is killed (SIGKILL; psutil refuses
to signal a pid that another process has taken since). A worker's own children (a vLLM server, its watchdog) are not
Ray's: they go with their process group through the watchdog (pipelines/serve/reclaim.py), never from here.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from pipelines.console.output import progress

RAY_EXIT_GRACE_S = 10.0
KILL_WAIT_S = 5.0
RAY_TITLE = "ray::"


def session_processes(session_root: Path, driver: psutil.Process | None = None) -> list[psutil.Process]:
    """The processes of the Ray runtime the driver started with `session_root` (see the module docstring)."""
    driver = driver or psutil.Process()
    marker = str(session_root)
    found: dict[int, psutil.Process] = {}
    for child in _children(driver, recursive=False):
        if marker not in _command_line(child):
            continue
        found[child.pid] = child
        for descendant in _children(child, recursive=True):
            if _command_line(descendant).startswith(RAY_TITLE):
                found[descendant.pid] = descendant
    return list(found.values())


def end_session_processes(processes: list[psutil.Process], grace_s: float = RAY_EXIT_GRACE_S) -> list[psutil.Process]:
    """Wait up to `grace_s` for `processes` to exit, then kill the rest; returns the ones that had to be killed."""
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    killed = []
    for process in alive:
        try:
            process.kill()
            killed.append(process)
        except psutil.Error:  # gone meanwhile, or its pid is another process's now
            pass
    psutil.wait_procs(killed, timeout=KILL_WAIT_S)
    if killed:
        progress(f"Ray: killed {len(killed)} process(es) of the job's runtime still running {grace_s:g} s after its shutdown")
    return killed


def _children(process: psutil.Process, *, recursive: bool) -> list[psutil.Process]:
    try:
        return process.children(recursive=recursive)
    except psutil.Error:
        return []


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""
