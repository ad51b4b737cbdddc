"""Open a page in headless Chromium (Debian's `chromium`, scripts/setup_system.sh installs it): its DOM after load, every
console message it logged, and a screenshot.

    seen = open_page(page_html, tmp_path / "page.png")
    assert seen.console == [] and 'id="verdict"' in seen.dom

One browser process per call, in a session (process group) of its own with a private profile folder; the group is
killed however the call ends (done, timed out, interrupted). Console messages are what Chromium's own logging prints
on stderr with --enable-logging=stderr: `...:INFO:CONSOLE:LINE] "message", source: URL (LINE)`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TIMEOUT_S = 90.0  # one launch takes ~2 s on a quiet 2-core host; far more under the suite's load
_CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\] (.*)$")
# Screenshots are kept for people to look at: under the pytest tmp dir and copied here (git-ignored: artifacts/).
SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "test-screenshots"


@dataclass(frozen=True)
class Seen:
    dom: str
    console: list[str]
    screenshot: Path


def console_messages(stderr: str) -> list[str]:
    return [match.group(1) for line in stderr.splitlines() if (match := _CONSOLE.search(line))]


def open_page(page: Path, screenshot: Path, *, width: int = 1280, height: int = 2000, timeout_s: float = TIMEOUT_S) -> Seen:
    assert CHROMIUM is not None, "chromium is not installed (scripts/setup_system.sh installs it)"
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
                   "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                   "--dump-dom", f"--screenshot={screenshot}", page.resolve().as_uri()]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                   start_new_session=True, env={**os.environ, "HOME": profile})
        try:
            dom, stderr = process.communicate(timeout=timeout_s)
        finally:
            _kill_group(process)
    assert process.returncode == 0, f"chromium exited {process.returncode}: {stderr[-2000:]}"
    return Seen(dom=dom, console=console_messages(stderr), screenshot=screenshot)


def _kill_group(process: subprocess.Popen) -> None:
    """The browser and every helper process it started (renderer, GPU, zygote) are gone when this returns."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()


def keep_screenshot(path: Path, name: str) -> Path:
    """A copy under artifacts/test-screenshots/ (ignored by git), for a person to look at after the run."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    kept = SCREENSHOTS / name
    shutil.copyfile(path, kept)
    return kept
