"""Every decoder family of tests/families.py on the compile side, and the architectures the product refuses.

Per family: every shipped recipe validates against the tiny model's config on the `cpu` target (what
`quantize recipe validate` runs), or on a Hopper GPU for the formats vLLM's CPU build does not serve (block FP8),
and the planner's predicted weight bytes are the bytes of the checkpoint
llm-compressor writes (16-bit, and quantized with w8a8's and w4a16's schemes through quantize_model).
An architecture the compiler cannot cover is refused at `recipe validate` and at `plan`, exit 2, in one line
that names it and what is missing: never a half-hour quantization that ends in a misleading verdict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from families import FAMILIES, family_config, make_family_model, tokenizer_texts

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.hardware.targets import CPU, parse_target
from pipelines.planner import load_config, model_shape, predict_weight_bytes, safetensors_bytes
from pipelines.quantize.compiler import SIXTEEN_BIT, compile_file
from pipelines.quantize.oneshot import quantize_model
from pipelines.recipe import load_recipe, shipped_recipes


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's config.json alone: validation and planning read no weights."""
    root = tmp_path_factory.mktemp("family-configs")
    return {family: write_config(root / family, family_config(family)) for family in FAMILIES}


# --- every shipped recipe validates on every family ----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_every_shipped_recipe_validates_on_the_cpu_target(family: str, config_dirs: dict[str, Path]) -> None:
    for recipe in shipped_recipes():
        try:
            compiled = compile_file(recipe, config_dirs[family], CPU)  # what `quantize recipe validate` runs
        except InputError as refused:
            assert "vLLM's CPU build has" in str(refused), (recipe, str(refused))  # a format the CPU build lacks, said so
            compiled = compile_file(recipe, config_dirs[family], parse_target("cuda:9.0"))
        decoder = {module: scheme for module, scheme in compiled.layers.items() if ".layers." in module}
        groups = load_recipe(recipe).recipe.groups
        if groups.attention and groups.mlp:  # every decoder Linear quantized (a KV-cache-only recipe leaves them all 16-bit)
            assert decoder and SIXTEEN_BIT not in decoder.values(), (recipe, decoder)
        else:
            assert decoder and set(decoder.values()) == {SIXTEEN_BIT} and compiled.kv_cache.dtype != "auto", (recipe, decoder)
        assert compiled.layers["lm_head"] == SIXTEEN_BIT


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_validate_and_plan_accept_every_family(family: str, config_dirs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    folder = config_dirs[family]
    assert main(["recipe", "validate", "w8a8", "--model", str(folder), "--target", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] is True
    argv = ["plan", "--config", str(folder / "config.json"), "--gpu", "T4", "--max-model-len", "512", "--json"]
    assert main([*argv, "--recipe", *shipped_recipes()]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    # every shipped recipe applies on a T4 (compute capability 7.5) but the W4A8 control, which vLLM serves on CPUs
    # only, and the FP8 recipes with FP8 activations or calibrated FP8 KV scales (FP8 compute needs 8.9)
    refused = {row["scheme"] for row in rows if row["does_not_apply"]}
    assert refused == {"aggressive-w4a8", "fp8", "fp8-block", "fp8-kv"}, rows


def test_phi3_targets_the_fused_modules_its_checkpoint_holds(config_dirs: dict[str, Path]) -> None:
    compiled = compile_file("w4a16", config_dirs["phi3"], CPU)
    groups = compiled.llmcompressor["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["config_groups"]
    assert groups["attention"]["targets"] == [r"re:.*self_attn\.(o|qkv)_proj$"]
    assert groups["mlp"]["targets"] == [r"re:.*mlp\.(down|gate_up)_proj$"]
    assert compiled.layers["model.layers.0.self_attn.qkv_proj"] == "w4 group128 sym / a16"


# --- predicted bytes are the artifact's bytes -------------------------------------------------------------------


def rtn_recipes(folder: Path) -> dict[str, Path]:
    """w8a8's and w4a16's schemes, round-to-nearest: the bytes depend on the schemes, not on how the weights were
    rounded (w8a8's static MLP activation scales still calibrate, on 8 short lines)."""
    calibration = folder / "calibration.jsonl"
    calibration.write_text("".join(json.dumps({"text": text}) + "\n" for text in tokenizer_texts(8)))
    w8a8 = load_recipe("w8a8").recipe.model_dump(mode="json", exclude_none=True)
    rtn = {
        "name": "w8a8-rtn", "algorithm": {"method": "rtn"}, "groups": w8a8["groups"],
        "calibration": {"dataset": str(calibration), "num_samples": 8, "max_seq_length": 32},
    }
    (folder / "w8a8-rtn.yaml").write_text(yaml.safe_dump(rtn))
    return {"w8a8-rtn": folder / "w8a8-rtn.yaml", "w4a16": load_recipe("w4a16").path}


@pytest.mark.integration  # runs llm-compressor twice per family: about 5 s of CPU each, 15-25 s on 2 busy cores
@pytest.mark.parametrize("family", FAMILIES)
def test_predicted_weight_bytes_are_the_artifacts_bytes(family: str, tmp_path: Path) -> None:
    model_dir = make_family_model(family, tmp_path / family)
    shape = model_shape(*load_config(model_dir))
    assert predict_weight_bytes(shape, None).total_bytes == safetensors_bytes(model_dir)
    for name, path in rtn_recipes(tmp_path).items():
        loaded = load_recipe(str(path))
        result = quantize_model(loaded, model_dir, artifacts_root=tmp_path / "artifacts")
        measured = safetensors_bytes(result.artifact_dir)
        assert predict_weight_bytes(shape, loaded.recipe).total_bytes == measured == result.manifest.weight_bytes.after, name


# --- architectures the product cannot handle --------------------------------------------------------------------

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 512}
BAD_ARCHITECTURES: dict[str, tuple[dict[str, Any], str, str]] = {
    # name: (config.json, what `recipe validate` says, what `plan` says)
    "gpt2 (Conv1D c_attn)": (
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128},
        "model_type: GPT2LMHeadModel (gpt2): 8 weight matrices of its decoder layers match no group (transformer.h.0.attn.c_attn (Conv1D)",
        "model_type: GPT2LMHeadModel (gpt2) is not a decoder family the planner can count",
    ),
    "t5 (encoder-decoder)": (
        {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 64, "num_layers": 2, "num_heads": 4,
         "d_kv": 16, "d_ff": 128, "vocab_size": 128, "is_encoder_decoder": True},
        "is_encoder_decoder: T5ForConditionalGeneration (t5) is an encoder-decoder model",
        "is_encoder_decoder: T5ForConditionalGeneration (t5) is an encoder-decoder model",
    ),
    "phi-2 (dense, fc1, fc2)": (
        {"model_type": "phi", "architectures": ["PhiForCausalLM"], **SMALL},
        "model_type: PhiForCausalLM (phi): 6 weight matrices of its decoder layers match no group (model.layers.0.self_attn.dense (Linear)",
        "model_type: PhiForCausalLM (phi) is not a decoder family the planner can count",
    ),
    "mixtral (mixture of experts)": (
        {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2, **SMALL},
        "num_local_experts: MixtralForCausalLM (mixtral) is a mixture-of-experts model (4 experts per layer)",
        "model_type: MixtralForCausalLM (mixtral) is a mixture-of-experts model (4 experts per layer)",
    ),
    "gemma 3 with its vision tower": (
        {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
         "text_config": {"model_type": "gemma3_text", "head_dim": 16, **SMALL}, "vision_config": {"hidden_size": 32}},
        "vision_config: Gemma3ForConditionalGeneration (gemma3) is a multimodal model",
        "model_type: Gemma3ForConditionalGeneration (gemma3) is a multimodal model",
    ),
    "unknown model_type": (
        {"model_type": "frobnicator", **SMALL},
        "model_type: model_type 'frobnicator': transformers",  # ... cannot read this config: Unrecognized model identifier
        "model_type: model_type 'frobnicator' is not a decoder family the planner can count",
    ),
}


@pytest.mark.parametrize("case", BAD_ARCHITECTURES)
def test_an_architecture_the_compiler_cannot_cover_is_refused_in_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config, validate_says, plan_says = BAD_ARCHITECTURES[case]
    folder = write_config(tmp_path / "model", config)
    assert main(["recipe", "validate", "w4a16", "--model", str(folder), "--target", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{folder / 'config.json'}: {validate_says}" in err, err
    assert main(["plan", "--config", str(folder / "config.json"), "--gpu", "T4", "--max-model-len", "512", "--recipe", "w4a16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and plan_says in err, err


def test_a_mixture_of_experts_is_still_planned_at_16_bits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config, _, _ = BAD_ARCHITECTURES["mixtral (mixture of experts)"]
    path = write_config(tmp_path / "model", config) / "config.json"
    assert main(["plan", "--config", str(path), "--gpu", "T4", "--max-model-len", "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["fits"] is True


def test_a_config_transformers_cannot_build_is_refused_at_validate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **SMALL, "rope_scaling": {"rope_type": "no-such-rope"}}
    folder = write_config(tmp_path / "model", config)
    assert main(["recipe", "validate", "w4a16", "--model", str(folder), "--target", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "model_type: LlamaForCausalLM (llama): transformers" in err and "cannot build it as a causal language model" in err
