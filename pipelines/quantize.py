"""The quantize step: recipe + source model -> a vLLM-servable compressed-tensors artifact with manifest.json.

Artifacts are content-addressed: artifacts/candidates/<model>/<recipe>-<12 hex of the input key>/, where
the input key hashes the source model files, the compiled recipe, the calibration data and the library
versions. An existing artifact whose manifest matches is reused, never recomputed.
"""

from __future__ import annotations

import random
import resource
import time
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict

from pipelines.atomic import atomic_dir, write_json_atomic
from pipelines.compiler import CompiledRecipe, compile_recipe, layout_from_model_dir
from pipelines.evalsets import load_calibration_texts
from pipelines.hashing import file_hashes, sha256_json
from pipelines.manifest import (
    MANIFEST_NAME,
    CalibrationRecord,
    Manifest,
    PeakMemory,
    WeightBytes,
    artifact_file_hashes,
    check_model_dir,
    tensor_bytes,
    verified_manifest,
)
from pipelines.output import progress
from pipelines.paths import ARTIFACTS_DIR
from pipelines.recipe import Calibration, Recipe, load_recipe
from pipelines.safepath import ensure_inside, safe_component

LIBRARIES = ("torch", "transformers", "llmcompressor", "compressed-tensors")
KEY_HEX = 12


