"""A window no server could have produced is never judged (docs/watch.md): a failed canary probe after it is recorded,
but breaches nothing, so it cannot carry a run of breaching windows into a rollback."""

from __future__ import annotations

import pytest
from fake_openai import FakeOpenAI, ToyModel
from test_canary import free_port, golden_of

from pipelines.watch import session
from pipelines.watch.figures import window_figures
from pipelines.watch.report import WindowReport
from pipelines.watch.series import WindowData


@pytest.mark.parametrize("invalid", [[], ["gauge kv_cache_usage is negative"]])
def test_a_failed_canary_breaches_a_valid_window_only(invalid: list[str]) -> None:
    with FakeOpenAI(ToyModel()) as server:
        golden = golden_of(server, count=2)
    window = WindowReport(index=1, start=0.0, end=1.0, figures=window_figures(WindowData(index=1, start=0.0, end=1.0)), invalid=invalid)
    settings = session.WatchSettings(url=f"http://127.0.0.1:{free_port()}/metrics", window_s=1, windows=1, sample_every_s=1,
                                     timeout_s=1, canary_timeout_s=2)
    judged = session._with_canary(window, golden, settings, "demo")
    assert judged.canary is not None and not judged.canary.healthy  # nothing listens: the probe fails for real
    assert judged.breached == ([] if invalid else [session.CANARY])
