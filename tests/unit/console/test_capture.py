"""Where library output goes (library_output_to_log, library_log, --verbose): real file descriptors, so a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.console import capture

SCRIPT = """
import os, sys
from pathlib import Path
from pipelines.console import capture
from pipelines.console.output import progress as say

verbose = sys.argv[2] == "verbose"
with capture.library_output_to_log(verbose=verbose) as log:
    print("library stdout")
    sys.stderr.write("library stderr\\n")
    os.write(1, b"C fd 1\\n")
    os.write(2, b"C fd 2\\n")
    say("product line 1")
    with capture.library_log(Path(sys.argv[1]) / "run" / "library.log"):
        print("run library stdout")
        say("product line 2")
    print("library stdout again")
print("RESULT")
print("log:", log, file=sys.stderr)
"""


def run_script(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "QUANTGATE_ARTIFACTS": str(tmp_path / "artifacts")}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode], capture_output=True, text=True, timeout=60, env=env)


def test_library_output_goes_to_the_log_and_the_product_s_lines_to_the_terminal(tmp_path: Path) -> None:
    result = run_script(tmp_path, "quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "RESULT\n"
    err = result.stderr.splitlines()
    log = Path(err[-1].removeprefix("log: "))
    assert log.parent == tmp_path / "artifacts" / "logs" and log.name.startswith("library-")
    assert err[0] == f"> library output (llm-compressor, transformers, lm-eval, torch) goes to {log}; --verbose shows it here"
    assert err[1:3] == ["> product line 1", "> product line 2"]
    session = log.read_text()
    assert all(text in session for text in ("library stdout\n", "library stderr\n", "C fd 1\n", "C fd 2\n", "library stdout again\n"))
    assert "run library stdout" not in session
    assert (tmp_path / "run" / "library.log").read_text() == "run library stdout\n"


def test_verbose_leaves_library_output_on_stderr_and_stdout_clean(tmp_path: Path) -> None:
    result = run_script(tmp_path, "verbose")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "RESULT\n"
    for text in ("library stdout", "library stderr", "C fd 1", "C fd 2", "run library stdout", "> product line 1"):
        assert text in result.stderr
    assert "goes to" not in result.stderr and result.stderr.splitlines()[-1] == "log: None"
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "run").exists()


def test_a_block_that_logs_nothing_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    with capture.library_output_to_log(verbose=False) as log:
        assert log.is_file()
        with capture.library_log(tmp_path / "run" / "library.log"):
            assert (tmp_path / "run" / "library.log").is_file()
        assert not (tmp_path / "run" / "library.log").exists()
    assert not log.exists() and not (tmp_path / "artifacts").exists()


def test_the_verbose_option_is_taken_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import argparse

    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    parser = argparse.ArgumentParser()
    capture.add_verbose_option(parser)
    assert parser.parse_args(["--verbose"]).verbose is True
    with capture.library_output_to_log() as log:
        assert log is None and not capture.capturing()
    with capture.library_output_to_log() as log:
        assert log is not None and capture.capturing()
    assert parser.parse_args([]).verbose is False
