"""Tiny random-weight models of every decoder family the product supports, built from configs at test time.

Each is a few MiB, built in seconds, with the family's own quirks intact: Qwen2's attention biases, q/k norms
(Qwen3, Gemma 3), a head_dim that is not hidden / heads (Gemma, Qwen3), tied embeddings (Gemma, Qwen2),
sliding-window layers beside full ones (Gemma 2/3, Mistral), fused checkpoint tensors (Phi-3 qkv_proj and
gate_up_proj). Sizes are multiples of 32 so that every shipped recipe (int4 groups included) can serve on vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "bfloat16",
}

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "head_dim": 64, "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "head_dim": 64, "sliding_window": 256,
                "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True,
              "use_sliding_window": False},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 96, "tie_word_embeddings": True},
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "head_dim": 96, "sliding_window": 128,
               "tie_word_embeddings": True, "query_pre_attn_scalar": 96},
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "head_dim": 96, "sliding_window": 128,
               "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
               "tie_word_embeddings": True, "query_pre_attn_scalar": 96},
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "tie_word_embeddings": False},
}
FAMILIES = tuple(FAMILY_CONFIGS)


def tokenizer_texts(count: int = 200) -> list[str]:
    """Deterministic business-like lines the tiny tokenizer is trained on (and calibration may use)."""
    teams = ("billing", "shipping", "returns", "accounts")
    return [f"Ticket {i}: order {(i * 7919) % 100000:05d} goes to {teams[i % 4]}, ref PAY-{(i * 104729) % 9973}." for i in range(count)]


def family_config(family: str) -> dict[str, Any]:
    """config.json of the tiny `family` model (transformers' own keys)."""
    return {**COMMON, **FAMILY_CONFIGS[family]}


def make_family_model(family: str, folder: Path, *, seed: int = 0) -> Path:
    """Write a random-weight `family` model in bf16 and a byte-level BPE tokenizer into `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipelines.demo.tokenizer import train_tokenizer

    config = dict(family_config(family))
    model_type = config.pop("model_type")
    config.pop("architectures")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)).to(torch.bfloat16)
    model.save_pretrained(folder)
    train_tokenizer(tokenizer_texts(), COMMON["vocab_size"]).save_pretrained(folder)
    return folder


def target_that_serves(recipe_name: str):
    """The written `cpu` target (pipelines.hardware.targets.CPU) when its kernel rules serve every quantized group of the
    recipe, else a Hopper GPU's (block FP8 and FP8 weight-only have no kernel in vLLM's CPU build): where a test compiles
    or quantizes every shipped recipe, each for a target that serves it. Asked of the rules, not by recipe name."""
    from pipelines.hardware.targets import CPU, cpu_rules, parse_target
    from pipelines.recipe import load_recipe

    groups = load_recipe(recipe_name).recipe.groups
    schemes = [scheme for scheme in (groups.attention, groups.mlp) if scheme is not None]
    return CPU if all(cpu_rules(scheme, CPU) is None for scheme in schemes) else parse_target("cuda:9.0")
