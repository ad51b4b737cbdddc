"""pipelines.artifact: the one reader of config.json, safetensors headers and manifest.json."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
from fakes import make_artifact

from pipelines.artifact import (
    check_model_dir,
    manifest_recipe,
    read_config_json,
    read_model_config,
    require_model_dir,
    safetensors_header,
    tensor_bytes,
    verify_artifact,
)
from pipelines.errors import InputError


def safetensors(path: Path, tensors: dict[str, int], *, extra: bytes = b"") -> Path:
    """A safetensors file whose tensors hold `tensors[name]` bytes each (zeros), plus `extra` bytes."""
    header, offset = {}, 0
    for name, nbytes in tensors.items():
        header[name] = {"dtype": "I8", "shape": [nbytes], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * offset + extra)
    return path


def test_config_json_is_read_strictly_by_every_reader(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"model_type": "llama"}).encode())  # a byte-order mark is fine
    assert read_config_json(path) == {"model_type": "llama"} == read_model_config(tmp_path)
    path.write_text('{"model_type": "llama", "hidden_size": NaN}')
    with pytest.raises(InputError, match="NaN is not a number JSON allows") as caught:
        read_model_config(tmp_path)  # the compiler's and quantize's reader refuses what the planner's refuses
    assert caught.value.file == str(path)
    path.write_text('{"hidden_size": 8}')
    assert read_config_json(path) == {"hidden_size": 8}  # `plan --config` takes any config
    with pytest.raises(InputError, match="model_type"):
        read_model_config(tmp_path)  # a model folder's must name its type


def test_a_model_folder_is_one_with_a_config_json(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a model folder") as caught:
        require_model_dir(tmp_path, "--baseline")
    assert (caught.value.file, caught.value.field) == (str(tmp_path), "--baseline")
    (tmp_path / "config.json").write_text("{}")
    require_model_dir(tmp_path, "--baseline")


@pytest.mark.parametrize(("extra", "cut", "words"), [
    (b"", 0, None), (b"\0", 0, "truncated or padded"), (b"", 3, "truncated or padded"),
], ids=["whole", "padded", "truncated"])
def test_a_safetensors_file_must_hold_what_its_header_promises(tmp_path: Path, extra: bytes, cut: int, words: str | None) -> None:
    path = safetensors(tmp_path / "model.safetensors", {"a": 6, "b": 10}, extra=extra)
    if cut:
        path.write_bytes(path.read_bytes()[:-cut])
    if words is None:
        assert set(safetensors_header(path)) == {"a", "b"} and tensor_bytes(tmp_path) == 16
        return
    with pytest.raises(InputError, match=words):
        safetensors_header(path)
    with pytest.raises(InputError, match=words):
        tensor_bytes(tmp_path)  # weight bytes are only counted from a file that holds them


def test_check_model_dir_names_a_broken_shard(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(InputError, match=r"no \*.safetensors"):
        check_model_dir(tmp_path)
    good = safetensors(tmp_path / "model-1.safetensors", {"a": 4})
    (tmp_path / "model-2.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(InputError, match="not a readable safetensors header") as caught:
        check_model_dir(tmp_path)
    assert caught.value.file == str(tmp_path / "model-2.safetensors")
    (tmp_path / "model-2.safetensors").unlink()
    assert check_model_dir(tmp_path) == [good]


def test_the_manifest_recipe_is_read_alone_and_the_check_carries_the_recipe_text(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "a")
    manifest = artifact / "manifest.json"
    assert manifest_recipe(artifact) is None and verify_artifact(artifact).recipe_text is None
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "recipe": "w8a8", "recipe_text": "name: w8a8\n"}))
    assert manifest_recipe(artifact) == "w8a8" and verify_artifact(artifact).recipe_text == "name: w8a8\n"
    manifest.write_text(json.dumps({"recipe": "w8a8"}))  # no file map: the name still reads, verification refuses
    assert manifest_recipe(artifact) == "w8a8"
    with pytest.raises(InputError, match="artifact_files"):
        verify_artifact(artifact)
    manifest.write_text(json.dumps({"recipe": 3}))
    with pytest.raises(InputError, match="must be a string") as caught:
        manifest_recipe(artifact)
    assert (caught.value.file, caught.value.field) == (str(manifest), "recipe")


# --- verify_artifact: the files against manifest.json -------------------------------------------------


def test_verify_artifact_accepts_an_intact_artifact(tmp_path: Path) -> None:
    folder = make_artifact(tmp_path / "a")
    check = verify_artifact(folder)
    listed = {"model.safetensors", "config.json", "sub/tokenizer.json"}
    assert set(check.files) == listed and sorted(check.hashed) == sorted(listed)  # every file hashed: no fingerprint given
    assert check.files["model.safetensors"] == hashlib.sha256(b"weights").hexdigest()
    assert check.manifest_sha256 == hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    assert set(check.fingerprint) == listed | {"manifest.json"}
    assert verify_artifact(folder, fingerprint=check.fingerprint).hashed == []  # unchanged files are not read again


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda a: (a / "model.safetensors").write_bytes(b"tampered"), "model.safetensors"),
        (lambda a: (a / "sub" / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda a: (a / "extra.bin").write_bytes(b"x"), "extra.bin"),
        (lambda a: (a / "manifest.json").unlink(), "manifest.json"),
        (lambda a: (a / "manifest.json").write_text('{"other": 1}'), "manifest.json"),
    ],
    ids=["changed", "missing", "added", "no-manifest", "manifest-without-files"],
)
def test_verify_artifact_names_the_bad_file(tmp_path: Path, damage, named: str) -> None:
    artifact = make_artifact(tmp_path / "a")
    damage(artifact)
    with pytest.raises(InputError, match=named):
        verify_artifact(artifact)
