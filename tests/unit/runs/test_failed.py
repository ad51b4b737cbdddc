"""A failed run keeps the logs its error line names; failed runs are pruned by age and size, never the newest."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipelines.errors import ServeError
from pipelines.runs import failed
from pipelines.runs.runfolder import run_folder
from pipelines.serve.reclaim import OWNER_LOCK, owner_lock_held

DAY = 86_400.0


def test_the_error_line_names_the_log_where_the_failed_run_kept_it(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with pytest.raises(ServeError) as raised, run_folder(runs, "w8a8") as folder:
        log = folder.path / "candidate-server.log"
        log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
        raise ServeError(f"vLLM server died: RuntimeError: boom (log: {log})", file=log)
    (kept,) = runs.iterdir()
    assert kept.name == f"{folder.run_id}-error"
    assert str(kept / "candidate-server.log") in str(raised.value) and str(folder.path) not in str(raised.value)
    assert raised.value.file == str(kept / "candidate-server.log")
    assert (kept / "candidate-server.log").read_text().endswith("RuntimeError: boom\n")
    assert "ServeError" in (kept / "error.txt").read_text() and not (kept / OWNER_LOCK).exists()


def test_a_run_holds_its_staging_folders_lock_until_it_ends(tmp_path: Path) -> None:
    with run_folder(tmp_path / "runs", "w8a8") as folder:
        assert owner_lock_held(folder.path) is True
    assert folder.final.is_dir() and not (folder.final / OWNER_LOCK).exists()


def failed_run(runs: Path, name: str, *, age_days: float, size: int = 10) -> Path:
    path = runs / f"20261201T000000Z-{name}-1-abcdef-error"
    path.mkdir(parents=True)
    (path / "error.txt").write_text("x")
    (path / "server.log").write_bytes(b"l" * size)
    when = time.time() - age_days * DAY
    os.utime(path, (when, when))
    return path


def test_old_failed_runs_go_and_the_newest_always_stays(tmp_path: Path) -> None:
    old, recent, newest = failed_run(tmp_path, "a", age_days=20), failed_run(tmp_path, "b", age_days=1), failed_run(tmp_path, "c", age_days=30)
    limits = failed.FailedRunLimits(max_age_days=14, max_mib=1)
    assert failed.prune_failed_runs(tmp_path, keep=newest, limits=limits) == [old]
    assert recent.exists() and newest.exists()


def test_failed_runs_over_the_size_limit_go_oldest_first(tmp_path: Path) -> None:
    mib = 1024 * 1024 - 1  # with error.txt, 1 MiB a run
    oldest, older = failed_run(tmp_path, "a", age_days=3, size=mib), failed_run(tmp_path, "b", age_days=2, size=mib)
    newest = failed_run(tmp_path, "c", age_days=0, size=mib)
    limits = failed.FailedRunLimits(max_age_days=14, max_mib=2)
    assert failed.prune_failed_runs(tmp_path, keep=newest, limits=limits) == [oldest]
    assert older.exists() and newest.exists()
    # a newest run larger than the whole limit stays, alone
    assert failed.prune_failed_runs(tmp_path, keep=newest, limits=failed.FailedRunLimits(max_mib=0)) == [older]
    assert newest.exists()


def test_only_folders_the_product_wrote_are_pruned(tmp_path: Path) -> None:
    newest = failed_run(tmp_path, "c", age_days=0)
    users = tmp_path / "20261201T000000Z-mine-1-abcdef-error"  # a run id's shape, but no error.txt: not ours
    users.mkdir()
    os.utime(users, (0, 0))
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "error.txt").write_text("keep")
    link = tmp_path / "20261201T000000Z-link-1-abcdef-error"
    link.symlink_to(outside)
    finished = tmp_path / "20261201T000000Z-w8a8-1-abcdef"
    finished.mkdir()
    os.utime(finished, (0, 0))
    assert failed.prune_failed_runs(tmp_path, keep=newest, limits=failed.FailedRunLimits(max_age_days=0, max_mib=0)) == []
    assert users.exists() and (outside / "error.txt").read_text() == "keep" and finished.exists()


def test_the_limits_are_settings_with_names(monkeypatch) -> None:
    monkeypatch.setenv("QUANTGATE_FAILED_RUNS_MAX_AGE_DAYS", "3")
    monkeypatch.setenv("QUANTGATE_FAILED_RUNS_MAX_MIB", "50")
    assert failed.FailedRunLimits() == failed.FailedRunLimits(max_age_days=3, max_mib=50)
