"""A model that produces NaN is a rejected candidate, not a tooling error: end to end through `quantize gate`.

The candidate is the demo model with the embedding row of one token (" Uwe") set to NaN: every prompt holding that
token gets NaN log-probabilities. vLLM 0.32 would answer such a request with HTTP 400 ("Out of range float values are
not JSON compliant") and lm-eval would fail the whole run; the servers' shim sends the literals instead, lm-eval logs
NaN loglikelihoods, and the gate rejects the items that carry them. vLLM's CPU KV cache also carries the NaN into a few
requests that later reuse its blocks, so the test asks for the items that hold the token, not for them alone.
One vLLM server start (the candidate's): the baseline's scores are cached by the session's first run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import CommandRun, Workspace
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from pipelines.evaluation.evalsets import discover_eval_sets
from pipelines.paths import DEMO_MODEL_DIR

EVAL_SET = "ticket_routing"  # multiple choice: lm-eval asks for loglikelihoods, where NaN shows
POISONED = " Uwe"  # a name in a few tickets only


@pytest.fixture(scope="module")
def nan_candidate(workspace: Workspace) -> Path:
    folder = workspace.root / "nan-candidate"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    (token,) = AutoTokenizer.from_pretrained(folder)(POISONED, add_special_tokens=False)["input_ids"]
    for weights in folder.glob("*.safetensors"):
        tensors = load_file(weights)
        tensors["model.embed_tokens.weight"][token] = float("nan")
        save_file(tensors, weights, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def nan_run(workspace: Workspace, w8a8_run: CommandRun, nan_candidate: Path) -> CommandRun:
    # After w8a8_run: its baseline scores of EVAL_SET are cached, so only the candidate is served.
    return workspace.quantize(
        "gate", "--artifact", str(nan_candidate), "--baseline", str(DEMO_MODEL_DIR), "--eval-sets", EVAL_SET, "--json",
        "--allow-unverified",
    )


def poisoned_docs() -> list[int]:
    (eval_set,) = [s for s in discover_eval_sets() if s.name == EVAL_SET]
    lines = eval_set.data.read_text().splitlines()
    return [doc for doc, line in enumerate(lines) if POISONED.strip() in json.loads(line)["ticket"]]


def test_nan_logits_reject_the_candidate_naming_the_items(nan_run: CommandRun, no_process_left) -> None:
    assert nan_run.code == 1, nan_run.describe()
    outcome = nan_run.json
    report = json.loads(Path(outcome["gate_json"]).read_text())["gate"]
    (verdict,) = report["sets"]
    assert outcome["verdict"] == report["verdict"] == "rejected" and not verdict["passed"]
    assert outcome["reasons"] == report["reasons"] == verdict["reasons"][: len(report["reasons"])]
    reason = verdict["reasons"][0]
    prefix = f"{EVAL_SET}: the candidate's acc is not finite (NaN or infinite) on "
    assert reason.startswith(prefix), reason
    broken, total = (int(word) for word in reason.removeprefix(prefix).split(" items")[0].split(" of "))
    docs = poisoned_docs()
    assert docs and docs[0] == 0 and total == 250 and len(docs) <= broken <= total, reason
    # Items are named by "doc_id:doc_hash" in set order: the first holds the poisoned token.
    assert reason.split(" items: ")[1].startswith("0:"), reason
    # The figures are the other items', or the baseline's against itself if the KV cache carried NaN into every item.
    assert verdict["n"] == (total - broken or total)
    no_process_left(nan_run)
