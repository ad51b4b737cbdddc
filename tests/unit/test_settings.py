"""pipelines.settings: the QUANTGATE_* environment is read when a path is needed, not when a module is imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines import paths, settings
from pipelines.console.capture import library_logs_dir
from pipelines.gate.policy import load_gate_policy
from pipelines.jobs.job import default_jobs_dir, load_job
from pipelines.registry.store import default_registry_path
from pipelines.runs import runner


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ROOT", "ARTIFACTS", "REGISTRY", "SERVE_VENV"):
        monkeypatch.delenv(f"QUANTGATE_{name}", raising=False)


def test_the_defaults_are_the_checkout_s_folders() -> None:
    current = settings.current()
    assert current.root == Path(settings.__file__).resolve().parent.parent
    root = current.root
    assert (current.artifacts_dir, current.registry_path) == (root / "artifacts", root / "artifacts" / "registry.db")
    assert (current.serve_python, current.baseline_cache_dir) == (root / ".venv-serve" / "bin" / "python", root / "artifacts" / "cache" / "baseline")


def test_every_artifacts_path_follows_the_environment_set_after_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path))
    assert tmp_path == paths.ARTIFACTS_DIR
    assert runner.default_runs_dir() == tmp_path / "runs" and default_jobs_dir() == tmp_path / "jobs"
    assert library_logs_dir() == tmp_path / "logs" and default_registry_path() == tmp_path / "registry.db"
    policy, policy_path = load_gate_policy(None)
    assert runner.GateSettings(eval_sets=[], policy=policy, policy_path=policy_path).cache_dir == tmp_path / "cache" / "baseline"


def test_the_registry_variable_wins_over_the_artifacts_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("QUANTGATE_REGISTRY", str(tmp_path / "elsewhere.db"))
    assert default_registry_path() == tmp_path / "elsewhere.db"


def test_a_job_file_without_a_registry_uses_quantgate_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: nightly\ncandidates:\n  - model: m\n    recipes: [w8a8]\n")
    monkeypatch.setenv("QUANTGATE_REGISTRY", str(tmp_path / "ci.db"))
    assert load_job(path).registry == tmp_path / "ci.db"


def test_an_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", "")
    assert settings.current().artifacts_dir == settings.current().root / "artifacts"


def test_the_root_moves_the_input_folders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTGATE_ROOT", str(tmp_path))
    folders = (paths.RECIPES_DIR, paths.EVAL_SETS_DIR, paths.DEMO_MODEL_DIR, paths.SERVE_PYTHON)
    assert folders == (tmp_path / "recipes", tmp_path / "eval_sets", tmp_path / "models" / "demo-llama", tmp_path / ".venv-serve" / "bin" / "python")
    with pytest.raises(AttributeError):
        paths.NOT_A_FOLDER  # noqa: B018
