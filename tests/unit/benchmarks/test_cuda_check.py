"""The CUDA check (pipelines/benchmarks/cuda_check.py) on whatever host runs the tests: on a CPU host it has no GEMMs
to time and runs the quantize step and the sensitivity pass on the CPU, with the same document and tables.

It runs as a user runs it, in a process of its own: in the test's process its models would raise the worker's peak
memory (which other tests read) and llm-compressor's logging would stay bound to this test's captured stderr."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from pipelines.benchmarks import cuda_check


@pytest.mark.slow
def test_the_check_quantizes_compares_and_measures_sensitivity_on_this_host(tmp_path):
    command = [sys.executable, "-m", "pipelines.benchmarks.cuda_check", "--recipes", "fp8,w4a16", "--out", str(tmp_path)]
    environment = {**os.environ, "QUANTGATE_ARTIFACTS": str(tmp_path / "artifacts")}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert finished.returncode == 0, finished.stderr[-3000:]

    document = json.loads((tmp_path / "cuda_check.json").read_text())
    host = document["host"]
    assert host["host_class"].startswith(("cpu:", "cuda:")) and host["serve_dtype"] in ("bfloat16", "float16", "float32")
    assert document["gemm"] == [] or all("bf16" in row["ms"] for row in document["gemm"])
    (section,) = document["models"]
    rows = {row["recipe"]: row for row in section["recipes"]}
    for name in ("fp8", "w4a16"):
        assert rows[name]["status"] == "quantized", rows[name]
        versus = rows[name]["versus_16_bit"]
        assert math.isfinite(versus["kl_mean"]) and 0.0 <= versus["kl_mean"] < 0.5
        assert 0.9 <= versus["top1_agreement"] <= 1.0
    assert rows["w4a16"]["weight_bytes"]["after"] < rows["fp8"]["weight_bytes"]["after"]
    sensitivity = section["sensitivity"]
    assert sensitivity["units"] > 0 and sensitivity["prompts"] > 0 and sensitivity["total_s"] > 0
    assert sensitivity["reference_source"] in ("baseline cache", "16-bit greedy paths")
    assert "| fp8 | quantized" in finished.stdout


def test_a_refused_recipe_is_a_row_with_its_reason():
    document = {"host": {"host_class": "cpu:avx2"}, "gemm": [], "models": [{
        "model": "m", "sensitivity": {"error": "ServeError: no"},
        "recipes": [{"recipe": "fp8-block", "status": "refused", "reason": "no kernel on cpu:avx2"}],
    }]}
    text = cuda_check.render(document)
    assert "| fp8-block | refused: no kernel on cpu:avx2 |" in text and "sensitivity pass: ServeError: no" in text


@pytest.mark.parametrize("argv", [["--shaped-width", "abc"], ["--shaped-width", "1,2"], ["--shaped-layers", "-1"],
                                  ["--shaped-layers", "9" * 50]])
def test_bad_arguments_exit_2_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        cuda_check.main(argv)
    assert stopped.value.code == 2 and "error: argument" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["/nonexistent/../model", "README.md", "<b>x</b>"])
def test_a_model_folder_that_is_not_one_is_one_line_and_exit_2(model, tmp_path, capsys):
    assert cuda_check.main(["--model", model, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cuda_check: ") and "\n" not in err and "model" in err
    assert not (tmp_path / "cuda_check.json").exists()
