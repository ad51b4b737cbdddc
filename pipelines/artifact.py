"""Model and artifact folders on disk: the one module that reads them.

- config.json: read strictly (bounded, UTF-8, no NaN or Infinity) by every reader (compiler, planner,
  quantize, job); `read_model_config` also wants a folder and a `model_type`.
- Model folders: `is_model_dir` / `require_model_dir` (config.json present), and `check_model_dir`
  (config.json, safetensors headers and lengths) before anything loads weights.
- safetensors headers: parsed here only; `tensor_bytes` counts weight bytes from them, weights unread.
- manifest.json: the `Manifest` quantize writes, read back with its shape checked (`load_manifest`),
  the artifact hash, and `verify_artifact`, used by every consumer (gate, registry, job, MLflow export).

Integrity, and what it costs. manifest.json lists every other file of the artifact with its sha256;
manifest.json itself is identified by its own sha256 (recorded in gate.json inputs, in the registry and
in the job ledger). `verify_artifact` always reads and hashes manifest.json (kilobytes), lists the folder
(a missing or added file is always caught) and stats every file. A file's content is re-hashed unless
the caller passes a fingerprint taken at a previous full verification and the file's (size, mtime_ns,
ctime_ns, inode) still equal it: the cheap path. Any write to a file changes its ctime, which user space
cannot set back, so a tampered file always falls through to the full sha256. Without a fingerprint
(the gate before serving, a first registration) every file is hashed in full.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.errors import InputError
from pipelines.files.hashing import file_hashes, sha256_file, sha256_json
from pipelines.files.jsonio import read_json_object
from pipelines.files.safepath import inside, own_regular_file, safe_relative
from pipelines.schema import StrictModel

CONFIG_NAME = "config.json"
MANIFEST_NAME = "manifest.json"
MANIFEST_FILES_KEY = "artifact_files"
MAX_CONFIG_BYTES = 4 * 1024 * 1024  # a config.json is a few kilobytes
# A manifest lists file hashes and the recipe: kilobytes. Anything this large is not one.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
_HEX = frozenset("0123456789abcdef")


# ------------------------------------------------------------------------------------ JSON


# ---------------------------------------------------------------------------- config.json


def read_config_json(path: Path) -> dict[str, Any]:
    """A config.json (or any file given as one, `plan --config`): a JSON object, strictly parsed."""
    return read_json_object(path, what="config", field="config", max_bytes=MAX_CONFIG_BYTES)[0]


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """The config.json of a model folder; it must name its `model_type`."""
    if not model_dir.is_dir():
        raise InputError("model folder does not exist", file=model_dir, field="model")
    path = model_dir / CONFIG_NAME
    if not path.is_file():
        raise InputError("missing: a model folder needs config.json", file=path, field="model")
    config = read_config_json(path)
    if not isinstance(config.get("model_type"), str):
        raise InputError("needs a JSON object with a 'model_type' string", file=path, field="model_type")
    return config


def served_kv_cache_dtype(model_dir: Path) -> str:
    """vLLM's --kv-cache-dtype for a model folder: its manifest's record when quantize wrote one, else `fp8` when
    its config declares llm-compressor's kv_cache_scheme (vLLM serves such a checkpoint's KV cache in FP8 under
    `auto`), else `auto`."""
    manifest = read_manifest(model_dir) if (model_dir / MANIFEST_NAME).is_file() else None
    if manifest is not None and manifest.kv_cache is not None:
        return manifest.kv_cache.served_as
    try:
        config = read_config_json(model_dir / CONFIG_NAME)
    except InputError:
        return "auto"
    quantization = config.get("quantization_config")
    return "fp8" if isinstance(quantization, dict) and isinstance(quantization.get("kv_cache_scheme"), dict) else "auto"


# ---------------------------------------------------------------------------- model folders


def is_model_dir(folder: Path) -> bool:
    """A folder with a config.json: what may be served or planned (check_model_dir checks more)."""
    return (Path(folder) / CONFIG_NAME).is_file()


def require_model_dir(folder: Path, field: str) -> None:
    if not is_model_dir(folder):
        raise InputError("not a model folder (no config.json)", file=folder, field=field)


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
    files = safetensors_files(model_dir)
    for path in files:
        safetensors_header(path)
    return files


# ------------------------------------------------------------------------------ safetensors


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise InputError("no *.safetensors weights in the folder", file=folder, field="weights")
    return files


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor entries of a safetensors file's JSON header, after checking that the file holds all the
    bytes the header promises (a truncated download or a padded file is refused)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise InputError(f"truncated: {size} bytes, not even a header", file=path, field="safetensors")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_SAFETENSORS_HEADER, size - 8):
                raise InputError(f"not a readable safetensors header: corrupt or truncated, it claims {header_len} bytes,"
                                 f" the file has {size}", file=path, field="safetensors")
            header = json.loads(handle.read(header_len))
        tensors = {name: info for name, info in header.items() if name != "__metadata__"}
        expected = 8 + header_len + max((info["data_offsets"][1] for info in tensors.values()), default=0)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, AttributeError):
        raise InputError("not a readable safetensors header: not a JSON object", file=path, field="safetensors") from None
    except (KeyError, IndexError, TypeError):
        raise InputError("not a readable safetensors header: a tensor entry has no data_offsets", file=path, field="safetensors") from None
    except OSError as error:
        raise InputError(f"cannot read it ({error.strerror or error})", file=path, field="safetensors") from None
    if size != expected:
        raise InputError(f"truncated or padded: {size} bytes, the header describes {expected}", file=path, field="safetensors")
    return tensors


def tensor_bytes(folder: Path) -> int:
    """Exact tensor data bytes of every safetensors file in `folder`, from the headers (weights unread)."""
    total = 0
    for path in safetensors_files(folder):
        for info in safetensors_header(path).values():
            start, end = info["data_offsets"]
            total += end - start
    return total


# ---------------------------------------------------------------------------------- manifests


class CalibrationRecord(StrictModel):
    dataset: str
    sha256: str
    num_samples: int
    seed: int
    max_seq_length: int


class WeightBytes(StrictModel):
    before: int
    after: int
    ratio: float


class SmoothingRecord(StrictModel):
    """The SmoothQuant mappings a quantization used: derived from the model's forward, checked to be an
    identity before calibration (pipelines.quantize.smoothing)."""

    mappings: list[tuple[list[str], str]]  # llm-compressor's [[balance regexes], smooth regex]
    layers: list[str]  # each mapping as the layers it reaches
    skipped: list[str]  # projection groups not smoothed, and why
    max_relative_difference: float  # of the logits, SmoothQuant alone vs none, float32
    tolerance: float
    check_samples: int
    check_s: float


class PeakMemory(StrictModel):
    bytes: int
    note: str = "process peak RSS (resource.getrusage ru_maxrss): covers everything this process did, not only quantization"


class KvCacheRecord(StrictModel):
    """The KV cache precision an artifact is served with: the recipe's `kv_cache` and vLLM's --kv-cache-dtype for it."""

    dtype: str
    scales: str
    served_as: str = "auto"  # vLLM's --kv-cache-dtype (`auto`: the serve dtype, no flag)


class BackendRecord(StrictModel):
    """The backend that made an artifact, as its manifest records it."""

    name: str
    version: str
    checkpoint_format: str
    quant_method: str = Field(description="vLLM's quantization method for the checkpoint")
    versions: dict[str, str] = Field(default={}, description="the backend environment's torch, transformers and backend")
    config: dict[str, Any] | None = Field(default=None, description="what the backend was given (subprocess backends)")
    notes: list[str] = Field(default=[], description="recipe settings the backend applies differently, in words")


class Manifest(StrictModel):
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
    smoothing: SmoothingRecord | None = None  # when the recipe smooths (absent in manifests written before it)
    # The host class the recipe was validated for and the quantizing host (absent in manifests written before them).
    serve_target: str | None = None
    host: dict[str, str | bool] | None = None
    kv_cache: KvCacheRecord | None = None  # absent in manifests written before the KV cache was a recipe field (16-bit)
    # The toolkit that quantized (pipelines.quantize.backends); absent in manifests written before backends: llm-compressor.
    backend: BackendRecord | None = None


def artifact_file_hashes(artifact_dir: Path) -> dict[str, str]:
    return file_hashes(artifact_dir, exclude=(MANIFEST_NAME,))


def read_manifest(artifact_dir: Path) -> Manifest | None:
    """The full manifest `quantize` writes, or None when it is missing, unreadable, too large or invalid."""
    try:
        document = load_manifest(artifact_dir)
        return Manifest.model_validate(document.data)
    except (InputError, ValidationError):
        return None


def verified_manifest(artifact_dir: Path, input_key: str) -> Manifest | None:
    """The manifest, if it belongs to `input_key` and every artifact file still has its recorded hash."""
    manifest = read_manifest(artifact_dir)
    if manifest is None or manifest.input_key != input_key:
        return None
    if artifact_file_hashes(artifact_dir) != manifest.artifact_files:
        return None
    return manifest


# ------------------------------------------------------------------------------ integrity


class ManifestDocument(BaseModel):
    """A manifest.json as read and checked for shape: its JSON, its own sha256 and its file map."""

    model_config = ConfigDict(extra="forbid")

    path: Path
    data: dict[str, Any]
    sha256: str
    files: dict[str, str]

    @property
    def recipe_text(self) -> str | None:
        """The recipe as written, when the manifest records it (quantize's do; others may not)."""
        text = self.data.get("recipe_text")
        return text if isinstance(text, str) else None


class ArtifactCheck(BaseModel):
    """What a successful `verify_artifact` saw: enough to verify the same artifact cheaply next time."""

    model_config = ConfigDict(extra="forbid")

    artifact_dir: Path
    manifest_sha256: str
    # sha256_json of the manifest's {relative path: sha256} map: the registry's artifact hash.
    artifact_hash: str
    # relative path -> [size, mtime_ns, ctime_ns, inode] of every file, manifest.json included.
    fingerprint: dict[str, list[int]]
    # the manifest's {relative path: sha256} map, every file of the folder but manifest.json.
    files: dict[str, str]
    # files whose content was hashed by this check (the others matched the fingerprint given).
    hashed: list[str] = []
    # the verified manifest's recipe text (policy overrides match the recipe's base and tags).
    recipe_text: str | None = None

    @property
    def folder_hash(self) -> str:
        """pipelines.files.hashing.folder_hash of the folder, without reading it again: every file is accounted for."""
        return sha256_json({**self.files, MANIFEST_NAME: self.manifest_sha256})


def _manifest_json(path: Path) -> tuple[dict[str, Any], bytes]:
    """manifest.json's JSON object (at most 16 MiB, strict JSON: no NaN) and its bytes; its `recipe`, if
    present, is a string."""
    data, raw = read_json_object(path, what="manifest", max_bytes=MAX_MANIFEST_BYTES)
    if "recipe" in data and not isinstance(data["recipe"], str):
        raise InputError(f"must be a string (got {type(data['recipe']).__name__})", file=path, field="recipe")
    return data, raw


def manifest_recipe(artifact_dir: Path) -> str | None:
    """The recipe name manifest.json records, if any; only the JSON is checked (verify_artifact checks the rest)."""
    path = Path(artifact_dir) / MANIFEST_NAME
    return _manifest_json(path)[0].get("recipe") if path.exists() else None


def load_manifest(artifact_dir: Path) -> ManifestDocument:
    """manifest.json of `artifact_dir`, checked for shape; any problem is an InputError naming the file.

    Needs a JSON object (_manifest_json) whose `artifact_files` maps relative paths (no '..', not absolute)
    to sha256 hex digests. The full schema `quantize` writes (`Manifest`) is not required: artifacts
    quantized elsewhere carry only what verification needs.
    """
    artifact_dir = Path(artifact_dir)
    path = artifact_dir / MANIFEST_NAME
    if not artifact_dir.is_dir():
        raise InputError("artifact folder does not exist", file=artifact_dir)
    if not path.exists():
        raise InputError("artifact has no manifest; it is incomplete or was not written by `quantize`", file=path)
    data, raw = _manifest_json(path)
    files = data.get(MANIFEST_FILES_KEY)
    if not isinstance(files, dict) or not files:
        raise InputError("missing or empty map of relative path to sha256", file=path, field=MANIFEST_FILES_KEY)
    for relative, digest in files.items():
        safe_relative(relative, f"{MANIFEST_FILES_KEY} key", file=path)
        if relative == MANIFEST_NAME:
            raise InputError("the manifest cannot list itself", file=path, field=MANIFEST_FILES_KEY)
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX):
            raise InputError(f"{relative}: not a sha256 hex digest ({str(digest)[:80]!r})", file=path, field=MANIFEST_FILES_KEY)
    return ManifestDocument(path=path, data=data, sha256=hashlib.sha256(raw).hexdigest(), files=files)


