"""The quantize step: recipe + source model -> a vLLM-servable compressed-tensors artifact with manifest.json.

Artifacts are content-addressed: artifacts/candidates/<model>/<recipe>-<12 hex of the input key>/, where
the input key hashes the source model files, the compiled recipe, the calibration data and the library
versions. An existing artifact whose manifest matches is reused, never recomputed.

The calibration data (the recipe's, else `--calibration`: a folder, a JSONL file, a set under eval_sets/ or
`from-eval-sets`) is resolved, loaded and hashed by pipelines.quantize.calibration (docs/calibration.md).
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipelines.artifact import (
    MANIFEST_NAME,
    BackendRecord,
    CalibrationRecord,
    KvCacheRecord,
    Manifest,
    PeakMemory,
    SmoothingRecord,
    WeightBytes,
    artifact_file_hashes,
    check_model_dir,
    tensor_bytes,
    verified_manifest,
)
from pipelines.console.output import progress
from pipelines.console.progress import track
from pipelines.evaluation.evalsets import EvalSet
from pipelines.files.atomic import atomic_dir, write_json_atomic
from pipelines.files.hashing import file_hashes, sha256_json
from pipelines.files.safepath import ensure_inside, safe_component
from pipelines.hardware.targets import ServeTarget, host_record, installed_target
from pipelines.quantize.backends.compile import compile_checked
from pipelines.quantize.backends.environment import pinned_versions
from pipelines.quantize.backends.process import BackendRun, run_backend
from pipelines.quantize.backends.specs import BACKENDS, BackendPlan, BackendSpec
from pipelines.quantize.calibration import calibration_dataset, calibration_inputs
from pipelines.quantize.compiler import CompiledRecipe
from pipelines.quantize.layout import layout_from_model_dir
from pipelines.quantize.progress import following_llmcompressor
from pipelines.quantize.smoothing import checked_smoothing, with_mappings
from pipelines.recipe import LoadedRecipe, load_recipe
from pipelines.settings import current as current_settings

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

    recipe: LoadedRecipe
    model_dir: Path
    compiled: CompiledRecipe
    texts: list[str]
    calibration: CalibrationRecord | None
    source_files: dict[str, str]
    versions: dict[str, str]
    target: str  # the serve target the recipe was checked for (not part of the key: the same bits serve anywhere)
    backend_plan: BackendPlan | None = None  # a subprocess backend's configuration (None: llm-compressor, in-process)

    @property
    def key(self) -> str:
        return sha256_json(
            {
                "source_files": self.source_files,
                "compiled_recipe": self.compiled.yaml,
                "calibration": self.calibration.model_dump() if self.calibration else None,
                "versions": self.versions,
                # llm-compressor's key stays as it was (its artifacts are reused); another backend's adds its plan
                **({"backend": self.backend_plan.model_dump()} if self.backend_plan else {}),
            }
        )

    @property
    def backend(self) -> BackendSpec:
        return BACKENDS[self.recipe.recipe.backend]


def quantize_model(
    recipe: str | LoadedRecipe, model_dir: Path, *, artifacts_root: Path | None = None, force: bool = False,
    calibration: str | None = None, eval_sets: list[EvalSet] | None = None, target: ServeTarget | None = None,
) -> QuantizeResult:
    """Quantize `model_dir` with `recipe` (shipped name, YAML path, or loaded); reuse the artifact when it exists.
    `target`: the host class the artifact is for (default: this machine's; another class is checked by its written rules).

    `calibration` replaces the recipe's calibration data (a folder with data.jsonl, a JSONL file, a set
    under eval_sets/, or FROM_EVAL_SETS: the held-out prompts of `eval_sets`, the sets the run scores)."""
    started = time.perf_counter()
    artifacts_root = current_settings().artifacts_dir if artifacts_root is None else artifacts_root
    model_name(Path(model_dir))  # refused before minutes of work, not after
    inputs = gather_inputs(recipe, Path(model_dir), calibration=calibration, eval_sets=eval_sets, target=target)
    artifact_dir = artifact_path(artifacts_root, inputs)
    if not force and (manifest := verified_manifest(artifact_dir, inputs.key)) is not None:
        progress(f"reusing {artifact_dir} (same model, recipe, calibration data and library versions)")
        return QuantizeResult(artifact_dir=artifact_dir, manifest=manifest, reused=True)
    # atomic_dir gives the folder and manifest.json the umask's permissions (mkdtemp's would be private).
    with _removing_new_folders(artifact_dir.parent, stop_at=artifacts_root.parent), atomic_dir(artifact_dir) as staging:
        backend_run = _run_subprocess_backend(inputs, staging, artifact_dir.name) if inputs.backend_plan is not None else None
        quantize_s, smoothing = (backend_run.seconds, None) if backend_run is not None else run_oneshot(inputs, staging)
        manifest = _manifest(inputs, staging, quantize_s, time.perf_counter() - started, smoothing, backend_run)
        write_json_atomic(staging / MANIFEST_NAME, manifest.model_dump(mode="json"))
    progress(f"artifact {artifact_dir}")
    return QuantizeResult(artifact_dir=artifact_dir, manifest=manifest, reused=False)


def gather_inputs(
    recipe: str | LoadedRecipe, model_dir: Path, *, calibration: str | None = None, eval_sets: list[EvalSet] | None = None,
    target: ServeTarget | None = None,
) -> _Inputs:
    loaded = load_recipe(recipe)
    recipe_obj = loaded.recipe
    check_model_dir(model_dir)
    progress(f"checking recipe {recipe_obj.name} against {model_dir}")
    target = target or installed_target()
    compiled, plan = compile_checked(loaded, layout_from_model_dir(model_dir), target)
    progress(f"hashing {model_dir}")
    source_files = file_hashes(model_dir)
    if calibration is not None and not recipe_obj.needs_calibration:
        progress(f"recipe {recipe_obj.name} uses no calibration data (round-to-nearest weights, no SmoothQuant, no static "
                 f"activation scales): calibration {calibration!r} is not used")
    texts, record = calibration_inputs(
        recipe_obj.calibration if recipe_obj.needs_calibration else None,
        source=calibration, eval_sets=eval_sets, model_dir=model_dir, source_files=source_files,
    )
    return _Inputs(
        recipe=loaded,
        model_dir=model_dir,
        compiled=compiled,
        texts=texts,
        calibration=record,
        source_files=source_files,
        versions=library_versions() if plan is None else pinned_versions(BACKENDS[recipe_obj.backend]),
        target=str(target),
        backend_plan=plan,
    )


def library_versions() -> dict[str, str]:
    return {name: version(name) for name in LIBRARIES}


def model_name(model_dir: Path) -> str:
    """The model folder's name, which names its artifacts' folder: a safe path component or an InputError."""
    return safe_component(model_dir.resolve().name, "model (folder name)", file=model_dir)


def artifact_path(artifacts_root: Path, inputs: _Inputs) -> Path:
    """artifacts/candidates/<model>/<recipe>-<12 hex>/, every part a safe component, checked to stay inside."""
    recipe = safe_component(inputs.recipe.name, "recipe name", file=inputs.recipe.path)
    path = artifacts_root / "candidates" / model_name(inputs.model_dir) / f"{recipe}-{inputs.key[:KEY_HEX]}"
    return ensure_inside(artifacts_root, path, "model")


# ------------------------------------------------------------------------------- heavy work


def run_oneshot(inputs: _Inputs, out_dir: Path) -> tuple[float, SmoothingRecord | None]:
    """Load, calibrate + quantize with llm-compressor, save compressed with the tokenizer; returns seconds and
    the SmoothQuant mappings used (derived from the model's forward and checked before calibration). A recipe that
    changes only how the KV cache is served (dynamic scales) gives the source model's files, copied unchanged."""
    import torch  # heavy: imported when used
    from llmcompressor import oneshot  # heavy: imported when used
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: imported when used

    started = time.perf_counter()
    if not inputs.compiled.llmcompressor:
        progress(f"recipe {inputs.recipe.name} changes only the KV cache's precision when served: copying {inputs.model_dir} unchanged")
        copy_model_files(inputs.model_dir, out_dir)
        return time.perf_counter() - started, None
    seed = inputs.calibration.seed if inputs.calibration else 0
    with _deterministic(seed):
        progress(f"loading {inputs.model_dir}")
        tokenizer = AutoTokenizer.from_pretrained(inputs.model_dir)
        model = AutoModelForCausalLM.from_pretrained(inputs.model_dir, dtype="auto")
        kwargs: dict[str, Any] = {}
        smoothing: SmoothingRecord | None = None
        if inputs.calibration is not None:
            dataset = calibration_dataset(tokenizer, inputs.texts, inputs.calibration.max_seq_length)
            kwargs = {
                "dataset": dataset,
                "num_calibration_samples": len(dataset),
                "shuffle_calibration_samples": False,
                "max_seq_length": inputs.calibration.max_seq_length,
            }
            if inputs.recipe.recipe.smoothquant is not None:  # mappings from the model's own forward, checked first
                smoothing = checked_smoothing(model, dataset, strength=inputs.recipe.recipe.smoothquant.strength,
                                              max_seq_length=inputs.calibration.max_seq_length, source=inputs.model_dir)
        progress(f"running llm-compressor oneshot ({len(inputs.texts)} calibration samples, {'GPU' if torch.cuda.is_available() else 'CPU'})")
        # subgraph k/n as llm-compressor's own pipeline finishes them (pipelines.quantize.progress)
        with track("quantize", unit="subgraph") as bar, following_llmcompressor(bar):
            oneshot(model=model, recipe=_recipe_run(inputs, smoothing), **kwargs)
            bar.update(completed=bar.total)  # returned: all done (a data-free recipe traces nothing: no total)
        progress("saving the compressed model")
        model.save_pretrained(out_dir, save_compressed=True)
        tokenizer.save_pretrained(out_dir)
    return time.perf_counter() - started, smoothing


def _run_subprocess_backend(inputs: _Inputs, out_dir: Path, label: str) -> BackendRun:
    assert inputs.backend_plan is not None
    calibration = inputs.calibration
    return run_backend(inputs.backend, inputs.backend_plan, inputs.model_dir, out_dir, texts=inputs.texts, label=label,
                       max_seq_length=calibration.max_seq_length if calibration else 0, seed=calibration.seed if calibration else 0)


def copy_model_files(model_dir: Path, out_dir: Path) -> None:
    """The model folder's own files (weights, config, tokenizer), byte for byte; never a manifest it may hold."""
    for relative in file_hashes(model_dir, exclude=(MANIFEST_NAME,)):
        target = ensure_inside(out_dir, out_dir / relative, "model")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_dir / relative, target)


