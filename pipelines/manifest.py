"""Model folders and artifact manifests.

Checks a source model folder before anything loads it (config.json, safetensors headers and lengths),
counts weight bytes from safetensors headers, and reads / writes an artifact's manifest.json.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pipelines.errors import InputError
from pipelines.hashing import file_hashes

MANIFEST_NAME = "manifest.json"
_MAX_HEADER = 100 * 1024 * 1024


# ------------------------------------------------------------------------------ model folders


def read_model_config(model_dir: Path) -> dict[str, Any]:
    if not model_dir.is_dir():
        raise InputError("model folder does not exist", file=model_dir, field="model")
    path = model_dir / "config.json"
    if not path.is_file():
        raise InputError("missing: a model folder needs config.json", file=path, field="model")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"not valid JSON: {error}", file=path, field=f"line {getattr(error, 'lineno', 1)}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError("needs a JSON object with a 'model_type' string", file=path, field="model_type")
    return config


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, after checking that the file holds all the bytes it promises."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise InputError(f"truncated: {size} bytes, not even a header", file=path, field="safetensors")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER, size - 8):
            raise InputError(f"corrupt or truncated: header claims {header_len} bytes, file has {size}", file=path, field="safetensors")
        try:
            header = json.loads(handle.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InputError("corrupt: the header is not JSON", file=path, field="safetensors") from None
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    try:
        data_end = max((info["data_offsets"][1] for info in tensors.values()), default=0)
    except (KeyError, IndexError, TypeError):
        raise InputError("corrupt: a tensor entry has no data_offsets", file=path, field="safetensors") from None
    expected = 8 + header_len + data_end
    if size != expected:
        raise InputError(f"truncated or padded: {size} bytes, the header describes {expected}", file=path, field="safetensors")
    return tensors


def check_model_dir(model_dir: Path) -> list[Path]:
    """Validate a model folder without loading weights; returns its safetensors files."""
    read_model_config(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InputError("not a valid safetensors index (needs weight_map)", file=index, field="weight_map") from None
        for shard in shards:
            if not (model_dir / shard).is_file():
                raise InputError(f"names shard {shard}, which is missing", file=index, field="weight_map")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InputError("no *.safetensors weights in the model folder", file=model_dir, field="weights")
    for path in files:
        safetensors_header(path)
    return files


def tensor_bytes(folder: Path) -> int:
    """Sum of the tensor data bytes of every safetensors file in `folder`."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        for info in safetensors_header(path).values():
            start, end = info["data_offsets"]
            total += end - start
    return total


# ---------------------------------------------------------------------------------- manifests


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalibrationRecord(_Record):
    dataset: str
    sha256: str
    num_samples: int
    seed: int
    max_seq_length: int


class WeightBytes(_Record):
    before: int
    after: int
    ratio: float


class PeakMemory(_Record):
    bytes: int
    note: str = "process peak RSS (resource.getrusage ru_maxrss): covers everything this process did, not only quantization"


class Manifest(_Record):
    schema_version: int = 1
    recipe: str
    model_name: str
    source_model: str
    input_key: str
    recipe_file: str
    recipe_text: str
    compiled_recipe: str
    calibration: CalibrationRecord | None
    versions: dict[str, str]
    source_files: dict[str, str]
    artifact_files: dict[str, str]
    layers: dict[str, str]
    weight_bytes: WeightBytes
    wall_time_s: float
    peak_memory: PeakMemory
    stages: dict[str, float]
    # GPTQ and SmoothQuant sum in a thread-count-dependent order: the same inputs give the same bits on
    # the same device and thread count, and may differ in the last bit elsewhere.
    compute: str = ""


def artifact_file_hashes(artifact_dir: Path) -> dict[str, str]:
    return file_hashes(artifact_dir, exclude=(MANIFEST_NAME,))


def read_manifest(artifact_dir: Path) -> Manifest | None:
    """The manifest of an artifact folder, or None when it is missing, unreadable or invalid."""
    path = artifact_dir / MANIFEST_NAME
    try:
        return Manifest.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None


def verified_manifest(artifact_dir: Path, input_key: str) -> Manifest | None:
    """The manifest, if it belongs to `input_key` and every artifact file still has its recorded hash."""
    manifest = read_manifest(artifact_dir)
    if manifest is None or manifest.input_key != input_key:
        return None
    if artifact_file_hashes(artifact_dir) != manifest.artifact_files:
        return None
    return manifest
