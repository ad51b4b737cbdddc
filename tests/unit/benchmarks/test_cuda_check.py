"""The CUDA check (pipelines/benchmarks/cuda_check.py) on whatever host runs the tests: on a CPU host it has no GEMMs
to time and runs the quantize step and the sensitivity pass on the CPU, with the same document and tables."""

from __future__ import annotations

import json
import math

import pytest

from pipelines.benchmarks import cuda_check


@pytest.mark.slow
def test_the_check_quantizes_compares_and_measures_sensitivity_on_this_host(tmp_path, capsys):
    assert cuda_check.main(["--recipes", "fp8,w4a16", "--out", str(tmp_path)]) == 0

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
    assert "| fp8 | quantized" in capsys.readouterr().out


def test_a_refused_recipe_is_a_row_with_its_reason():
    document = {"host": {"host_class": "cpu:avx2"}, "gemm": [], "models": [{
        "model": "m", "sensitivity": {"error": "ServeError: no"},
        "recipes": [{"recipe": "fp8-block", "status": "refused", "reason": "no kernel on cpu:avx2"}],
    }]}
    text = cuda_check.render(document)
    assert "| fp8-block | refused: no kernel on cpu:avx2 |" in text and "sensitivity pass: ServeError: no" in text
