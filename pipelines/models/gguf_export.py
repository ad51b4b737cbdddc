"""A Llama-family model folder (HF format) written as a 16-bit GGUF in llama.cpp's own layout.

    export_gguf(model_dir, out)   config.json + safetensors + tokenizer.json -> an F16 GGUF at `out`

What llama.cpp's converter (convert_hf_to_gguf.py, not on the package index) does for a Llama, with the `gguf`
package's own tables: tensor names from gguf.get_tensor_name_map, q/k rows permuted from HF's rotate-half order
to llama.cpp's interleaved rotary order, 2-D weights in float16 and norms in float32, the hyper-parameters under
`llama.*`, and the byte-level BPE tokenizer as `gpt2` with its merges (gguf.SpecialVocab) and the llama.cpp
pre-tokenizer whose regexes are the tokenizer.json's (PRE_TOKENIZER_TYPES). A folder this cannot write faithfully
(another architecture, rope scaling, another tokenizer) is refused with one line. Whether the file computes the
model's function is checked by pipelines.models.gguf_build against the folder itself, through llama.cpp.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipelines.errors import InputError

LLAMA_ARCHITECTURES = ("LlamaForCausalLM",)
# tokenizer.json pre-tokenizers -> llama.cpp's `tokenizer.ggml.pre` with the same regexes (src/llama-vocab.cpp):
# ByteLevel with the GPT-2 regex is `gpt-2`; single digits split first, then the GPT-2 regex, is `smollm`
# (llama.cpp's STARCODER/REFACT/SMOLLM case: "\p{N}", then the GPT-2 regex).
_BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}
_DIGITS = {"type": "Digits", "individual_digits": True}
PRE_TOKENIZER_TYPES: tuple[tuple[tuple[dict, ...], str], ...] = (
    ((_BYTE_LEVEL,), "gpt-2"),
    ((_DIGITS, _BYTE_LEVEL), "smollm"),
)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5  # gguf.TokenType


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError("missing (a model folder needs config.json and tokenizer.json)", file=path) from None
    except (OSError, ValueError) as error:
        raise InputError(f"not readable JSON ({error})", file=path) from None
    if not isinstance(value, dict):
        raise InputError("not a JSON object", file=path)
    return value


def llama_config(model_dir: Path) -> dict:
    """The model's config.json, refused unless it is a Llama this converter writes faithfully."""
    path = model_dir / "config.json"
    config = _read_json(path)
    architectures = config.get("architectures") or []
    if config.get("model_type") != "llama" or not set(architectures) <= set(LLAMA_ARCHITECTURES) or not architectures:
        raise InputError(f"architecture {architectures or config.get('model_type')!r} is not converted to GGUF "
                         f"(supported: {', '.join(LLAMA_ARCHITECTURES)})", file=path, field="architectures")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise InputError(f"rope scaling {rope.get('rope_type')!r} is not converted to GGUF", file=path, field="rope_parameters")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise InputError("biases in attention or MLP are not converted to GGUF", file=path, field="attention_bias")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"{key} must be a positive integer, not {value!r}", file=path, field=key)
    return config


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def pre_tokenizer_type(tokenizer: dict, path: Path) -> str:
    """llama.cpp's name for the tokenizer.json's pre-tokenizer, or an InputError: llama.cpp picks its regexes by
    this name, so a pre-tokenizer it has no name for would tokenize differently."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for pattern, name in PRE_TOKENIZER_TYPES:
        if len(steps) == len(pattern) and all(all(step.get(k) == v for k, v in want.items()) for step, want in zip(steps, pattern, strict=True)):
            return name
    kinds = "+".join(str(step.get("type")) for step in steps)
    raise InputError(f"pre-tokenizer {kinds} has no llama.cpp equivalent here (known: byte-level BPE with the GPT-2 regex, "
                     "optionally after single-digit splitting)", file=path, field="pre_tokenizer")


def vocabulary(tokenizer: dict, vocab_size: int, path: Path) -> tuple[list[str], list[int]]:
    """The token strings by id (gaps filled as llama.cpp's converter does) and their llama.cpp token types."""
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise InputError(f"tokenizer model {model.get('type')!r} is not converted to GGUF (byte-level BPE only)", file=path, field="model")
    by_id: dict[int, str] = {index: token for token, index in model["vocab"].items()}
    added = {entry["id"]: entry for entry in tokenizer.get("added_tokens", [])}
    by_id.update({index: entry["content"] for index, entry in added.items()})
    if max(by_id) >= vocab_size:
        raise InputError(f"token id {max(by_id)} is outside the model's vocabulary of {vocab_size}", file=path, field="model.vocab")
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(TOKEN_UNUSED)
            continue
        tokens.append(by_id[index])
        entry = added.get(index)
        types.append(TOKEN_NORMAL if entry is None else TOKEN_CONTROL if entry.get("special") else TOKEN_USER_DEFINED)
    return tokens, types


def permute_rotary(weight: Any, heads: int) -> Any:
    """q/k rows from HF's rotate-half order to llama.cpp's interleaved pairs (convert_hf_to_gguf.py's permute)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _safetensors(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InputError("no *.safetensors weights (other weight formats are not converted)", file=model_dir)
    return files


def _tensors(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of the folder as a float32 numpy array (bfloat16 has no numpy type)."""
    import torch  # heavy: imported when used
    from safetensors import safe_open  # heavy: imported when used

    for file in _safetensors(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                yield name, handle.get_tensor(name).to(torch.float32).numpy()


def _gguf_tensors(config: dict, model_dir: Path) -> Iterator[tuple[str, Any]]:
    """(llama.cpp name, array in the dtype written) for every tensor the model needs."""
    import gguf  # heavy: imported when used
    import numpy as np  # heavy: imported when used

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    tied = bool(config.get("tie_word_embeddings"))
    for name, array in _tensors(model_dir):
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # recomputed by llama.cpp / the embedding's copy
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise InputError(f"tensor {name} has no llama.cpp name", file=model_dir)
        if name.endswith("self_attn.q_proj.weight"):
            array = permute_rotary(array, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = permute_rotary(array, kv_heads)
        yield target, array.astype(np.float16 if array.ndim > 1 else np.float32)


def _write_hparams(writer: Any, config: dict, name: str) -> None:
    import gguf  # heavy: imported when used

    writer.add_name(name)
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _write_tokenizer(writer: Any, model_dir: Path, vocab_size: int) -> None:
    import gguf  # heavy: imported when used

    path = model_dir / "tokenizer.json"
    tokenizer = _read_json(path)
    pre = pre_tokenizer_type(tokenizer, path)
    tokens, types = vocabulary(tokenizer, vocab_size, path)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer)
    # llama.cpp's defaults differ by pre-tokenizer: say whether BOS/EOS are added whenever SpecialVocab did not
    bos, eos = template_adds(tokenizer)
    if "bos" not in special.add_special_token:
        writer.add_add_bos_token(bos)
    if "eos" not in special.add_special_token:
        writer.add_add_eos_token(eos)


def template_adds(tokenizer: dict) -> tuple[bool, bool]:
    """Whether the tokenizer.json's post-processor puts a special token before (BOS) and after (EOS) a single text."""
    post = tokenizer.get("post_processor") or {}
    steps = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    single = next((step.get("single") for step in steps if step.get("type") == "TemplateProcessing"), None) or []
    return bool(single) and "SpecialToken" in single[0], bool(single) and "SpecialToken" in single[-1]


def export_gguf(model_dir: Path, out: Path) -> None:
    """Write `model_dir` (a Llama in HF format) to `out` as an F16 GGUF (into a staging folder: a failure leaves a
    partial file, pipelines.models.gguf_build's atomic_dir removes it)."""
    import gguf  # heavy: imported when used

    config = llama_config(model_dir)
    writer = gguf.GGUFWriter(str(out), "llama")
    _write_hparams(writer, config, model_dir.name)
    _write_tokenizer(writer, model_dir, config["vocab_size"])
    for name, array in _gguf_tensors(config, model_dir):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
