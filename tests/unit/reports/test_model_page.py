"""A model's page from a real registry (SQLite, versions promoted through the signed door): the newest verdict and the
aliases first, a row and a point per version, the event log; a hostile model name escaped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fakes import make_artifact, make_gate, new_version, promote

from pipelines.registry.store import Registry
from pipelines.reports.model_page import ModelHistory, render_model_page, tolerance_share

HOSTILE = "demo<script>alert(1)</script>"


def registry_with_history(tmp_path: Path, model: str) -> Registry:
    """v1 promoted, v2 rejected by its gate, v3 promoted; `champion` on v1, then v3, then rolled back to v1."""
    registry = Registry(tmp_path / "registry.db")
    created = ["2026-12-01T10:00:00+00:00", "2026-12-02T10:00:00+00:00", "2026-12-03T10:00:00+00:00"]
    verdicts = ["promoted", "rejected", "promoted"]
    versions = []
    for number, (at, verdict) in enumerate(zip(created, verdicts, strict=True), start=1):
        artifact = make_artifact(tmp_path / f"artifact-{number}", weights=f"w{number}".encode())
        version = registry.register(new_version(artifact, make_gate(tmp_path / f"gate-{number}.json", verdict, at), model=model))
        versions.append(promote(registry, version) if verdict == "promoted" else registry.reject(version.id, "gate rejected"))
    registry.set_alias(model, "champion", 1, "first")
    registry.set_alias(model, "champion", 3, "better")
    registry.rollback(model, "champion", "regression in production")
    return registry


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> ModelHistory:
    """Built once for the module: each promotion signs a bundle (seconds under load)."""
    return ModelHistory.read(registry_with_history(tmp_path_factory.mktemp("registry"), "demo-llama"), "demo-llama")


def test_the_newest_verdict_and_aliases_come_first_then_each_version(history: ModelHistory):
    html = render_model_page(history)
    body = html.split("<body>", 1)[1]
    assert body.index('id="verdict"') < body.index("PROMOTED") < body.index("Verdicts over time")
    assert "newest version v3 (w8a8, " in html and "aliases: champion -&gt; v1" in html and "3 versions: 2 promoted, 1 rejected" in html
    rows = re.findall(r'<tr class="(pass|fail)" id="version-\d-(\d)">', html)
    assert rows == [("pass", "1"), ("fail", "2"), ("pass", "3")]
    assert "<td>champion</td><td>v1</td><td>-</td>" in html  # rolled back to v1: nothing under it to roll back to


def test_verdicts_over_time_draw_each_versions_share_of_its_tolerance(history: ModelHistory):
    shares = [tolerance_share(v.gate)[0] for v in history.versions]
    assert shares[0] is not None and shares[1] is not None and shares[0] < 1 < shares[1]  # 1 of 200 lost passes; 40 lost fails
    html = render_model_page(history)
    chart = html.split("Verdicts over time", 1)[1].split("</svg>", 1)[0]
    assert chart.count("<circle") == 3 and "v2 w8a8 (rejected)" in chart and 'stroke-dasharray="4,3"' in chart
    assert f"{shares[1]:.0%}" in html
    x_ticks = re.findall(r'<text x="[\d.]+" y="310" text-anchor="middle">([^<]*)</text>', chart)
    assert x_ticks == ["1", "2", "3"]  # version numbers: whole ticks, never 1.5


def test_the_event_log_lists_registrations_promotions_and_alias_moves(history: ModelHistory):
    html = render_model_page(history)
    events = html.split('id="events"', 1)[1]
    for kind in ("registered", "promoted", "rejected", "alias_set", "alias_rollback"):
        assert f"<td>{kind}</td>" in events
    assert "regression in production" in events and "v3 -&gt; v1" in events


def test_a_hostile_model_name_and_reason_are_escaped(tmp_path: Path):
    """The registry registers any model name (promotion refuses one that cannot name a folder); reasons are free text."""
    registry = Registry(tmp_path / "registry.db")
    version = registry.register(new_version(make_artifact(tmp_path / "a"), make_gate(tmp_path / "gate.json", "rejected"), model=HOSTILE))
    registry.reject(version.id, "<img src=x onerror=alert(2)>")
    html = render_model_page(ModelHistory.read(registry, HOSTILE))
    assert "<script" not in html and "<img" not in html
    assert "demo&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&lt;img src=x onerror=alert(2)&gt;" in html
    assert '<div class="verdict fail" id="verdict"><div class="word">REJECTED</div>' in html
