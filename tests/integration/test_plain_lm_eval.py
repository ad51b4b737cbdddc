"""Each shipped eval set's folder runs in plain lm-eval, unchanged, from any working directory.

lm-eval 0.4.13 resolves a task's relative `data_files` against the working directory; the sets name
`custom_dataset: !function pipelines.evaluation.evalsets.set_data`, which reads them relative to the YAML's own
folder. These tests run the `lm_eval` command line itself (no vLLM) from an empty temporary folder: the
`dummy` model on each set's folder, then the demo model through transformers (`--model hf`) on five items
of each set (the whole eval_sets/ folder as the include path), which must score as the product's scores
say (100% on all three, models/demo-llama/TRAINING.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.evaluation.evalsets import discover_eval_sets
from pipelines.paths import DEMO_MODEL_DIR, EVAL_SETS_DIR

pytestmark = pytest.mark.integration

SHIPPED = ("ticket_routing", "payment_reference", "date_normalisation")
TIMEOUT_S = 900


def lm_eval(cwd: Path, *arguments: str) -> subprocess.CompletedProcess:
    """`python -m lm_eval run ...` of the project environment, started in `cwd`, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # `pipelines` is importable because it is installed, not because of the cwd
    return subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", *arguments], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )


def results_of(output: Path) -> dict:
    (path,) = output.rglob("results_*.json")
    return json.loads(path.read_text())["results"]


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """An empty working directory with nothing of the repository in it."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


def test_the_shipped_sets_are_what_plain_lm_eval_loads() -> None:
    found = discover_eval_sets(EVAL_SETS_DIR)
    assert set(SHIPPED) <= {s.name for s in found} and not found.broken


@pytest.mark.parametrize("name", SHIPPED)
def test_the_dummy_model_runs_each_set_folder_from_another_folder(elsewhere: Path, tmp_path: Path, name: str) -> None:
    result = lm_eval(
        elsewhere, "--model", "dummy", "--tasks", name, "--include_path", str(EVAL_SETS_DIR / name),
        "--limit", "5", "--output_path", str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert name in results_of(tmp_path / "out")
    assert list(elsewhere.iterdir()) == []  # nothing needed (or written) in the working directory


def test_the_demo_model_scores_five_items_of_each_set_through_transformers(elsewhere: Path, tmp_path: Path) -> None:
    result = lm_eval(
        elsewhere, "--model", "hf", "--model_args", f"pretrained={DEMO_MODEL_DIR},dtype=bfloat16", "--device", "cpu",
        "--tasks", ",".join(SHIPPED), "--include_path", str(EVAL_SETS_DIR), "--limit", "5", "--batch_size", "5",
        "--output_path", str(tmp_path / "out"), "--seed", "0",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    results = results_of(tmp_path / "out")
    assert results["ticket_routing"]["acc,none"] == 1.0
    assert results["payment_reference"]["exact_match,strip"] == 1.0
    assert results["date_normalisation"]["exact_match,strip"] == 1.0
