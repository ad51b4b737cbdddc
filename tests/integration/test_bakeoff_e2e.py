"""The bake-off on the real stack: the gptq intent through llm-compressor, GPTQModel (its own environment, for real)
and bitsandbytes on the demo model, one set; each row gated and load-tested like a `quantize` run, or refused with its
reason (docs/backends.md). In the demo-model work unit, after the session's first run: the baseline's scores (and the
noise floor's second pass) on its one set are cached. (In the own-models unit, scoring its own baseline, it pushed that
unit's real-model server start into the watch test's load: a starved start-up, 7 December.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import HOST, CommandRun, Workspace

from pipelines.artifact import read_manifest
from pipelines.hardware.host import host_profile

# vLLM's CPU build serves GPTQ checkpoints in 16-bit only (its float32 classes refuse them: measured with the probe) and
# 4-bit weight-only kernels only where the host has them (not on cpu:avx2).
GPTQ_SERVED = HOST.kind == "cpu" and host_profile().serve_dtype == "bfloat16"
INT4_SERVED = HOST.isa != "avx2"


@pytest.fixture(scope="module")
def bakeoff_run(workspace: Workspace, w8a8_run: CommandRun, smallest_set: str) -> CommandRun:
    return workspace.quantize("bakeoff", "--recipes", "gptq", "--backends", "llm-compressor,gptqmodel,bitsandbytes",
                              "--eval-sets", smallest_set, "--json")


def rows(run: CommandRun) -> dict[str, dict]:
    return {row["backend"]["name"]: row for row in run.json["rows"]}


def test_bitsandbytes_is_refused_with_vllms_own_reason(bakeoff_run: CommandRun) -> None:
    row = rows(bakeoff_run)["bitsandbytes"]
    assert row["status"] == "refused", row
    assert "vLLM cannot serve here" in row["reason"] and "Unknown quantization method: bitsandbytes" in row["reason"], row["reason"]
    assert row["artifact_dir"] is None and row["run_dir"] is None


def test_gptqmodel_quantizes_in_its_own_environment_and_is_gated_and_load_tested(bakeoff_run: CommandRun) -> None:
    row = rows(bakeoff_run)["gptqmodel"]
    if not GPTQ_SERVED:
        assert row["status"] == "refused" and "vLLM cannot serve here" in row["reason"], row
        return
    assert row["status"] in ("passed", "rejected"), row
    if row["status"] == "rejected":
        pytest.fail(f"GPTQModel's 4-bit GPTQ of the demo model was rejected: {row['reasons']}")
    assert row["recipe_name"] == "gptq-gptqmodel" and row["backend"] == {"name": "gptqmodel", "version": "7.7.0", "format": "gptq"}
    manifest = read_manifest(Path(row["artifact_dir"]))
    assert manifest is not None and manifest.backend is not None and manifest.backend.versions["torch"] == "2.14.1"
    assert manifest.backend.config is not None and manifest.backend.config["bits"] == 4
    config = json.loads((Path(row["artifact_dir"]) / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["bits"] == 4
    assert 0 < row["bytes_ratio"] < 0.6 and row["quantize_s"] > 0 and row["peak_memory_bytes"] > 0
    assert row["sets"] and all(item["tolerance"] is not None for item in row["sets"])
    speed = row["speed"]
    assert speed["throughput_ratio"] is not None and speed["outcome"] != "not measured", speed
    gate = json.loads((Path(row["run_dir"]) / "gate.json").read_text())
    kernels = gate["inputs"]["runtime"]["kernels"]
    assert any("gptq" in label and "CPUWNA16" in words for label, words in kernels.items()), kernels


def test_llm_compressor_runs_the_same_intent_beside_it(bakeoff_run: CommandRun) -> None:
    row = rows(bakeoff_run)["llm-compressor"]
    if not INT4_SERVED:
        assert row["status"] == "refused", row
        return
    assert row["status"] in ("passed", "rejected") and row["recipe_name"] == "gptq", row
    assert row["backend"]["format"] == "compressed-tensors"
    assert (row["speed"]["outcome"] != "not measured") == (row["status"] == "passed"), row  # a rejected row is not load-tested


def test_the_bakeoff_writes_its_table_plot_and_verdict(bakeoff_run: CommandRun) -> None:
    data = bakeoff_run.json
    assert bakeoff_run.code == data["exit_code"] and data["exit_code"] in (0, 1, 2)
    folder = Path(data["folder"])
    assert (folder / "bakeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (folder / "bakeoff.md").read_text()
    assert all(name in table for name in ("llm-compressor", "gptqmodel", "bitsandbytes"))
    assert json.loads((folder / "bakeoff.json").read_text())["rows"] == data["rows"]
    passing = [row for row in data["rows"] if row["status"] == "passed"]
    if passing:
        smallest = min(passing, key=lambda row: row["weight_bytes"])
        assert data["smallest_passing"] and f"{smallest['recipe']} on {smallest['backend']['name']}" in data["smallest_passing"]
