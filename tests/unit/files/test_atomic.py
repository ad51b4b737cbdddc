"""Staging folders beside their final name: a writer that died mid-write leaves one, and the next writer of the same
name on this host removes it; a live writer's, or another host's, is never touched."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from pipelines.files.atomic import atomic_dir, hidden_sibling, remove_orphaned_siblings, write_text_atomic


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_dead_writers_staging_folder_is_removed_by_the_next_writer(tmp_path: Path) -> None:
    final = tmp_path / "w8a8-ray-1e016a73093a"
    orphan = tmp_path / f".{final.name}.tmp-{socket.gethostname()}-{_dead_pid()}-abcd1234"
    (orphan / "weights").mkdir(parents=True)
    with atomic_dir(final) as staging:
        (staging / "done").write_text("ok")
    assert not orphan.exists() and (final / "done").read_text() == "ok"
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_a_live_writers_and_another_hosts_folders_are_kept(tmp_path: Path) -> None:
    final = tmp_path / "model"
    live = hidden_sibling(final)  # this process: alive
    other_host = tmp_path / f".{final.name}.tmp-another-host-{_dead_pid()}-abcd1234"
    other_host.mkdir()
    unrelated = tmp_path / f".{final.name}-2.tmp-{socket.gethostname()}-{_dead_pid()}-abcd1234"
    unrelated.mkdir()
    assert remove_orphaned_siblings(final) == []
    assert live.is_dir() and other_host.is_dir() and unrelated.is_dir()
    assert live.name.startswith(f".{final.name}.tmp-{socket.gethostname()}-")


def test_a_file_holding_keys_is_written_0600_and_a_link_at_its_path_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("theirs\n")
    target = tmp_path / "nginx.conf"
    target.symlink_to(outside)
    write_text_atomic(target, "secret\n", mode=0o600)
    assert outside.read_text() == "theirs\n" and not target.is_symlink()
    assert target.read_text() == "secret\n" and (target.stat().st_mode & 0o777) == 0o600
