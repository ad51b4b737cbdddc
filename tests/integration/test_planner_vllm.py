"""The planner against reality: vLLM's own KV-cache sizing, and real quantized checkpoints.

Uses models/demo-llama when it exists, else a small random Llama (hidden 256, 4 layers, 4 heads,
2 KV heads, head_dim 64, bf16) with a word-level tokenizer written to a temporary folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pipelines.paths import DEMO_MODEL_DIR, RECIPES_DIR
from pipelines.planner import GiB, kv_capacity_tokens, load_config, model_shape, predict_weight_bytes, safetensors_bytes
from pipelines.recipe import load_recipe

pytestmark = pytest.mark.integration

CPU_BLOCK_SIZE = 128  # vLLM's CPU default (vllm/platforms/cpu.py) when --block-size is not given
KV_SPACE_GIB = 1
_KV_LOG = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens")


def _tiny_llama(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>",
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return DEMO_MODEL_DIR
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_kv_capacity_matches_the_tokens_vllm_logs(demo_model: Path, tmp_path: Path) -> None:
    from pipelines.serving import ServeSettings, vllm_server

    longest = model_shape(*load_config(demo_model)).max_position or 500
    # 500 is not a multiple of the block size: vLLM then counts whole blocks per request.
    settings = ServeSettings(cpu_kv_cache_gib=KV_SPACE_GIB, max_model_len=min(500, longest))
    log_path = tmp_path / "vllm.log"
    with vllm_server(demo_model, log_path=log_path, settings=settings):
        pass
    found = _KV_LOG.search(log_path.read_text())
    assert found, f"no 'KV cache size' line in {log_path}"
    logged_tokens = int(found.group(1).replace(",", ""))
    max_model_len = int(found.group(2).replace(",", ""))
    assert max_model_len == settings.max_model_len

    planned = kv_capacity_tokens(
        demo_model, KV_SPACE_GIB * GiB, block_size=CPU_BLOCK_SIZE, max_model_len=max_model_len,
    )
    assert abs(planned - logged_tokens) <= 0.01 * logged_tokens, (planned, logged_tokens)


def _shipped_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("recipe_name", _shipped_recipes())
def test_predicted_weight_bytes_match_the_quantized_files(demo_model: Path, recipe_name: str, tmp_path: Path) -> None:
    from pipelines.quantize import quantize_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    artifact = quantize_model(recipe_name, demo_model, artifacts_root=tmp_path / "artifacts").artifact_dir

    recipe, _, _ = load_recipe(recipe_name)
    predicted = predict_weight_bytes(model_shape(*load_config(demo_model)), recipe).total_bytes
    measured = safetensors_bytes(artifact)
    assert abs(predicted - measured) <= 0.02 * measured, (recipe_name, predicted, measured)
