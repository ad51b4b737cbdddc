"""The test clusters' PostgreSQL binaries are found on a fresh machine, whatever major version Debian installed."""

from __future__ import annotations

from pathlib import Path

import pytest
from postgres_cluster import find_pg_bin


def _install(root: Path, version: str) -> Path:
    bin_folder = root / version / "bin"
    bin_folder.mkdir(parents=True)
    (bin_folder / "initdb").write_text("")
    return bin_folder


def test_the_newest_installed_major_version_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUANTGATE_PG_BIN", raising=False)
    _install(tmp_path, "9")
    newest = _install(tmp_path, "17")
    assert find_pg_bin(tmp_path) == newest


def test_the_environment_names_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, "17")
    monkeypatch.setenv("QUANTGATE_PG_BIN", "/opt/pg/bin")
    assert find_pg_bin(tmp_path) == Path("/opt/pg/bin")
