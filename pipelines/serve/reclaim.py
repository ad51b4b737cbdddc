"""Nothing of a run outlives it: its processes die with `quantize`, and what a dead run left on disk is reclaimed.

Processes. `quantize` starts two kinds of child: vLLM's server (in a process group of its own: API server,
engine core, workers) and lm-eval. However `quantize` ends, including SIGKILL and the OOM killer, where
no Python clean-up runs:

- every direct child gets a parent-death signal (`die_with_parent`, PR_SET_PDEATHSIG, set between fork
  and exec): the kernel signals it the moment the thread that started it exits;
- the server's grandchildren are not covered by that (their parent is the API server, not `quantize`),
  so every server gets a watchdog (`start_watchdog`): a small Python process in a session of its own that
  holds the read end of a pipe whose write end only `quantize` holds. When `quantize` dies the kernel
  closes the write end, the watchdog wakes (EOF) and stops the server's whole process group: SIGTERM,
  a short grace period (ORPHANED_GRACE_S: nobody waits for a graceful shutdown), SIGKILL. It also polls its
  parent pid (a forked copy of `quantize` that still holds the write end cannot keep it waiting) and exits
  once the group is empty.

Disk. `reclaim_stale` removes what dead runs left: the runner's staging folders `runs/.<run id>.tmp`
(run id `<stamp>-<recipe>-<pid>-<hex>`) and serving's shim folders `<tmp>/quantgate-vllm-<pid>-*`, when the
folder has not changed for a minute and its owner is gone. A staging folder says so itself: its run holds an
exclusive lock on its OWNER_LOCK file for its whole life (`hold_owner_lock`), which the kernel drops however the
process ends. Without that file (a shim folder, an older run) the owner pid decides: not alive as the process that
created it (dead, a zombie, neither Python nor a Ray worker, or started after the folder: pid reuse).
Why the lock: a Ray worker renames itself `ray::candidate_task`; two candidates on one host each reclaimed before
their run, and the second took the first's live staging folder (its server log, its shim) for a dead run's.

This module uses only the standard library: `python -m pipelines.serve.reclaim watchdog` starts in ~0.1 s.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from calendar import timegm
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PR_SET_PDEATHSIG = 1  # linux/prctl.h
STALE_AFTER_S = 60.0
SHIM_PREFIX = "quantgate-vllm-"
WATCHDOG_POLL_S = 0.5
DEFAULT_GRACE_S = 10.0
# When the starter died without stopping the group (SIGKILL, the OOM killer), nobody waits for a graceful shutdown: the
# group gets this long after SIGTERM (the API server got its parent-death signal already), then SIGKILL.
ORPHANED_GRACE_S = 2.0
# A pid whose process started more than this after its folder was made is a reused pid. The margin
# absorbs wall-clock steps since boot (start times are boot time + ticks); erring here keeps a folder.
_START_MARGIN_S = 5.0
_STAGING = re.compile(r"\.(?P<stamp>\d{8}T\d{6}Z)-(?P<recipe>.+)-(?P<pid>\d+)-(?P<hex>[0-9a-f]+)\.tmp")
OWNER_LOCK = ".owner.lock"  # in a staging folder: locked (flock, exclusive) while its run is alive
RAY_WORKER_TITLE = "ray::"  # what a Ray worker sets as its process title (argv[0] and comm): `ray::candidate_task`
_SHIM = re.compile(rf"{re.escape(SHIM_PREFIX)}(?P<pid>\d+)-[A-Za-z0-9_]+")


# --- processes: parent-death signal --------------------------------------------------------------


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # libc, already loaded: no library search at import
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A Popen `preexec_fn`: the child receives `sig` when the thread that started it exits (PR_SET_PDEATHSIG).

    The setting survives exec and covers SIGKILL of the parent; it does not reach the child's own children.
    If the parent died between fork and prctl, the child signals itself at once. Start the child from a
    thread that lives as long as the child should (the main thread, in `quantize`).
    """
    parent = os.getpid()
    prctl = _PRCTL  # resolved in the parent: the child only calls it

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


