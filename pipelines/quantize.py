"""The quantize step: recipe + source model -> a vLLM-servable compressed-tensors artifact with manifest.json.

Artifacts are content-addressed: artifacts/candidates/<model>/<recipe>-<12 hex of the input key>/, where
the input key hashes the source model files, the compiled recipe, the calibration data and the library
versions. An existing artifact whose manifest matches is reused, never recomputed.

Calibration data is the user's (docs/calibration.md): the recipe's `calibration.dataset` by default, or
per run (`--calibration`) and per job candidate (`calibration:`) a folder holding data.jsonl, a JSONL
file of {"text": ...} lines, or `from-eval-sets`: the prompts of each scored set's held-out
calibration.jsonl (never its scored data.jsonl, never an answer). Calibrating a model other than the demo
model on the demo's own set is allowed but announced by a progress line starting with "WARNING:".
"""

from __future__ import annotations

import random
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipelines.artifact import (
    MANIFEST_NAME,
    CalibrationRecord,
    Manifest,
    PeakMemory,
    WeightBytes,
    artifact_file_hashes,
    check_model_dir,
    is_model_dir,
    tensor_bytes,
    verified_manifest,
)
from pipelines.atomic import atomic_dir, write_json_atomic
from pipelines.compiler import CompiledRecipe, compile_recipe, layout_from_model_dir
from pipelines.errors import InputError
from pipelines.evalsets import EvalSet, iter_jsonl, load_calibration_texts, render_template, resolve_calibration_data
from pipelines.hashing import file_hashes, sha256_file, sha256_json
from pipelines.output import progress
from pipelines.paths import DEMO_MODEL_DIR, EVAL_SETS_DIR
from pipelines.progress import Bar, track
from pipelines.recipe import FROM_EVAL_SETS, Calibration, LoadedRecipe, load_recipe
from pipelines.safepath import ensure_inside, safe_component
from pipelines.settings import current as current_settings
from pipelines.yamlio import FunctionRef

LIBRARIES = ("torch", "transformers", "llmcompressor", "compressed-tensors")
KEY_HEX = 12
HELD_OUT_FILE = "calibration.jsonl"  # in an eval set's folder: items like data.jsonl, never scored
DEMO_CALIBRATION_DIR = EVAL_SETS_DIR / "calibration"  # the demo model's calibration set
ROLLING = "loglikelihood_rolling"


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


def quantize_model(
    recipe: str | LoadedRecipe, model_dir: Path, *, artifacts_root: Path | None = None, force: bool = False,
    calibration: str | None = None, eval_sets: list[EvalSet] | None = None,
) -> QuantizeResult:
    """Quantize `model_dir` with `recipe` (shipped name, YAML path, or loaded); reuse the artifact when it exists.

    `calibration` replaces the recipe's calibration data (a folder with data.jsonl, a JSONL file, a set
    under eval_sets/, or FROM_EVAL_SETS: the held-out prompts of `eval_sets`, the sets the run scores)."""
    started = time.perf_counter()
    artifacts_root = current_settings().artifacts_dir if artifacts_root is None else artifacts_root
    model_name(Path(model_dir))  # refused before minutes of work, not after
    inputs = gather_inputs(recipe, Path(model_dir), calibration=calibration, eval_sets=eval_sets)
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


def gather_inputs(
    recipe: str | LoadedRecipe, model_dir: Path, *, calibration: str | None = None, eval_sets: list[EvalSet] | None = None,
) -> _Inputs:
    loaded = load_recipe(recipe)
    recipe_obj = loaded.recipe
    check_model_dir(model_dir)
    progress(f"checking recipe {recipe_obj.name} against {model_dir}")
    compiled = compile_recipe(recipe_obj, layout_from_model_dir(model_dir), loaded.path)
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
        versions=library_versions(),
    )


