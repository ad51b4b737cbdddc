"""The vLLM series the product reads and queries are ones the serve environment's vLLM exports."""

from __future__ import annotations

import ast
import re

import pytest

from pipelines.paths import REPO_ROOT
from pipelines.serve.vllm_series import CACHE_INFO, COUNTERS, GAUGES, GROUPED_COUNTERS, HISTOGRAMS, VLLM_PREFIX


def test_every_vllm_series_named_is_one_the_serve_environments_vllm_defines():
    source = next(REPO_ROOT.glob(".venv-serve/lib/python3*/site-packages/vllm/v1/metrics/loggers.py"), None)
    if source is None:
        pytest.skip("no serve environment (.venv-serve): make setup builds it")
    text = source.read_text()
    named = {*COUNTERS.values(), *GAUGES.values(), *HISTOGRAMS.values(), CACHE_INFO, *(name for name, _ in GROUPED_COUNTERS.values())}
    ours = sorted(name for name in named if name.startswith(VLLM_PREFIX))
    # prometheus_client adds `_total` to a counter's name; a histogram's name is as written (vllm:iteration_tokens_total)
    missing = [name for name in ours if f'"{name}"' not in text and f'"{name.removesuffix("_total")}"' not in text]
    assert len(ours) >= 15 and missing == []


def test_no_series_name_is_spelled_out_again_in_code():
    """Every vllm:* series the package writes into a query, a rule or a message comes from vllm_series (docstrings may name them)."""
    spelled = []
    for path in (REPO_ROOT / "pipelines").rglob("*.py"):
        text = path.read_text()
        if path.name == "vllm_series.py" or VLLM_PREFIX not in text:
            continue
        tree = ast.parse(text)
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
        spelled += [f"{path.relative_to(REPO_ROOT)}:{node.lineno}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and re.search(rf"{VLLM_PREFIX}[a-z_]", node.value)]
    assert spelled == []
