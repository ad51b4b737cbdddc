"""`quantize watch --version` probes the version's golden set after each window: the promoted weights agree (exit 0), a
server answering with other weights under the same name breaches the window (exit 1) and the report names the prompts.
The version is promoted through the real runner with its load test (faked tool, tests/unit/loadtest), so the golden set is
fixed on the pool's candidate server, as in production."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, ToyModel
from metrics_pages import State, live
from test_loadtest_runner import gate, servers, tool  # noqa: F401 (fixtures)

from pipelines.canary.build import build_golden, draw, write_golden
from pipelines.canary.client import API_KEY_ENV
from pipelines.cli import main
from pipelines.registry.store import Registry
from pipelines.runs import runner

MODEL = "demo-llama"
pytestmark = pytest.mark.slow  # whole gate runs and watch windows (several seconds each)
FAST = ["--window", "1s", "--sample-every", "0.25s"]
KEY = "canary-test-key"


def busy(state: State, reads: int) -> None:
    state.serve(4, ttft=0.03, itl=0.02)
    state.running, state.kv_usage = 4.0, 0.2


@pytest.fixture
def promoted_with_golden(tool, servers, workspace, monkeypatch: pytest.MonkeyPatch) -> int:
    def golden(serve, sources, path: Path) -> None:
        with serve(), FakeOpenAI(ToyModel(noise=0.01), served=MODEL) as fake:
            write_golden(build_golden(fake.base_url, model=MODEL, api_key=None, drawn=draw(sources, 8, 0), seed=0, timeout_s=10), path)

    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, golden=golden))
    assert gate(workspace).verdict == "promoted"
    assert servers.started.count("candidate") == 1, "the golden set was fixed on the server the gate had up"
    version = Registry(workspace.registry).list(MODEL)[-1].version
    Registry(workspace.registry).set_alias(MODEL, "production", version)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    return version


def watched(workspace, tmp_path: Path, model: ToyModel, capsys) -> tuple[int, dict, str]:
    with FakeOpenAI(model, api_key=KEY, served=MODEL, get=live(State(), busy)) as server:
        code = main(["watch", "--url", f"{server.base_url}/metrics", "--version", f"{MODEL}@production", *FAST, "--windows", "2",
                     "--registry", str(workspace.registry), "--out", str(tmp_path / "w"), "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def test_the_promoted_weights_pass_the_canary_every_window(promoted_with_golden, workspace, tmp_path, capsys) -> None:
    code, document, err = watched(workspace, tmp_path, ToyModel(noise=0.01), capsys)
    assert code == 0, document["windows"]
    assert document["canary"]["prompts"] == 8 and document["canary"]["file"].endswith("evidence/canary.json")
    for window in document["windows"]:
        assert window["canary"]["healthy"] and window["canary"]["answered"] == 8 and "canary" not in window["breached"]
    assert "canary: 8 of 8 golden prompts agree within tolerance" in err


def test_other_weights_under_the_same_name_breach_and_the_report_names_the_prompts(promoted_with_golden, workspace, tmp_path,
                                                                                  capsys) -> None:
    code, document, err = watched(workspace, tmp_path, ToyModel(weights=1, perturb=2.0, noise=0.01), capsys)
    assert code == 1 and document["verdict"] == "breach" and document["breached_windows"] == [1, 2]
    canary = document["windows"][0]["canary"]
    assert not canary["healthy"] and canary["error"] is None and len(canary["disagreeing"]) >= 4
    assert all(w["breached"] == ["canary"] for w in document["windows"]), "the figures themselves are within the envelope"
    assert f"golden prompts disagree beyond tolerance: {', '.join(canary['disagreeing'])}" in err


def test_a_canary_the_server_refuses_breaches_with_the_reason(promoted_with_golden, workspace, tmp_path, capsys,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "not-the-key")
    code, document, _ = watched(workspace, tmp_path, ToyModel(noise=0.01), capsys)
    assert code == 1 and "HTTP 401" in document["windows"][0]["canary"]["error"]


def test_a_version_promoted_before_canaries_is_watched_without_one(tool, servers, workspace, tmp_path, capsys) -> None:
    assert gate(workspace).verdict == "promoted"  # the unit stack fixes no golden set (tests/fakes.py)
    Registry(workspace.registry).set_alias(MODEL, "production", Registry(workspace.registry).list(MODEL)[-1].version)
    code, document, err = watched(workspace, tmp_path, ToyModel(weights=1, perturb=2.0), capsys)
    assert code == 0 and document["canary"] is None and all(w["canary"] is None for w in document["windows"])
    assert "its bundle holds no golden set (promoted before canaries): no canary probe" in err