def artifact_hash(artifact_dir: Path) -> str:
    """The artifact's identity: the hash of its manifest's {relative path: sha256} map."""
    return sha256_json(load_manifest(Path(artifact_dir)).files)


def stat_fingerprint(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def verify_artifact(
    artifact_dir: Path, *, manifest_sha256: str | None = None, fingerprint: dict[str, list[int]] | None = None
) -> ArtifactCheck:
    """Check `artifact_dir` against its manifest; InputError naming the first bad file.

    - `manifest_sha256`: the manifest's own hash as recorded earlier; a different manifest.json is refused.
    - `fingerprint`: from an earlier ArtifactCheck; a file whose (size, mtime, ctime, inode) is unchanged
      is not re-hashed, and a file whose size differs from it is refused before anything is hashed (a 30 GiB file
      swapped in costs a stat, not a read). Without it every file is hashed (sha256 of all the bytes).
    Everything that needs no reading comes first: a file listed but missing, present but not listed (manifest.json
    aside), a link (symbolic or hard), a size that differs; then the hashes, each read bounded by the size just seen.
    """
    artifact_dir = Path(artifact_dir)
    document = load_manifest(artifact_dir)
    if manifest_sha256 is not None and document.sha256 != manifest_sha256:
        raise InputError(
            f"manifest.json changed since it was recorded (sha256 {document.sha256[:12]}..., recorded {manifest_sha256[:12]}...)",
            file=document.path,
        )
    seen = {MANIFEST_NAME: stat_fingerprint(document.path)} | _listed_files(artifact_dir, document, fingerprint)
    hashed = [relative for relative in sorted(document.files) if fingerprint is None or fingerprint.get(relative) != seen[relative]]
    for relative in hashed:
        path = artifact_dir / relative
        if sha256_file(path, size=seen[relative][0]) != document.files[relative]:
            raise InputError("file does not match its sha256 in the manifest (tampered or corrupt)", file=path)
    return ArtifactCheck(
        artifact_dir=artifact_dir, manifest_sha256=document.sha256, artifact_hash=sha256_json(document.files),
        fingerprint=seen, files=dict(document.files), hashed=hashed, recipe_text=document.recipe_text,
    )


def _listed_files(artifact_dir: Path, document: ManifestDocument, fingerprint: dict[str, list[int]] | None) -> dict[str, list[int]]:
    """The stat fingerprint of every file the manifest lists, after the checks that read no file's content."""
    present = {
        p.relative_to(artifact_dir).as_posix()
        for p in artifact_dir.rglob("*")
        if (p.is_file() or p.is_symlink()) and p.relative_to(artifact_dir).as_posix() != MANIFEST_NAME
    }
    extra = sorted(present - set(document.files))
    if extra:
        raise InputError("file is not in the manifest (added after quantization)", file=artifact_dir / extra[0])
    seen: dict[str, list[int]] = {}
    for relative in sorted(document.files):
        path = artifact_dir / relative
        if not path.is_file():
            raise InputError("file listed in the manifest is missing", file=path)
        if not inside(artifact_dir, path):
            raise InputError("file listed in the manifest resolves outside the artifact folder (symbolic link)", file=path)
        if not path.is_symlink():
            own_regular_file(path, "an artifact")
        seen[relative] = stat_fingerprint(path)
        recorded = (fingerprint or {}).get(relative)
        if recorded and recorded[0] != seen[relative][0]:
            raise InputError(f"file is {seen[relative][0]:,} bytes; it was {recorded[0]:,} bytes when last verified (tampered or corrupt)",
                             file=path)
    return seen


def verify_before_serving(artifact_dir: Path, *, allow_unverified: bool = False) -> ArtifactCheck | None:
    """Check the artifact file by file (full sha256) against its manifest before it is served.

    A missing manifest.json is refused unless `allow_unverified` (then None: nothing was verified);
    a malformed one, a changed, missing or added file is always an InputError naming the file.
    """
    manifest = artifact_dir / MANIFEST_NAME
    if not manifest.exists():
        if allow_unverified:
            return None
        raise InputError(
            "the artifact has no manifest.json, so its files cannot be verified; gate it anyway with"
            " --allow-unverified (reported as unverified, never registered)",
            file=manifest, field="--artifact",
        )
    return verify_artifact(artifact_dir)
