"""Quantize progress counts decoder layers: layer k is reached when its forward first runs."""

from __future__ import annotations

import pytest

from pipelines.progress import Bar
from pipelines.quantize import counting_layers, decoder_layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_llama(layers: int):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_the_decoder_stack_is_found_by_its_length() -> None:
    model = tiny_llama(3)
    assert decoder_layers(model) == list(model.model.layers)


def test_a_model_without_a_matching_stack_has_no_layers() -> None:
    model = tiny_llama(3)
    model.config.num_hidden_layers = 7
    assert decoder_layers(model) == []


def test_the_count_follows_the_forward_and_the_hooks_are_removed() -> None:
    model = tiny_llama(4)
    layers = decoder_layers(model)
    seen: list[int] = []
    bar = Bar("quantize", 4, "layer", emit=None, on_change=lambda b: seen.append(b.completed))
    with counting_layers(layers, bar), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
        assert bar.completed == 3  # the last layer started: the three before it are done
        model(torch.tensor([[1, 2, 3]]))  # a second pass (propagation, another sample) counts nothing twice
    assert seen == [1, 2, 3]
    assert all(not layer._forward_pre_hooks for layer in layers)
