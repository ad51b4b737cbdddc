"""Algorithms per module in one llm-compressor run (issue: repair with algorithms as rungs).

A recipe whose groups are round-to-nearest and whose override asks GPTQ for decoder layer 0 compiles to a
QuantizationModifier and a GPTQModifier side by side, each over its own modules; a real oneshot on the tiny random
Llama then leaves layer 1's weights exactly as round-to-nearest makes them (the checkpoint's int4 codes times its
scales equal compressed-tensors' fake quantization of the 16-bit weight) and layer 0's as GPTQ makes them (most
codes differ from round-to-nearest's: GPTQ moves each rounding to compensate the errors of the columns before it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.quantize.compiler import compile_recipe
from pipelines.quantize.layout import layout_from_model_dir
from pipelines.quantize.oneshot import quantize_model
from pipelines.recipe import WeightScheme, load_recipe

torch = pytest.importorskip("torch")

INT4_G32 = "{bits: 4, granularity: group, group_size: 32, symmetric: true}"


def mixed_recipe(folder: Path, calibration: Path) -> Path:
    path = folder / "mixed.yaml"
    path.write_text(
        "name: mixed\nalgorithm: {method: rtn}\n"
        f"calibration: {{dataset: {calibration}, num_samples: 8, max_seq_length: 64, seed: 0}}\n"
        f"groups:\n  attention:\n    weights: {INT4_G32}\n  mlp:\n    weights: {INT4_G32}\n"
        f"overrides:\n  - layers: [0]\n    attention: {{weights: {INT4_G32}, algorithm: gptq}}\n    mlp: {{weights: {INT4_G32}, algorithm: gptq}}\n"
    )
    return path


def test_a_recipe_mixing_algorithms_compiles_to_one_modifier_each_over_its_own_modules(tiny_llama_dir: Path, calibration_set_dir: Path,
                                                                                        tmp_path: Path):
    loaded = load_recipe(str(mixed_recipe(tmp_path, calibration_set_dir / "data.jsonl")))
    assert loaded.recipe.needs_calibration  # GPTQ on some groups reads calibration data
    compiled = compile_recipe(loaded.recipe, layout_from_model_dir(tiny_llama_dir), loaded.path)
    modifiers = compiled.llmcompressor["quant_stage"]["quant_modifiers"]
    assert list(modifiers) == ["QuantizationModifier", "GPTQModifier"]
    gptq_targets = [t for group in modifiers["GPTQModifier"]["config_groups"].values() for t in group["targets"]]
    rtn_targets = [t for group in modifiers["QuantizationModifier"]["config_groups"].values() for t in group["targets"]]
    assert all(r"layers\.(0)\." in t for t in gptq_targets) and not any(r"layers\.(0)\." in t for t in rtn_targets)
    assert modifiers["GPTQModifier"]["actorder"] == "weight"  # the shipped gptq recipe's order, for groups of an RTN recipe
    assert compiled.layers["model.layers.0.mlp.down_proj"] == "w4 group32 sym / a16, gptq"
    assert compiled.layers["model.layers.1.mlp.down_proj"] == "w4 group32 sym / a16"


def dequantized(artifact: Path, module: str) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    tensors = load_file(artifact / "model.safetensors")
    shape = torch.Size(tensors[f"{module}.weight_shape"].tolist())
    codes = unpack_from_int32(tensors[f"{module}.weight_packed"], 4, shape).float()
    scale = tensors[f"{module}.weight_scale"].float()
    return codes * scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)


@pytest.mark.slow
def test_each_module_is_quantized_by_its_own_algorithm_in_one_run(tiny_llama_dir: Path, calibration_set_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file

    from pipelines.repair.fakequant import fake_quantize_weight

    result = quantize_model(str(mixed_recipe(tmp_path, calibration_set_dir / "data.jsonl")), tiny_llama_dir, artifacts_root=tmp_path / "artifacts")
    config = json.loads((result.artifact_dir / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    original = load_file(tiny_llama_dir / "model.safetensors")
    weights = WeightScheme(bits=4, granularity="group", group_size=32)
    for module in ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"):
        rtn = fake_quantize_weight(original[f"{module}.weight"], weights).float()
        stored = dequantized(result.artifact_dir, module)
        same = torch.isclose(stored, rtn, rtol=1e-2, atol=1e-6).float().mean().item()
        if ".layers.1." in module:
            assert same == 1.0, f"{module}: round-to-nearest expected, {same:.3f} of the values agree"
        else:
            assert same < 0.9, f"{module}: GPTQ expected, yet {same:.3f} of the values are round-to-nearest's"
