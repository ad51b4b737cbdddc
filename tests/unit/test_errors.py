"""Every error line the product prints is bounded: a hostile value cannot flood the terminal."""

from __future__ import annotations

import pytest

from pipelines import cli
from pipelines.errors import MAX_LINE_CHARS, MAX_MESSAGE_CHARS, InputError


def test_an_error_naming_a_100_kb_value_is_one_line_cut_with_an_ellipsis() -> None:
    huge = "x" * 100_000
    error = InputError(f"bad value {huge!r}", file="/tmp/" + huge, field=huge)
    line = error.one_line()
    assert "\n" not in line and len(line) <= MAX_LINE_CHARS
    assert error.message.startswith("bad value 'xxx") and " ... " in error.message and len(error.message) == MAX_MESSAGE_CHARS


def test_a_cut_message_keeps_its_cause_and_the_log_it_names() -> None:
    message = f"exited 1; last lines: CUDA out of memory | {'noise ' * 200}| done (log: /artifacts/runs/r/serve.log)"
    shown = InputError(message).one_line()
    assert shown.startswith("exited 1; last lines: CUDA out of memory") and shown.endswith("(log: /artifacts/runs/r/serve.log)")
    assert len(shown) == MAX_MESSAGE_CHARS


@pytest.mark.parametrize("argv", [
    ["--recipe", "r" * 100_000],  # an input error naming the value
    ["no-such-command-" + "c" * 100_000],  # a usage error
    ["watch", "--url", "http://h/" + "\x1b" * 100_000],  # control characters, escaped, still bounded
])
def test_every_error_line_on_stderr_is_bounded(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and len(lines[0]) <= MAX_LINE_CHARS, err[:300]
    assert "\x1b" not in lines[0]


def test_an_internal_error_with_a_100_kb_message_is_one_bounded_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path) -> None:
    monkeypatch.setattr(cli, "log_dirs", lambda: [tmp_path])

    def crash(argv):
        raise RuntimeError("boom " * 20_000)

    monkeypatch.setattr(cli, "build_parser", crash)
    assert cli.main(["doctor"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("quantize: internal error: RuntimeError: boom boom") and len(line) <= MAX_LINE_CHARS
