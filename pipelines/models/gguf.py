"""The GGUF header: what a GGUF file says it holds, read and checked before any tensor is.

    inspect_gguf(path)       the checked header (GgufHeader), or an InputError naming the file
    scan_header(path, keep)  the raw metadata fields and tensor table (the conversion reads the tokenizer's arrays from it)

The header is read with bounded reads through a read-only memory map (`_Scanner`), never by a reader that trusts
its counts: every count and length is checked against the bytes left in the file before anything is read or
allocated, so a hostile header (an array of 2**62 elements, a string longer than the file) is refused in
microseconds with constant memory. Metadata arrays are kept only for the keys asked for; the others are walked
or skipped.

`inspect_gguf` refuses a file that is not a GGUF (magic), a GGUF version other than 2 or 3, counts and lengths
the file's size cannot hold (truncated or corrupt), an architecture outside SUPPORTED_ARCHITECTURES, more
blocks than any model of its family has (MAX_BLOCKS), a missing tensor the architecture must hold or one
transformers' loader would drop silently (names from gguf-py's own tables), a tensor type the gguf package
cannot dequantize, declared sizes that are not the tensors' own shapes, and a tokenizer that cannot be
verified. Nothing is dequantized here; the conversion is pipelines.models.catalog's. (`import gguf` in this
module is the gguf package, gguf-py: its tables name the tensors and types.)
"""

from __future__ import annotations

import mmap
import struct
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from pipelines.errors import InputError
from pipelines.models.tokenizer import PRE_TOKENIZERS

GGUF_MAGIC = b"GGUF"
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


def scan_header(path: Path, keep: frozenset[str] = frozenset()) -> _Scan:
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
    scan = scan_header(path)
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
