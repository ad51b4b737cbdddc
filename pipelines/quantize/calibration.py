"""Calibration data: what a `--calibration` value names, where the texts come from, loading and hashing them.

Calibration data is the user's (docs/calibration.md): the recipe's `calibration.dataset` by default, or
per run (`--calibration`) and per job candidate (`calibration:`) a folder holding data.jsonl, a JSONL
file of {"text": ...} lines, a calibration set under eval_sets/ by name, or `from-eval-sets`: the prompts of
each scored set's held-out calibration.jsonl (never its scored data.jsonl, never an answer). Calibrating a
model other than the demo model on the demo's own set is allowed but announced by a progress line starting
with "WARNING:".

The texts and their CalibrationRecord (the texts' sha256 included) are part of an artifact's input key
(pipelines.quantize.oneshot); the quantize step and the repair's sensitivity measure draw the same texts from here.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pipelines.artifact import CalibrationRecord, is_model_dir
from pipelines.console.output import progress
from pipelines.errors import InputError
from pipelines.evaluation.evalsets import DATA_FILE, ROLLING, EvalSet
from pipelines.evaluation.templates import RenderBudget, render_template
from pipelines.files.hashing import file_hashes, sha256_file, sha256_json
from pipelines.files.jsonl import display_path, iter_jsonl
from pipelines.files.yamlio import FunctionRef
from pipelines.paths import DEMO_MODEL_DIR, EVAL_SETS_DIR
from pipelines.recipe import FROM_EVAL_SETS, Calibration
from pipelines.settings import current as current_settings

HELD_OUT_FILE = "calibration.jsonl"  # in an eval set's folder: items like data.jsonl, never scored
DEMO_CALIBRATION_DIR = EVAL_SETS_DIR / "calibration"  # the demo model's calibration set


# ------------------------------------------------------------------------------- a --calibration value


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


def resolve_calibration_data(name_or_path: str, root: Path | None = None) -> Path:
    """A set name under eval_sets/ (or root), a folder holding data.jsonl, or a JSONL file."""
    root = current_settings().eval_sets_dir if root is None else root
    candidate = Path(name_or_path)
    for path in (candidate, root / name_or_path):
        if path.is_file():
            return path
        if path.is_dir():
            return path / DATA_FILE
    raise InputError("calibration data not found (a set under eval_sets/, a folder or a JSONL file)", file=name_or_path, field="calibration.dataset")


def source_of(record: CalibrationRecord | None) -> str | None:
    """The calibration data an artifact was made with (its manifest's record), as `--calibration` would name it."""
    if record is None:
        return None
    return FROM_EVAL_SETS if record.dataset.startswith(FROM_EVAL_SETS) else record.dataset


# ------------------------------------------------------------------------------- the texts


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
        sha256=texts_sha256(texts),
        num_samples=len(texts),
        seed=calibration.seed,
        max_seq_length=calibration.max_seq_length,
    )
    return texts, record


def load_calibration_texts(name_or_path: str, num_samples: int, seed: int) -> list[str]:
    """`num_samples` texts drawn without replacement, in a seed-fixed order."""
    data = resolve_calibration_data(name_or_path)
    texts = []
    for number, item in iter_jsonl(data):
        if not isinstance(item.get("text"), str):
            raise InputError("calibration lines need a string field 'text'", file=display_path(data), field=f"line {number}")
        texts.append(item["text"])
    if num_samples > len(texts):
        raise InputError(f"asks for {num_samples} samples but the data has {len(texts)}", file=display_path(data), field="calibration.num_samples")
    return random.Random(seed).sample(texts, num_samples)


def texts_sha256(texts: list[str]) -> str:
    """The identity of calibration texts (in their order): the record's sha256, the sensitivity cache's key."""
    return sha256_json(texts)


# ------------------------------------------------------------------------------- from-eval-sets: held-out prompts


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
    budget = RenderBudget()  # the set's time and output budget, over both files
    scored: dict[str, int] = {}
    for number, item in iter_jsonl(eval_set.data):
        scored.setdefault(_prompt(eval_set, item, eval_set.data, number, budget), number)
    prompts = []
    for number, item in iter_jsonl(path):
        prompt = _prompt(eval_set, item, path, number, budget)
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


def _prompt(eval_set: EvalSet, item: dict, path: Path, number: int, budget: RenderBudget) -> str:
    """What lm-eval sends the model for one item, before any answer: doc_to_text (a field name is a lookup)."""
    key = "doc_to_target" if eval_set.output_type == ROLLING else "doc_to_text"
    template = eval_set.config.get(key)
    if isinstance(template, FunctionRef) or not isinstance(template, str):
        raise InputError(f"{key} is not a template ({template!r}); calibration {FROM_EVAL_SETS} renders templates only",
                         file=eval_set.task_yaml, field=key)
    if template in item:
        return str(item[template])
    try:
        return render_template(template, item, budget)
    except Exception as error:  # whatever a template raises (a budget passed, MemoryError) is the template's fault
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


# ------------------------------------------------------------------------------- the demo's calibration set


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


# ------------------------------------------------------------------------------- tokenized for llm-compressor


def calibration_dataset(tokenizer: Any, texts: list[str], max_seq_length: int) -> Any:
    """Tokenized calibration samples, in the given order (oneshot must not shuffle them)."""
    from datasets import Dataset  # heavy: imported when used

    encoded = [tokenizer(text, truncation=True, max_length=max_seq_length) for text in texts]
    return Dataset.from_dict(
        {"input_ids": [e["input_ids"] for e in encoded], "attention_mask": [e["attention_mask"] for e in encoded]}
    )