def calibration_inputs(
    calibration: Calibration | None, *, source: str | None = None, eval_sets: list[EvalSet] | None = None,
    model_dir: Path | None = None, source_files: dict[str, str] | None = None,
) -> tuple[list[str], CalibrationRecord | None]:
    """The calibration texts and their manifest record (None when the recipe calibrates nothing).

    `source` (--calibration) replaces the recipe's dataset; the recipe keeps its num_samples, seed and
    max_seq_length. The record (texts' sha256 included) is part of the artifact's input key."""
    if calibration is None:
        return [], None
    dataset = source or calibration.dataset
    if dataset == FROM_EVAL_SETS:
        per_set = {s.name: held_out_prompts(s) for s in _scored_sets(eval_sets)}
        texts = draw_prompts(per_set, calibration.num_samples, calibration.seed)
        if len(texts) < calibration.num_samples:
            progress(f"calibrating on all {len(texts)} held-out prompts of {', '.join(per_set)} (the recipe asks for {calibration.num_samples})")
        label = f"{FROM_EVAL_SETS}: {', '.join(per_set)}"
    else:
        texts = load_calibration_texts(dataset, calibration.num_samples, calibration.seed)
        if model_dir is not None:
            warn_if_demo_calibration(resolve_calibration_data(dataset), model_dir, source_files)
        label = dataset
    record = CalibrationRecord(
        dataset=label,
        sha256=sha256_json(texts),
        num_samples=len(texts),
        seed=calibration.seed,
        max_seq_length=calibration.max_seq_length,
    )
    return texts, record


def check_calibration_source(source: str, eval_sets: list[EvalSet] | None) -> str:
    """Check a --calibration value before any work (data found and readable; from-eval-sets: every
    scored set has a held-out file whose prompts render and none is scored); returns its content hash."""
    if source == FROM_EVAL_SETS:
        sets = _scored_sets(eval_sets)
        return sha256_json({s.name: [s.sha256, held_out_prompts(s)] for s in sets})
    data = resolve_calibration_data(source)
    texts = 0
    for number, item in iter_jsonl(data):
        if not isinstance(item.get("text"), str):
            raise InputError("calibration lines need a string field 'text'", file=data, field=f"line {number}")
        texts += 1
    if texts == 0:
        raise InputError("no calibration texts", file=data, field="calibration")
    return sha256_file(data)


def _scored_sets(eval_sets: list[EvalSet] | None) -> list[EvalSet]:
    if not eval_sets:
        raise InputError(f"calibration {FROM_EVAL_SETS} needs the eval sets the run scores; none were given", field="calibration")
    return list(eval_sets)


def held_out_prompts(eval_set: EvalSet) -> list[str]:
    """The prompts of the set's held-out calibration.jsonl, rendered with its doc_to_text template.

    Only prompts: doc_to_target and doc_to_choice are never rendered (a loglikelihood_rolling set, which
    scores a text with no prompt, gives its held-out documents). The gate scores every item of data.jsonl,
    so calibration never draws from it: an item of calibration.jsonl whose prompt is the prompt of a
    scored item is refused, naming both lines."""
    path = eval_set.folder / HELD_OUT_FILE
    if not path.is_file():
        raise InputError(
            f"calibration {FROM_EVAL_SETS} needs held-out prompts for eval set {eval_set.name}: add {HELD_OUT_FILE} to its folder "
            f"(items shaped like {eval_set.data.name}, none of them scored; only their prompts are used; see docs/calibration.md)",
            file=path, field="calibration",
        )
    if path.resolve() == eval_set.data.resolve():
        raise InputError(f"{HELD_OUT_FILE} is the data the gate scores; held-out prompts must be other items", file=path, field="calibration")
    scored: dict[str, int] = {}
    for number, item in iter_jsonl(eval_set.data):
        scored.setdefault(_prompt(eval_set, item, eval_set.data, number), number)
    prompts = []
    for number, item in iter_jsonl(path):
        prompt = _prompt(eval_set, item, path, number)
        if not prompt.strip():
            raise InputError("renders an empty prompt", file=path, field=f"line {number}")
        if prompt in scored:
            raise InputError(
                f"renders the same prompt as {eval_set.data.name} line {scored[prompt]}, an item the gate scores: remove it "
                "(calibrating on scored items would tune the candidate to the test)",
                file=path, field=f"line {number}",
            )
        prompts.append(prompt)
    if not prompts:
        raise InputError("no held-out items", file=path, field="calibration")
    return prompts


