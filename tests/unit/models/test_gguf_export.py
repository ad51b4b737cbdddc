"""The HF -> GGUF writer without llama.cpp: the demo model written and read back with gguf's own reader, the rotary
permutation, the tokenizer's llama.cpp names and types, and the folders it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipelines.errors import InputError
from pipelines.models import gguf_export
from pipelines.models.gguf import inspect_gguf

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo-llama"


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "demo-f16.gguf"
    gguf_export.export_gguf(DEMO, out)
    return out


def _fields(path: Path) -> tuple[dict, dict]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}, {t.name: t for t in reader.tensors}


def test_the_demo_model_is_written_as_a_llama_gguf_the_header_check_accepts(demo_gguf: Path) -> None:
    header = inspect_gguf(demo_gguf)
    assert (header.architecture, header.block_count, header.tokenizer_model) == ("llama", 4, "gpt2")
    assert header.tensor_types == ["F16", "F32"]  # 2-D weights F16, norms F32
    fields, tensors = _fields(demo_gguf)
    config = json.loads((DEMO / "config.json").read_text())
    assert fields["llama.embedding_length"] == config["hidden_size"]
    assert fields["llama.attention.head_count_kv"] == config["num_key_value_heads"]
    assert fields["llama.rope.freq_base"] == config["rope_parameters"]["rope_theta"]
    assert fields["tokenizer.ggml.pre"] == "smollm"  # single digits, then the GPT-2 regex
    assert fields["tokenizer.ggml.add_bos_token"] is False  # the demo tokenizer adds no BOS
    assert len(fields["tokenizer.ggml.tokens"]) == config["vocab_size"]
    assert fields["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 1]  # <pad> <s> </s> are control tokens
    assert "output.weight" in tensors  # the demo model does not tie its embeddings


def test_q_and_k_rows_are_permuted_to_llama_cpps_rotary_order(demo_gguf: Path) -> None:
    import torch
    from safetensors.torch import load_file as load_torch

    weights = load_torch(str(DEMO / "model.safetensors"))
    _, tensors = _fields(demo_gguf)
    q = weights["model.layers.0.self_attn.q_proj.weight"].to(torch.float32).numpy()
    k = weights["model.layers.0.self_attn.k_proj.weight"].to(torch.float32).numpy()
    written_q = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32).reshape(q.shape)
    written_k = np.asarray(tensors["blk.0.attn_k.weight"].data, dtype=np.float32).reshape(k.shape)
    np.testing.assert_allclose(written_q, gguf_export.permute_rotary(q, 4), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(written_k, gguf_export.permute_rotary(k, 2), rtol=1e-3, atol=1e-4)
    assert not np.allclose(written_q, q, rtol=1e-3, atol=1e-4)


def test_the_permutation_interleaves_each_heads_two_halves() -> None:
    rows = np.arange(8, dtype=np.float32).reshape(8, 1)  # two heads of head_dim 4: halves (0 1 | 2 3), (4 5 | 6 7)
    assert gguf_export.permute_rotary(rows, 2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize(
    ("pre_tokenizer", "expected"),
    [
        ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt-2"),
        ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                {"type": "ByteLevel", "use_regex": True}]}, "smollm"),
    ],
)
def test_pre_tokenizers_get_llama_cpps_name_for_the_same_regexes(pre_tokenizer: dict, expected: str) -> None:
    assert gguf_export.pre_tokenizer_type({"pre_tokenizer": pre_tokenizer}, Path("tokenizer.json")) == expected


@pytest.mark.parametrize(
    "pre_tokenizer",
    [
        {"type": "Metaspace"},
        {"type": "ByteLevel", "use_regex": False},
        {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False}, {"type": "ByteLevel", "use_regex": True}]},
        None,
    ],
)
def test_a_pre_tokenizer_llama_cpp_has_no_name_for_is_refused(pre_tokenizer: dict | None) -> None:
    with pytest.raises(InputError, match="no llama.cpp equivalent"):
        gguf_export.pre_tokenizer_type({"pre_tokenizer": pre_tokenizer}, Path("tokenizer.json"))


def test_the_vocabulary_fills_gaps_and_types_added_tokens() -> None:
    tokenizer = {"model": {"type": "BPE", "vocab": {"a": 2, "b": 3}},
                 "added_tokens": [{"id": 0, "content": "<s>", "special": True}, {"id": 4, "content": "<tool>", "special": False}]}
    tokens, types = gguf_export.vocabulary(tokenizer, 6, Path("tokenizer.json"))
    assert tokens == ["<s>", "[PAD1]", "a", "b", "<tool>", "[PAD5]"]
    assert types == [3, 5, 1, 1, 4, 5]


@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        ({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}}, "Unigram"),
        ({"model": {"type": "BPE", "vocab": {"a": 9}}}, "outside the model's vocabulary"),
    ],
)
def test_a_vocabulary_that_cannot_be_written_is_refused(tokenizer: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        gguf_export.vocabulary(tokenizer, 4, Path("tokenizer.json"))


@pytest.mark.parametrize(
    ("single", "expected"),
    [
        ([{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}], (True, False)),
        ([{"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "</s>"}}], (False, True)),
        ([{"Sequence": {"id": "A"}}], (False, False)),
    ],
)
def test_bos_and_eos_come_from_the_post_processors_template(single: list, expected: tuple[bool, bool]) -> None:
    assert gguf_export.template_adds({"post_processor": {"type": "TemplateProcessing", "single": single}}) == expected
    assert gguf_export.template_adds({"post_processor": None}) == (False, False)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "architectures"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_parameters"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": "1024"}, "vocab_size"),
    ],
)
def test_a_model_this_writer_cannot_write_faithfully_is_refused_with_one_line(tmp_path: Path, change: dict, field: str) -> None:
    folder = tmp_path / "model"
    shutil.copytree(DEMO, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(InputError) as caught:
        gguf_export.export_gguf(folder, tmp_path / "out.gguf")
    assert caught.value.field == field and "\n" not in str(caught.value)
    assert not (tmp_path / "out.gguf").exists()


def test_a_folder_without_config_or_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="config.json"):
        gguf_export.export_gguf(tmp_path, tmp_path / "out.gguf")
    folder = tmp_path / "model"
    shutil.copytree(DEMO, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(InputError, match="safetensors"):
        gguf_export.export_gguf(folder, tmp_path / "out.gguf")
