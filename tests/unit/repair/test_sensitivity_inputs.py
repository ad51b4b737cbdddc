"""The sensitivity pass's inputs on a machine without a serve environment (the GPU machine of docs/hardware.md has no vLLM)."""

from __future__ import annotations

from pipelines.evaluation.evalsets import discover_eval_sets
from pipelines.repair import sensitivity
from pipelines.serve.serving import ServeSettings


def test_without_a_serve_environment_no_baseline_is_cached_and_nothing_is_asked_of_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path / "no-serve-env"))
    sets = discover_eval_sets()[:2]
    assert sets, "the shipped eval sets"
    # the cache's keys name the serve environment's versions: asking them would fail here (a ServeError before this change)
    assert sensitivity.cached_baselines(tmp_path, sets, ServeSettings(), tmp_path / "cache") == {}
