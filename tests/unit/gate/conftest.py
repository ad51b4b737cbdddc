"""Fixtures of the gate's command-line tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import make_eval_set


@pytest.fixture
def sets_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two eval sets (tickets: 120 items, tiny: 30) as QUANTGATE_EVAL_SETS, and an artifacts root of the test's own."""
    root = tmp_path / "eval_sets"
    make_eval_set(root, "tickets", items=120)
    make_eval_set(root, "tiny", items=30)
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(root))
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    return root
