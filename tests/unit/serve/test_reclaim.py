"""reclaim_stale: staging folders and shim folders of dead runs go; everything of a live run, and finished runs, stay."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from fakes import STARVE_SOURCE

from pipelines.serve import reclaim

OLD = 3600.0  # seconds: well past the one-minute guard


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.fixture
def sleeper():
    """A live process that is not Python (what a reused pid usually is)."""
    process = subprocess.Popen(["sleep", "300"])
    yield process.pid
    process.kill()
    process.wait()


def stamp(seconds_ago: float = 0.0) -> str:
    return datetime.fromtimestamp(time.time() - seconds_ago, timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def staging(runs: Path, pid: int, *, recipe: str = "w8a8", made_ago: float = 0.0, age_s: float = OLD, suffix: str = ".tmp") -> Path:
    """A staging folder as runner.run_gate makes it (`.<stamp>-<recipe>-<pid>-<hex>.tmp`), with files, last changed `age_s` ago."""
    folder = runs / f".{stamp(made_ago)}-{recipe}-{pid}-a1b2c3{suffix}"
    (folder / "candidate" / "lm_eval").mkdir(parents=True)
    (folder / "candidate-server.log").write_text("log")
    _age(folder, age_s)
    return folder


def shim(tmp_root: Path, pid: int, *, age_s: float = OLD) -> Path:
    folder = tmp_root / f"{reclaim.shim_prefix(pid)}k3j_x9"
    folder.mkdir(parents=True)
    (folder / "sitecustomize.py").write_text("")
    _age(folder, age_s)
    return folder


def _age(folder: Path, age_s: float) -> None:
    when = time.time() - age_s
    os.utime(folder, (when, when))


def test_a_dead_runs_staging_and_shim_folders_are_removed(tmp_path, dead_pid):
    runs, tmp_root = tmp_path / "runs", tmp_path / "tmp"
    stale = [staging(runs, dead_pid, made_ago=OLD), staging(runs, dead_pid, recipe="my-recipe-v2", made_ago=OLD), shim(tmp_root, dead_pid)]
    removed = reclaim.reclaim_stale(runs, tmp_root)
    assert sorted(removed) == sorted(stale)
    assert not any(path.exists() for path in stale)


def test_a_live_runs_folders_stay(tmp_path):
    runs, tmp_root = tmp_path / "runs", tmp_path / "tmp"
    # this test process started before "now": it is the live owner of folders made now (and aged by mtime only)
    mine = [staging(runs, os.getpid()), shim(tmp_root, os.getpid())]
    for folder in mine:
        _age(folder, 0)
    assert reclaim.reclaim_stale(runs, tmp_root, stale_after_s=0) == []
    assert all(path.exists() for path in mine)


def test_a_recent_folder_of_a_dead_pid_stays_for_a_minute(tmp_path, dead_pid):
    runs, tmp_root = tmp_path / "runs", tmp_path / "tmp"
    recent = [staging(runs, dead_pid, age_s=5), shim(tmp_root, dead_pid, age_s=5)]
    assert reclaim.reclaim_stale(runs, tmp_root) == []
    assert all(path.exists() for path in recent)


def test_a_reused_pid_does_not_keep_a_dead_runs_folder(tmp_path, sleeper):
    # the pid is alive, but it is `sleep`, not Python
    runs = tmp_path / "runs"
    folder = staging(runs, sleeper, made_ago=OLD)
    assert reclaim.reclaim_stale(runs, tmp_path / "tmp") == [folder]


def test_a_python_process_started_after_the_folder_is_a_reused_pid(tmp_path):
    # this very Python process, but the run id says the run began a day before it started
    runs = tmp_path / "runs"
    folder = staging(runs, os.getpid(), made_ago=86400)
    shim_folder = shim(tmp_path / "tmp", os.getpid(), age_s=86400)
    assert sorted(reclaim.reclaim_stale(runs, tmp_path / "tmp")) == sorted([folder, shim_folder])


def test_finished_and_failed_runs_and_other_files_are_never_touched(tmp_path, dead_pid):
    runs, tmp_root = tmp_path / "runs", tmp_path / "tmp"
    identifier = f"{stamp(OLD)}-w8a8-{dead_pid}-a1b2c3"
    keep = [
        runs / identifier, runs / f"{identifier}-error", runs / f".{identifier}.tmpx", tmp_root / f"quantgate-vllm-x{dead_pid}-abc",
        tmp_root / "other",
    ]
    for folder in keep:
        folder.mkdir(parents=True)
        _age(folder, OLD)
    (runs / f".{identifier}.tmp").write_text("a file, not a staging folder")
    assert reclaim.reclaim_stale(runs, tmp_root) == []
    assert all(path.exists() for path in keep)


def test_a_symlink_named_like_a_staging_folder_is_not_followed(tmp_path, dead_pid):
    runs = tmp_path / "runs"
    runs.mkdir()
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data").write_text("keep")
    link = runs / f".{stamp(OLD)}-w8a8-{dead_pid}-a1b2c3.tmp"
    link.symlink_to(target)
    assert reclaim.reclaim_stale(runs, tmp_path / "tmp") == []
    assert (target / "data").read_text() == "keep"


def test_missing_folders_are_fine(tmp_path):
    assert reclaim.reclaim_stale(tmp_path / "no-runs", tmp_path / "no-tmp") == []


def test_owner_alive_recognises_this_process_and_not_a_dead_one(dead_pid, sleeper):
    assert reclaim.owner_alive(os.getpid(), time.time())
    assert not reclaim.owner_alive(dead_pid, time.time())
    assert not reclaim.owner_alive(sleeper, time.time())


def test_the_command_line_removes_stale_folders(tmp_path, dead_pid):
    runs, tmp_root = tmp_path / "runs", tmp_path / "tmp"
    folder = staging(runs, dead_pid, made_ago=OLD)
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.serve.reclaim", "stale", str(runs), "--tmp-root", str(tmp_root)],
        capture_output=True, text=True, check=True, cwd=Path(reclaim.__file__).resolve().parents[2],
    )
    assert result.stdout.split() == [str(folder)]


def _watch_group(command: list[str], *, seconds: float, window_s: float = 3.0) -> tuple[str | None, float]:
    """Start `command` as a process group of its own and look at it twice a second for `seconds`: the first
    starvation seen (else None) and the CPU the group was given."""
    process = subprocess.Popen(command, start_new_session=True)
    try:
        watch = reclaim.StarvationWatch(process.pid, window_s=window_s, min_cpu_s=0.05)
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            found = watch.look()
            if found is not None:
                return found, watch.progress_s
            time.sleep(0.5)
        return None, watch.progress_s
    finally:
        os.killpg(process.pid, 9)
        process.wait()


def test_a_group_runnable_and_given_no_cpu_is_starved():
    found, given = _watch_group([sys.executable, "-c", STARVE_SOURCE], seconds=10)
    assert found is not None and given < 0.3, (found, given)  # its Python start-up included
    assert found.startswith("runnable for ") and "on CPUs " in found and "the hypervisor took" in found


@pytest.mark.parametrize("source", ["while True: pass", "import time; time.sleep(60)"], ids=["busy", "waiting"])
def test_a_busy_or_waiting_group_is_never_starved(source):
    found, _ = _watch_group([sys.executable, "-c", source], seconds=5)
    assert found is None, found


def test_a_stopped_group_is_not_starved_it_does_not_want_a_cpu():
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        os.kill(process.pid, 19)  # SIGSTOP: state T, once the kernel has delivered it
        deadline = time.monotonic() + 10
        while reclaim._stat_fields(process.pid)[0] != "T":  # until then the new process may still be runnable (a CI run saw R)
            assert time.monotonic() < deadline, "SIGSTOP was not delivered within 10 s"
            time.sleep(0.01)
        watch = reclaim.StarvationWatch(process.pid, window_s=1.0, min_cpu_s=0.05)
        assert [watch.look(now) for now in (0.0, 0.6, 1.2, 1.8)] == [None] * 4
    finally:
        process.kill()
        process.wait()


# A Ray worker as /proc shows it: Ray rewrites argv to its title and sets comm (prctl PR_SET_NAME) to the same, cut to 15 bytes.
RAY_TITLED = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, b"ray::candidate_task"[:15], 0, 0, 0)
print("ready", flush=True)
time.sleep(300)
"""