class QuantizeResult(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    artifact_dir: Path
    manifest: Manifest
    reused: bool


class _Inputs(BaseModel):
    """Everything the artifact depends on, gathered (and checked) before any heavy work."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    recipe: Recipe
    recipe_path: Path
    recipe_text: str
    model_dir: Path
    compiled: CompiledRecipe
    texts: list[str]
    calibration: CalibrationRecord | None
    source_files: dict[str, str]
    versions: dict[str, str]

    @property
    def key(self) -> str:
        return sha256_json(
            {
                "source_files": self.source_files,
                "compiled_recipe": self.compiled.yaml,
                "calibration": self.calibration.model_dump() if self.calibration else None,
                "versions": self.versions,
            }
        )


def quantize_model(recipe: str, model_dir: Path, *, artifacts_root: Path = ARTIFACTS_DIR, force: bool = False) -> QuantizeResult:
    """Quantize `model_dir` with `recipe` (shipped name or YAML path); reuse the artifact when it exists."""
    started = time.perf_counter()
    model_name(Path(model_dir))  # refused before minutes of work, not after
    inputs = gather_inputs(recipe, Path(model_dir))
    artifact_dir = artifact_path(artifacts_root, inputs)
    if not force and (manifest := verified_manifest(artifact_dir, inputs.key)) is not None:
        progress(f"reusing {artifact_dir} (same model, recipe, calibration data and library versions)")
        return QuantizeResult(artifact_dir=artifact_dir, manifest=manifest, reused=True)
    # atomic_dir gives the folder and manifest.json the umask's permissions (mkdtemp's would be private).
    with _removing_new_folders(artifact_dir.parent, stop_at=artifacts_root.parent), atomic_dir(artifact_dir) as staging:
        quantize_s = run_oneshot(inputs, staging)
        manifest = _manifest(inputs, staging, quantize_s, time.perf_counter() - started)
        write_json_atomic(staging / MANIFEST_NAME, manifest.model_dump(mode="json"))
    progress(f"artifact {artifact_dir}")
    return QuantizeResult(artifact_dir=artifact_dir, manifest=manifest, reused=False)


def gather_inputs(recipe: str, model_dir: Path) -> _Inputs:
    recipe_obj, recipe_path, recipe_text = load_recipe(recipe)
    check_model_dir(model_dir)
    progress(f"checking recipe {recipe_obj.name} against {model_dir}")
    compiled = compile_recipe(recipe_obj, layout_from_model_dir(model_dir), recipe_path)
    texts, calibration = calibration_inputs(recipe_obj.calibration if recipe_obj.needs_calibration else None)
    progress(f"hashing {model_dir}")
    return _Inputs(
        recipe=recipe_obj,
        recipe_path=recipe_path,
        recipe_text=recipe_text,
        model_dir=model_dir,
        compiled=compiled,
        texts=texts,
        calibration=calibration,
        source_files=file_hashes(model_dir),
        versions=library_versions(),
    )


def calibration_inputs(calibration: Calibration | None) -> tuple[list[str], CalibrationRecord | None]:
    if calibration is None:
        return [], None
    texts = load_calibration_texts(calibration.dataset, calibration.num_samples, calibration.seed)
    record = CalibrationRecord(
        dataset=calibration.dataset,
        sha256=sha256_json(texts),
        num_samples=len(texts),
        seed=calibration.seed,
        max_seq_length=calibration.max_seq_length,
    )
    return texts, record


def library_versions() -> dict[str, str]:
    return {name: version(name) for name in LIBRARIES}


def model_name(model_dir: Path) -> str:
    """The model folder's name, which names its artifacts' folder: a safe path component or an InputError."""
    return safe_component(model_dir.resolve().name, "model (folder name)", file=model_dir)


def artifact_path(artifacts_root: Path, inputs: _Inputs) -> Path:
    """artifacts/candidates/<model>/<recipe>-<12 hex>/, every part a safe component, checked to stay inside."""
    recipe = safe_component(inputs.recipe.name, "recipe name", file=inputs.recipe_path)
    path = artifacts_root / "candidates" / model_name(inputs.model_dir) / f"{recipe}-{inputs.key[:KEY_HEX]}"
    return ensure_inside(artifacts_root, path, "model")


# ------------------------------------------------------------------------------- heavy work


def calibration_dataset(tokenizer: Any, texts: list[str], max_seq_length: int) -> Any:
    """Tokenized calibration samples, in the given order (oneshot must not shuffle them)."""
    from datasets import Dataset

    encoded = [tokenizer(text, truncation=True, max_length=max_seq_length) for text in texts]
    return Dataset.from_dict(
        {"input_ids": [e["input_ids"] for e in encoded], "attention_mask": [e["attention_mask"] for e in encoded]}
    )


def run_oneshot(inputs: _Inputs, out_dir: Path) -> float:
    """Load, calibrate + quantize with llm-compressor, save compressed with the tokenizer; returns seconds."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    seed = inputs.calibration.seed if inputs.calibration else 0
    with _deterministic(seed):
        progress(f"loading {inputs.model_dir}")
        tokenizer = AutoTokenizer.from_pretrained(inputs.model_dir)
        model = AutoModelForCausalLM.from_pretrained(inputs.model_dir, dtype="auto")
        kwargs: dict[str, Any] = {}
        if inputs.calibration is not None:
            dataset = calibration_dataset(tokenizer, inputs.texts, inputs.calibration.max_seq_length)
            kwargs = {
                "dataset": dataset,
                "num_calibration_samples": len(dataset),
                "shuffle_calibration_samples": False,
                "max_seq_length": inputs.calibration.max_seq_length,
            }
        progress(f"running llm-compressor oneshot ({len(inputs.texts)} calibration samples, {'GPU' if torch.cuda.is_available() else 'CPU'})")
        oneshot(model=model, recipe=inputs.compiled.yaml, **kwargs)
        progress("saving the compressed model")
        model.save_pretrained(out_dir, save_compressed=True)
        tokenizer.save_pretrained(out_dir)
    return time.perf_counter() - started


@contextmanager
def _deterministic(seed: int) -> Iterator[None]:
    import numpy
    import torch

    previous = torch.are_deterministic_algorithms_enabled()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@contextmanager
def _removing_new_folders(folder: Path, *, stop_at: Path) -> Iterator[None]:
    """On error, remove the (then empty) folders that this step created on the way to `folder`."""
    new = [path for path in [folder, *folder.parents] if not path.exists() and path != stop_at and stop_at in path.parents]
    try:
        yield
    except BaseException:
        for path in new:  # deepest first; best effort: a full or read-only disk must not hide the first error
            try:
                if path.is_dir() and not any(path.iterdir()):
                    path.rmdir()
            except OSError:
                pass
        raise


def _manifest(inputs: _Inputs, artifact_dir: Path, quantize_s: float, wall_s: float) -> Manifest:
    before, after = tensor_bytes(inputs.model_dir), tensor_bytes(artifact_dir)
    return Manifest(
        recipe=inputs.recipe.name,
        model_name=inputs.model_dir.resolve().name,
        source_model=str(inputs.model_dir.resolve()),
        input_key=inputs.key,
        recipe_file=str(inputs.recipe_path),
        recipe_text=inputs.recipe_text,
        compiled_recipe=inputs.compiled.yaml,
        calibration=inputs.calibration,
        versions=inputs.versions,
        source_files=inputs.source_files,
        artifact_files=artifact_file_hashes(artifact_dir),
        layers=inputs.compiled.layers,
        weight_bytes=WeightBytes(before=before, after=after, ratio=round(after / before, 4) if before else 0.0),
        wall_time_s=round(wall_s, 3),
        peak_memory=PeakMemory(bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        stages={"quantize_s": round(quantize_s, 3)},
        compute=compute_description(),
    )


def compute_description() -> str:
    import torch

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {torch.get_num_threads()} threads"