# --- processes: the watchdog ---------------------------------------------------------------------


@dataclass
class Watchdog:
    """The watchdog of one process group, as its starter holds it: the process and the pipe's write end."""

    process: subprocess.Popen
    write_fd: int | None
    pgid: int

    def stop(self, timeout_s: float = DEFAULT_GRACE_S + 5.0) -> None:
        """After a normal stop of the group: tell the watchdog to sweep the (now empty) group and exit."""
        if self.write_fd is not None:
            try:
                os.write(self.write_fd, b"stop\n")
            except OSError:
                pass
            os.close(self.write_fd)
            self.write_fd = None
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_watchdog(pgid: int, *, grace_s: float = DEFAULT_GRACE_S, log: IO | None = None) -> Watchdog:
    """Start a watchdog that stops process group `pgid` (SIGTERM, `grace_s`, SIGKILL) once this process is gone.

    The watchdog runs `python -m pipelines.serve.reclaim watchdog` in a session of its own (a Ctrl-C or a
    SIGTERM sent to this process's group does not reach it). It wakes on EOF of a pipe whose write end
    only this process holds, and polls its parent pid every WATCHDOG_POLL_S; it exits when the group is
    empty. `log` (a file opened for appending) gets one line when it has to act.
    """
    read_fd, write_fd = os.pipe()  # both close-on-exec: no other child inherits the write end
    command = [
        sys.executable, "-m", "pipelines.serve.reclaim", "watchdog",
        "--parent", str(os.getpid()), "--pgid", str(pgid), "--fd", str(read_fd), "--grace", str(grace_s),
    ]
    try:
        process = subprocess.Popen(
            command, pass_fds=(read_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=log if log is not None else subprocess.DEVNULL, start_new_session=True,
            cwd=str(Path(__file__).resolve().parent.parent.parent),
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return Watchdog(process=process, write_fd=write_fd, pgid=pgid)


def exit_description(returncode: int) -> str:
    """A child's end as Popen reports it, in words: `exit code 1`, or `killed by SIGKILL` for a negative code."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, read from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _stat_fields(int(entry.name))
        if stat is not None and stat[0] != "Z" and int(stat[2]) == pgid:
            members.append(int(entry.name))
    return members


def describe_group(pgid: int) -> str:
    """The members of process group `pgid` as `pid name state cpu-seconds`, for a server that never became healthy: a
    member in state T was stopped, one with no CPU time never ran, one in R at full CPU was busy."""
    ticks = os.sysconf("SC_CLK_TCK")
    parts = []
    for pid in group_members(pgid):
        stat = _stat_fields(pid)
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if stat is not None:
            parts.append(f"{pid} {name} {stat[0]} {(int(stat[11]) + int(stat[12])) / ticks:.1f} s CPU")
    return "; ".join(parts) or "no process left"


def _member_detail(pid: int) -> str:
    """`pid name state on CPUs a-b, wchan w`: where a starved member was allowed to run and what it waited on."""
    stat = _stat_fields(pid)
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return f"{pid} gone"
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
    except OSError:  # hidden on some hardened kernels
        wchan = "?"
    allowed = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")), "?")
    return f"{pid} {name} {stat[0] if stat else '?'} on CPUs {allowed}, wchan {wchan}"


def _steal_s() -> float:
    """CPU time the hypervisor took from this (virtual) machine's CPUs since boot (/proc/stat, all CPUs), in seconds; in a
    container, from the whole host's."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return 0.0
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


@dataclass
class _GroupLook:
    at: float
    progress_s: float  # CPU the group was given since the watch began (members that left keep what they had)
    runnable: bool  # some member was in state R: it wanted a CPU
    steal_s: float


class StarvationWatch:
    """Whether a starting process group is starved: wanting a CPU (a member runnable in at least half the looks) for
    `window_s` and given less than `min_cpu_s` of it. Seen on the 2-core host: a restarted vLLM sat in state R with
    0.3 s of CPU for minutes while its neighbours restarted in 45-80 s; a fresh start is the cure.
    A start-up that waits (state S: a lock, a socket) is never starved: its own time-out covers it."""

    def __init__(self, pgid: int, *, window_s: float, min_cpu_s: float):
        self.pgid, self.window_s, self.min_cpu_s = pgid, window_s, min_cpu_s
        self.seen: dict[int, float] = {}
        self.progress_s = 0.0
        self.looks: list[_GroupLook] = []

    def look(self, now: float | None = None) -> str | None:
        """Sample the group; a one-line description when it is starved, else None."""
        now = time.monotonic() if now is None else now
        ticks = os.sysconf("SC_CLK_TCK")
        runnable = False
        for pid in group_members(self.pgid):
            stat = _stat_fields(pid)
            if stat is None:
                continue
            cpu = (int(stat[11]) + int(stat[12])) / ticks
            self.progress_s += max(0.0, cpu - self.seen.get(pid, 0.0))
            self.seen[pid] = cpu
            runnable = runnable or stat[0] == "R"
        self.looks.append(_GroupLook(at=now, progress_s=self.progress_s, runnable=runnable, steal_s=_steal_s()))
        while len(self.looks) > 1 and self.looks[1].at <= now - self.window_s:
            self.looks.pop(0)
        first = self.looks[0]
        if now - first.at < self.window_s or self.progress_s - first.progress_s >= self.min_cpu_s:
            return None
        if 2 * sum(look.runnable for look in self.looks) < len(self.looks):
            return None
        members = "; ".join(_member_detail(pid) for pid in group_members(self.pgid)) or "no process left"
        return (f"runnable for {now - first.at:.0f} s and given {self.progress_s - first.progress_s:.1f} s of CPU ({members}; "
                f"the hypervisor took {self.looks[-1].steal_s - first.steal_s:.1f} s of CPU from this machine meanwhile)")


def stop_group(pgid: int, grace_s: float = DEFAULT_GRACE_S) -> bool:
    """SIGTERM group `pgid`, wait up to `grace_s` for it to empty, then SIGKILL what is left. True if any was found."""
    if not group_members(pgid):
        return False
    _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_members(pgid):
        time.sleep(0.1)
    _killpg(pgid, signal.SIGKILL)
    return True


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def watch(parent: int, pgid: int, fd: int, grace_s: float = DEFAULT_GRACE_S, poll_s: float = WATCHDOG_POLL_S) -> str:
    """The watchdog's loop; returns why it ended: 'group gone', 'stopped' (normal stop) or 'parent gone'."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        if not group_members(pgid):
            return "group gone"
        ready, _, _ = select.select([fd], [], [], poll_s)
        if ready:
            data = os.read(fd, 64)
            if data:  # the starter stopped the group itself: sweep whatever is left, quietly
                stop_group(pgid, grace_s)
                return "stopped"
            break  # EOF: every holder of the write end is gone
        if os.getppid() != parent:
            break
    started = time.monotonic()
    found = stop_group(pgid, min(grace_s, ORPHANED_GRACE_S))
    if found:
        print(
            f"quantgate watchdog: process {parent} is gone; stopped process group {pgid} "
            f"in {time.monotonic() - started:.1f} s",
            file=sys.stderr, flush=True,
        )
    return "parent gone"


# --- disk: reclaiming what dead runs left --------------------------------------------------------


def shim_prefix(pid: int | None = None) -> str:
    """The prefix of serving's temporary shim folders, naming their owner: `quantgate-vllm-<pid>-`."""
    return f"{SHIM_PREFIX}{os.getpid() if pid is None else pid}-"


def reclaim_stale(runs_dir: Path, tmp_root: Path | None = None, *, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the staging folders (`runs_dir/.<run id>.tmp`) and shim folders (`tmp_root/quantgate-vllm-<pid>-*`,
    default: the system's temporary folder) of runs whose process is gone; returns what was removed.

    A folder is stale when its owner pid (from its name) is not alive as the process that made it (no such
    process, a zombie, not a Python/`quantize` process, or one started after the folder: a reused pid) and
    it has not changed for `stale_after_s`. Finished runs (`<run id>`, `<run id>-error`) are never touched.
    Limit: pids are those of this machine's pid namespace; a runs folder shared with another machine or
    container would see that one's live runs as dead.
    """
    candidates: list[tuple[Path, int, float | None]] = []
    if runs_dir.is_dir():
        for path in runs_dir.iterdir():
            if match := _STAGING.fullmatch(path.name):
                stamped = timegm(time.strptime(match["stamp"], "%Y%m%dT%H%M%SZ"))
                candidates.append((path, int(match["pid"]), float(stamped)))
    tmp_root = Path(tempfile.gettempdir()) if tmp_root is None else tmp_root
    if tmp_root.is_dir():
        for path in tmp_root.iterdir():
            if match := _SHIM.fullmatch(path.name):
                candidates.append((path, int(match["pid"]), None))
    removed = []
    now = time.time()
    for path, pid, made in candidates:
        try:
            if path.is_symlink() or not path.is_dir():
                continue
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if now - mtime < stale_after_s:
            continue
        held = owner_lock_held(path)
        if held or (held is None and owner_alive(pid, made if made is not None else mtime)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def hold_owner_lock(folder: Path) -> int:
    """Create `folder/OWNER_LOCK` and hold an exclusive lock on it; returns the descriptor (close-on-exec: no child
    keeps it). Closing it, or this process ending in any way, releases the lock."""
    fd = os.open(folder / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def owner_lock_held(folder: Path) -> bool | None:
    """Whether a live process holds `folder`'s owner lock; None when the folder has no lock file (the pid decides)."""
    try:
        fd = os.open(folder / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # a lock file that cannot be opened (a symlink, no permission): never taken for a dead run's
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        return error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)
    return False


def owner_alive(pid: int, made_at: float) -> bool:
    """Whether `pid` is a live Python (`quantize`, a Ray worker) process that was already running at `made_at` (epoch seconds)."""
    stat = _stat_fields(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    if not _is_python(pid):
        return False
    started = _start_time(stat)
    return started is None or started <= made_at + _START_MARGIN_S


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; the command name (field 2) may contain spaces and ')'."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _is_python(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    names = [os.path.basename(arg.decode(errors="replace")) for arg in argv[:2] if arg] + [comm]
    return any(name.startswith(("python", RAY_WORKER_TITLE)) or name == "quantize" for name in names)


def _start_time(stat: list[str]) -> float | None:
    """A process's start, in epoch seconds: boot time + field 22 (clock ticks since boot)."""
    try:
        ticks = int(stat[19])  # field 22; stat[0] is field 3
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.serve.reclaim")
    commands = parser.add_subparsers(dest="command", required=True)
    watchdog = commands.add_parser("watchdog", help="stop a process group once its starter is gone")
    watchdog.add_argument("--parent", type=int, required=True, help="pid of the process to outlive")
    watchdog.add_argument("--pgid", type=int, required=True, help="the process group to stop")
    watchdog.add_argument("--fd", type=int, required=True, help="read end of the starter's pipe")
    watchdog.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds between SIGTERM and SIGKILL")
    stale = commands.add_parser("stale", help="remove staging and shim folders of dead runs")
    stale.add_argument("runs_dir", type=Path)
    stale.add_argument("--tmp-root", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "watchdog":
        watch(args.parent, args.pgid, args.fd, args.grace)
        return 0
    for path in reclaim_stale(args.runs_dir, args.tmp_root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
