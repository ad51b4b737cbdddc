"""A reload signals only the nginx this supervisor started and that still runs: a reaped pid may be another process's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pipelines.fleet import proxy
from pipelines.fleet.proxy import NginxProcess


def test_an_nginx_that_died_is_not_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    nginx = NginxProcess(Path("/usr/sbin/nginx"), layout=None)  # type: ignore[arg-type]
    died = subprocess.Popen(["true"])
    died.wait()  # reaped: the kernel may hand its pid to any new process
    nginx.running = (died, None)  # type: ignore[assignment]
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(proxy.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    assert nginx.reload() is False
    assert sent == []


def test_a_running_nginx_is_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    nginx = NginxProcess(Path("/usr/sbin/nginx"), layout=None)  # type: ignore[arg-type]
    running = subprocess.Popen(["sleep", "30"])
    try:
        nginx.running = (running, None)  # type: ignore[assignment]
        sent: list[tuple[int, int]] = []
        monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
        assert nginx.reload() is True
        assert [pid for pid, _ in sent] == [running.pid]
    finally:
        monkeypatch.undo()
        running.kill()
        running.wait()