def _prompt(eval_set: EvalSet, item: dict, path: Path, number: int) -> str:
    """What lm-eval sends the model for one item, before any answer: doc_to_text (a field name is a lookup)."""
    key = "doc_to_target" if eval_set.output_type == ROLLING else "doc_to_text"
    template = eval_set.config.get(key)
    if isinstance(template, FunctionRef) or not isinstance(template, str):
        raise InputError(f"{key} is not a template ({template!r}); calibration {FROM_EVAL_SETS} renders templates only",
                         file=eval_set.task_yaml, field=key)
    if template in item:
        return str(item[template])
    try:
        return render_template(template, item)
    except Exception as error:
        raise InputError(f"cannot render {key}: {type(error).__name__}: {error}", file=path, field=f"line {number}") from None


def draw_prompts(per_set: dict[str, list[str]], num_samples: int, seed: int) -> list[str]:
    """Up to `num_samples` prompts, taken in turn from each set (so one large set does not crowd out the
    others), each set's prompts in a seed-fixed order."""
    rng = random.Random(seed)
    queues = [rng.sample(prompts, len(prompts)) for _, prompts in sorted(per_set.items())]
    drawn: list[str] = []
    for round_ in range(max(map(len, queues), default=0)):
        for queue in queues:
            if round_ < len(queue) and len(drawn) < num_samples:
                drawn.append(queue[round_])
    return drawn


def is_demo_model(model_dir: Path, source_files: dict[str, str] | None = None) -> bool:
    """The shipped demo model: by path, or by content (a copy of its folder elsewhere)."""
    demo = Path(DEMO_MODEL_DIR)
    try:
        if Path(model_dir).resolve() == demo.resolve():
            return True
    except OSError:
        return False
    if not is_model_dir(demo):
        return False
    return (source_files if source_files is not None else file_hashes(Path(model_dir))) == file_hashes(demo)


def is_demo_calibration(data: Path) -> bool:
    """The demo's calibration data (eval_sets/calibration/data.jsonl): by path or by content."""
    demo = Path(DEMO_CALIBRATION_DIR) / "data.jsonl"
    if not demo.is_file() or not Path(data).is_file():
        return False
    return Path(data).resolve() == demo.resolve() or sha256_file(Path(data)) == sha256_file(demo)


def warn_if_demo_calibration(data: Path, model_dir: Path, source_files: dict[str, str] | None = None) -> bool:
    """A loud progress line when a model other than the demo model is calibrated on the demo's set."""
    if not is_demo_calibration(data) or is_demo_model(model_dir, source_files):
        return False
    progress(
        f"WARNING: calibrating {Path(model_dir).name} on the demo model's calibration set ({data}: synthetic tickets, "
        f"payment references and dates written for {Path(DEMO_MODEL_DIR).name}); the artifact will be tuned to that text, "
        f"not to your traffic. Give your own with --calibration DIR|FILE.jsonl (a job: `calibration:`) or "
        f"--calibration {FROM_EVAL_SETS} (docs/calibration.md)"
    )
    return True


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
        layers = decoder_layers(model)
        with track("quantize", total=len(layers) or None, unit="layer") as bar, counting_layers(layers, bar):
            oneshot(model=model, recipe=inputs.compiled.yaml, **kwargs)
            bar.update(completed=len(layers))
        progress("saving the compressed model")
        model.save_pretrained(out_dir, save_compressed=True)
        tokenizer.save_pretrained(out_dir)
    return time.perf_counter() - started


def decoder_layers(model: Any) -> list[Any]:
    """The model's stack of decoder layers: the ModuleList as long as config.num_hidden_layers (empty if none)."""
    import torch

    count = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return list(module)
    return []


@contextmanager
def counting_layers(layers: list[Any], bar: Bar) -> Iterator[None]:
    """Advance `bar` to layer k when layer k's forward first runs.

    llm-compressor's sequential pipeline calibrates (and GPTQ compresses) one layer's subgraph at a time, so
    the first forward of layer k means layers before it are done; data-free recipes (RTN) run no forward
    and the bar jumps to the end when oneshot returns."""
    def reached(index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if index > bar.completed:
                bar.update(completed=index)
        return hook

    handles = [layer.register_forward_pre_hook(reached(index)) for index, layer in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
        recipe_file=str(inputs.recipe.path),
        recipe_text=inputs.recipe.text,
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