def _recipe_run(inputs: _Inputs, smoothing: SmoothingRecord | None) -> str:
    """The llm-compressor recipe oneshot runs: the compiled one, with the derived SmoothQuant mappings."""
    return inputs.compiled.yaml if smoothing is None else with_mappings(inputs.compiled.llmcompressor, smoothing.mappings)


@contextmanager
def _deterministic(seed: int) -> Iterator[None]:
    import numpy  # heavy: imported when used
    import torch  # heavy: imported when used

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


def _manifest(inputs: _Inputs, artifact_dir: Path, quantize_s: float, wall_s: float, smoothing: SmoothingRecord | None = None,
              backend_run: BackendRun | None = None) -> Manifest:
    before, after = tensor_bytes(inputs.model_dir), tensor_bytes(artifact_dir)
    return Manifest(
        recipe=inputs.recipe.name,
        model_name=inputs.model_dir.resolve().name,
        source_model=str(inputs.model_dir.resolve()),
        input_key=inputs.key,
        recipe_file=str(inputs.recipe.path),
        recipe_text=inputs.recipe.text,
        compiled_recipe=_recipe_run(inputs, smoothing) if inputs.backend_plan is None else json.dumps(inputs.backend_plan.config, sort_keys=True),
        calibration=inputs.calibration,
        versions=inputs.versions,
        source_files=inputs.source_files,
        artifact_files=artifact_file_hashes(artifact_dir),
        layers=inputs.compiled.layers,
        weight_bytes=WeightBytes(before=before, after=after, ratio=round(after / before, 4) if before else 0.0),
        wall_time_s=round(wall_s, 3),
        peak_memory=_peak_memory(backend_run),
        stages={"quantize_s": round(quantize_s, 3)},
        compute=compute_description(),
        smoothing=smoothing,
        serve_target=inputs.target,
        host=host_record(),
        kv_cache=KvCacheRecord(dtype=inputs.compiled.kv_cache.dtype, scales=inputs.compiled.kv_cache.scales,
                               served_as=inputs.compiled.kv_cache.vllm_dtype),
        backend=_backend_record(inputs, backend_run),
    )


def _peak_memory(backend_run: BackendRun | None) -> PeakMemory:
    if backend_run is None:
        return PeakMemory(bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return PeakMemory(bytes=backend_run.peak_bytes, note="the backend process's peak RSS (resource.getrusage ru_maxrss, in its environment)")


def _backend_record(inputs: _Inputs, backend_run: BackendRun | None) -> BackendRecord:
    spec = inputs.backend
    if backend_run is None or inputs.backend_plan is None:
        return BackendRecord(name=spec.name, version=inputs.versions.get(spec.package, ""), checkpoint_format=spec.checkpoint_format,
                             quant_method=spec.quant_method)
    return BackendRecord(name=spec.name, version=backend_run.versions.get(spec.package, ""), checkpoint_format=spec.checkpoint_format,
                         quant_method=spec.quant_method, versions=backend_run.versions, config=inputs.backend_plan.config,
                         notes=inputs.backend_plan.notes)


def compute_description() -> str:
    import torch  # heavy: imported when used

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {torch.get_num_threads()} threads"