@pytest.fixture
def ray_worker():
    """A live Python process titled as a Ray worker running a candidate (`ray::candidate_task`)."""
    command = f'exec -a "ray::candidate_task" {sys.executable} -c \'{RAY_TITLED}\''
    process = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    yield process.pid
    process.kill()
    process.wait()


def test_a_ray_workers_staging_folder_stays_while_it_runs(tmp_path, ray_worker):
    # The Ray job's lost log: two candidates on one host, and one's reclaim took the other's live staging folder for a dead
    # run's, since its owner was not named python.
    runs = tmp_path / "runs"
    assert Path(f"/proc/{ray_worker}/comm").read_text().strip() == "ray::candidate_"
    folder = staging(runs, ray_worker, age_s=OLD)
    assert reclaim.reclaim_stale(runs, tmp_path / "tmp") == []
    assert folder.exists()


def test_a_held_owner_lock_keeps_a_staging_folder_whatever_its_pid_says(tmp_path, dead_pid):
    runs = tmp_path / "runs"
    folder = staging(runs, dead_pid, made_ago=OLD)
    lock = reclaim.hold_owner_lock(folder)
    try:
        _age(folder, OLD)
        assert reclaim.owner_lock_held(folder) is True
        assert reclaim.reclaim_stale(runs, tmp_path / "tmp") == []
    finally:
        os.close(lock)
    assert reclaim.owner_lock_held(folder) is False
    assert reclaim.reclaim_stale(runs, tmp_path / "tmp") == [folder]


def test_a_released_owner_lock_frees_a_folder_even_when_its_pid_is_a_live_python(tmp_path):
    runs = tmp_path / "runs"
    folder = staging(runs, os.getpid())  # this process's pid: alive and Python, as a reused pid may be
    os.close(reclaim.hold_owner_lock(folder))
    _age(folder, OLD)
    assert reclaim.reclaim_stale(runs, tmp_path / "tmp") == [folder]


def test_a_killed_owner_releases_its_lock(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    code = ("import pathlib, time; from pipelines.serve.reclaim import hold_owner_lock; "
            f"hold_owner_lock(pathlib.Path({str(folder)!r})); print('held', flush=True); time.sleep(300)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None and owner.stdout.readline().strip() == "held"
    assert reclaim.owner_lock_held(folder) is True
    owner.kill()
    owner.wait()
    assert reclaim.owner_lock_held(folder) is False
