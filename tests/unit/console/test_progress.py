"""The product's progress on the terminal (Bar, track); library output's capture is in test_capture.py."""

from __future__ import annotations

import sys
import threading

import pytest

from pipelines.console import output, progress
from pipelines.console.progress import Bar, duration, track


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_durations_read_like_a_person_writes_them() -> None:
    assert [duration(s) for s in (0.04, 4.25, 40, 89.6, 185, 3600, 3720)] == [
        "0.0 s", "4.2 s", "40 s", "90 s", "3 min 5 s", "1 h", "1 h 2 min",
    ]


def test_a_plain_line_has_the_count_the_time_spent_and_the_time_left() -> None:
    clock = Clock()
    bar = Bar("quantize", 30, "layer", clock=clock)
    clock.now += 10
    bar.advance(2)
    clock.now += 30
    bar.advance(10)
    assert bar.line() == "quantize: layer 12/30, 40 s elapsed, ~54 s left"
    clock.now += 60
    bar.advance(18)
    assert bar.final_line() == "quantize: 30 layers in 1 min 40 s"


def test_time_left_comes_from_the_pace_after_the_first_unit_not_from_the_warm_up() -> None:
    clock = Clock()
    bar = Bar("scoring", 100, "request", clock=clock)
    clock.now += 300  # a server starting: no request done yet
    bar.advance(1)
    assert bar.time_left_s() is None and bar.line() == "scoring: request 1/100, 5 min elapsed"
    clock.now += 9
    bar.update(completed=10)
    assert bar.time_left_s() == pytest.approx(90.0)


def test_a_stage_of_unknown_size_shows_what_is_done_and_the_time() -> None:
    clock = Clock()
    bar = Bar("starting vLLM (baseline)", None, "s", clock=clock)
    clock.now += 12
    assert bar.line() == "starting vLLM (baseline): 12 s elapsed"
    assert bar.final_line() == "starting vLLM (baseline): done in 12 s"
    requests = Bar("scoring baseline", None, "request", clock=clock)
    requests.advance(7)
    assert requests.line().startswith("scoring baseline: 7 requests, ")


def test_a_stage_that_fails_says_where_it_stopped() -> None:
    clock = Clock()
    bar = Bar("quantize", 30, "layer", clock=clock)
    bar.advance(12)
    clock.now += 40
    assert bar.final_line(failed=True) == "quantize: stopped at layer 12/30 after 40 s"


def test_counts_stay_within_the_total_and_can_be_set_outright() -> None:
    bar = Bar("scoring", 10, "request")
    bar.advance(25)
    assert bar.completed == 10
    bar.update(completed=4, total=20)
    assert (bar.completed, bar.total) == (4, 20)


def test_plain_lines_come_at_most_once_per_interval() -> None:
    clock, lines = Clock(), []
    bar = Bar("quantize", 100, "layer", clock=clock, interval_s=10, emit=lines.append)
    for _ in range(100):
        clock.now += 1
        bar.advance()
    assert len(lines) == 10
    assert lines[0] == "quantize: layer 10/100, 10 s elapsed, ~1 min 30 s left"


def test_advancing_from_many_threads_loses_nothing() -> None:
    bar = Bar("scoring", None, "request")
    workers = [threading.Thread(target=lambda: [bar.advance() for _ in range(1000)]) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert bar.completed == 8000


def test_track_prints_the_final_line_however_the_block_ends(capsys: pytest.CaptureFixture) -> None:
    with track("quantize", total=3, unit="layer") as bar:
        for _ in range(3):
            bar.advance()
    with pytest.raises(RuntimeError), track("serve", total=None, unit="s"):
        raise RuntimeError("boom")
    err = capsys.readouterr().err
    assert "> quantize: 3 layers in " in err and "> serve: stopped after " in err


def test_track_on_a_plain_log_speaks_every_interval_even_while_nothing_counts(monkeypatch, capsys) -> None:
    import time

    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.2)
    with track("starting vLLM (baseline)", total=None, unit="s"):
        time.sleep(0.75)
    lines = [line for line in capsys.readouterr().err.splitlines() if "starting vLLM" in line]
    assert 2 <= len(lines) <= 5 and lines[-1].startswith("> starting vLLM (baseline): done in ")


def test_a_live_display_leaves_sys_stdout_and_stderr_alone(monkeypatch) -> None:
    import io

    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr(output, "progress_console", Console(file=screen, force_terminal=True, width=120, highlight=False))
    monkeypatch.delenv("CI", raising=False)
    before = (sys.stdout, sys.stderr)
    with track("quantize", total=2, unit="layer") as bar:
        assert (sys.stdout, sys.stderr) == before  # library output is not re-routed through the display
        bar.advance(2)
    assert "quantize: 2 layers in " in screen.getvalue()
