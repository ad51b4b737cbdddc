"""The planner against reality: vLLM's own KV-cache sizing, and real quantized checkpoints.

On models/demo-llama: the KV-cache lines vLLM logged while the session's w8a8 run served the 16-bit
model and its artifact, and the four shipped recipes' artifacts in the session's artifacts root.
Every family of tests/families.py is checked the same way on the servers of its own gate run
(tests/integration/test_families_e2e.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from families import target_that_serves

from pipelines.paths import DEMO_MODEL_DIR, RECIPES_DIR
from pipelines.planner import GiB, kv_capacity_tokens, load_config, model_shape, predict_weight_bytes, safetensors_bytes
from pipelines.planner.kv import CPU_BLOCK_SIZE
from pipelines.recipe import load_recipe

pytestmark = pytest.mark.integration

_KV_LOG = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens")
_GROUPS_LOG = re.compile(r"kv cache group sizes \(([\d, ]+)\)")  # logged only when there is more than one group


def test_kv_capacity_matches_the_tokens_vllm_logs(w8a8_run) -> None:
    """The w8a8 run served the baseline and the artifact with its serve settings; both logs are kept."""
    assert w8a8_run.code == 0, w8a8_run.describe()
    run_dir = Path(w8a8_run.json["run_dir"])
    serve = json.loads((run_dir / "gate.json").read_text())["inputs"]["serve"]
    for model_dir, log_name in ((DEMO_MODEL_DIR, "baseline-server.log"), (Path(w8a8_run.json["artifact_dir"]), "candidate-server.log")):
        found = _KV_LOG.search((run_dir / log_name).read_text())
        assert found, f"no 'KV cache size' line in {run_dir / log_name}"
        logged_tokens = int(found.group(1).replace(",", ""))
        max_model_len = int(found.group(2).replace(",", ""))
        assert max_model_len == serve["max_model_len"]
        planned = kv_capacity_tokens(  # the KV cache in the dtype served: float32 on hosts without native bfloat16
            model_dir, serve["cpu_kv_cache_gib"] * GiB, block_size=CPU_BLOCK_SIZE, max_model_len=max_model_len, served_dtype=serve["dtype"],
        )
        assert abs(planned - logged_tokens) <= 0.01 * logged_tokens, (log_name, planned, logged_tokens)


def _shipped_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("recipe_name", _shipped_recipes())
def test_predicted_weight_bytes_match_the_quantized_files(workspace, recipe_name: str) -> None:
    from pipelines.quantize.oneshot import quantize_model

    # The session's artifacts root: an artifact another test (or run) already made is reused, not redone. Quantized for
    # a host class that serves every shipped recipe (the bytes do not depend on where it is served).
    # Block FP8 and FP8 weight-only have no kernel in vLLM's CPU build: quantized for a Hopper GPU's rules (llm-compressor runs here).
    artifact = quantize_model(recipe_name, DEMO_MODEL_DIR, artifacts_root=workspace.artifacts, target=target_that_serves(recipe_name)).artifact_dir

    recipe = load_recipe(recipe_name).recipe
    predicted = predict_weight_bytes(model_shape(*load_config(DEMO_MODEL_DIR)), recipe).total_bytes
    measured = safetensors_bytes(artifact)
    assert abs(predicted - measured) <= 0.02 * measured, (recipe_name, predicted, measured)
