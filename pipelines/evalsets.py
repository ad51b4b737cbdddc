"""Business eval sets: folders under eval_sets/ holding an lm-eval task YAML and its JSONL data.

    eval_sets/<name>/<name>.yaml   an lm-eval task (dataset_path: json, data_files relative to the folder)
    eval_sets/<name>/data.jsonl    one JSON object per line
    eval_sets/<name>/set.yaml      `kind: calibration` instead of a task YAML: calibration data, one
                                   {"text": ...} per line in data.jsonl

Adding a set is dropping in a folder: nothing here names the shipped sets. Every problem found is an
InputError naming the file and the line or field, the most fundamental first.

The task YAML is parsed once, here: an EvalSet carries the config, the task name and the primary metric
(the first entry of `metric_list`, with its direction and aggregation) that scoring and the gate use.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.meta
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from pipelines.errors import InputError, from_validation_error
from pipelines.hashing import sha256_file, sha256_json
from pipelines.metrics import CORPUS_AGGREGATIONS, DEFAULT_METRIC, MetricSpec, make_spec
from pipelines.paths import EVAL_SETS_DIR

OUTPUT_TYPES = ("generate_until", "multiple_choice", "loglikelihood", "loglikelihood_rolling")
ROLLING = "loglikelihood_rolling"
# Checked in this order, before the output type's own keys: the most fundamental problem is reported first.
SET_KEYS = ("task", "dataset_path", "dataset_kwargs", "test_split", "output_type")
# The per-item metrics lm-eval's ConfigurableTask.process_results (lm_eval/api/task.py) logs for each output
# type; a task with its own `process_results` logs whatever that function returns. `likelihood` is left
# out: lm-eval logs it as (gold, loglikelihoods) yet averages it, which fails.
PRODUCED_METRICS = {
    "generate_until": frozenset({"exact_match", "bleu", "chrf", "chrf++", "ter"}),
    "multiple_choice": frozenset({"acc", "acc_norm", "acc_bytes", "acc_mutual_info", "exact_match", "f1", "mcc", "brier_score"}),
    "loglikelihood": frozenset({"perplexity", "acc"}),
    ROLLING: frozenset({"word_perplexity", "byte_perplexity", "bits_per_byte"}),
}
NO_FILTER = "none"  # the filter name lm-eval gives a task without filter_list
SET_FILE = "set.yaml"
DATA_FILE = "data.jsonl"

# The same Jinja settings lm-eval renders doc_to_text / doc_to_target / doc_to_choice with.
_JINJA = jinja2.Environment(loader=jinja2.BaseLoader(), undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EvalSet(_Frozen):
    name: str
    folder: Path
    task_yaml: Path
    data: Path
    config: dict[str, Any]  # the task YAML as parsed (`!function` values kept as FunctionRef)
    task_name: str  # lm-eval's task name: always the folder's name
    output_type: str
    metric: MetricSpec  # the primary metric: the first of metric_list (lm-eval's default without one)
    num_items: int
    sha256: str  # of the task YAML and the data file together: the identity cached scores are keyed by

    @property
    def filter_name(self) -> str:
        """The filter whose results are judged: the first of filter_list (lm-eval logs one per filter)."""
        filters = self.config.get("filter_list")
        return str(filters[0]["name"]) if filters else NO_FILTER


class CalibrationSet(_Frozen):
    name: str
    folder: Path
    data: Path
    num_items: int
    sha256: str


class SetFile(_Frozen):
    """set.yaml: marks a folder as calibration data (the only kind that has no task YAML)."""

    kind: Literal["calibration"]
    description: str = ""


# ---------------------------------------------------------------- YAML with lm-eval's !function tag


class FunctionRef(str):
    """An lm-eval `!function module.name` value: kept as written, never run here."""


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_constructor("!function", lambda loader, node: FunctionRef(loader.construct_scalar(node)))
_Dumper.add_representer(FunctionRef, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader with one extra tag
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else None
        raise InputError(f"malformed YAML: {getattr(error, 'problem', None) or error}", file=_display(path), field=where) from None


def _dump_yaml(value: Any) -> str:
    return yaml.dump(value, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)


def render_template(template: str, doc: dict) -> str:
    return _JINJA.from_string(template).render(**doc)


@lru_cache(maxsize=1)
def task_config_keys() -> frozenset[str]:
    """The keys lm-eval's TaskConfig accepts (imported lazily: lm-eval is slow to import)."""
    from lm_eval.api.task import TaskConfig

    return frozenset(field.name for field in dataclasses.fields(TaskConfig))


# ---------------------------------------------------------------- data files


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a line that is not a JSON object is an InputError."""
    if not path.is_file():
        raise InputError("data file not found", file=_display(path))
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"invalid JSON: {error.msg} (column {error.colno})", file=_display(path), field=f"line {number}") from None
            if not isinstance(value, dict):
                raise InputError(f"expected a JSON object, got {type(value).__name__}", file=_display(path), field=f"line {number}")
            yield number, value


def _set_hash(*files: Path) -> str:
    return sha256_json({path.name: sha256_file(path) for path in files})


# ---------------------------------------------------------------- task YAML checks


def _data_file(config: dict, folder: Path, yaml_path: Path) -> Path:
    where = _display(yaml_path)
    if config["dataset_path"] != "json":
        raise InputError(f"only local JSONL data is supported: use `dataset_path: json` (got {config['dataset_path']!r})", file=where, field="dataset_path")
    kwargs = config["dataset_kwargs"]
    data_files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if isinstance(data_files, str):
        data_files = {"train": data_files}
    if not isinstance(data_files, dict) or not data_files:
        raise InputError("needs `data_files: {test: data.jsonl}` (a path relative to the set's folder)", file=where, field="dataset_kwargs.data_files")
    split = config["test_split"]
    if split not in data_files:
        raise InputError(f"test_split {split!r} is not a key of data_files ({', '.join(map(str, data_files))})", file=where, field="test_split")
    relative = data_files[split]
    if not isinstance(relative, str):
        raise InputError("one data file per set: give a single path", file=where, field=f"dataset_kwargs.data_files.{split}")
    return folder / relative


def _template_fields(value: Any, *, bare_is_field: bool) -> set[str]:
    """Item fields a doc_to_* value reads: Jinja variables, or a bare name lm-eval looks up in the item."""
    if isinstance(value, FunctionRef) or not isinstance(value, (str, list)):
        return set()
    if isinstance(value, list):
        return set().union(*(_template_fields(v, bare_is_field=False) for v in value)) if value else set()
    if "{{" in value or "{%" in value:
        return set(jinja2.meta.find_undeclared_variables(_JINJA.parse(value)))
    return {value} if bare_is_field and _IDENTIFIER.match(value) else set()


def _check_config(config: dict, yaml_path: Path) -> None:
    where = _display(yaml_path)
    unknown = sorted(set(config) - task_config_keys())
    if unknown:
        raise InputError("unknown key (not an lm-eval TaskConfig field)", file=where, field=unknown[0])
    for key in SET_KEYS:
        _require(config, key, where)
    if config["output_type"] not in OUTPUT_TYPES:
        raise InputError(f"output_type must be one of {', '.join(OUTPUT_TYPES)} (got {config['output_type']!r})", file=where, field="output_type")
    _check_prompt_keys(config, where)
    if config["task"] != yaml_path.stem:
        raise InputError(f"the task name must be the folder's name {yaml_path.stem!r} (got {config['task']!r})", file=where, field="task")
    _check_filters(config.get("filter_list"), where)


def _require(config: dict, key: str, where: str) -> None:
    if config.get(key) in (None, ""):
        raise InputError("required key missing", file=where, field=key)


def _check_prompt_keys(config: dict, where: str) -> None:
    """A rolling set scores doc_to_target alone, yet lm-eval renders doc_to_text for every task: it may be ""."""
    rolling = config["output_type"] == ROLLING
    if config.get("doc_to_text") is None:
        hint = ' (a loglikelihood_rolling set writes doc_to_text: "")' if rolling else ""
        raise InputError(f"required key missing{hint}", file=where, field="doc_to_text")
    if config["doc_to_text"] == "" and not rolling:
        raise InputError(f"is empty: only a {ROLLING} set, which scores doc_to_target alone, may leave it empty", file=where, field="doc_to_text")
    _require(config, "doc_to_target", where)
    if config["output_type"] == "multiple_choice" and not config.get("doc_to_choice"):
        raise InputError("a multiple_choice task needs doc_to_choice", file=where, field="doc_to_choice")


def _check_filters(filters: Any, where: str) -> None:
    if filters is None:
        return
    if not isinstance(filters, list) or not filters:
        raise InputError("a list of {name, filter} entries (the first one is judged)", file=where, field="filter_list")
    names: set[str] = set()
    for index, entry in enumerate(filters):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name or name in names:
            raise InputError("every filter needs a name of its own: lm-eval keys results by it", file=where, field=f"filter_list[{index}].name")
        names.add(name)


# ---------------------------------------------------------------- the primary metric

FIRST_METRIC = "metric_list[0]"
JUDGED_AGGREGATIONS = CORPUS_AGGREGATIONS | {"mean"}


def _metric_spec(config: dict, where: str) -> MetricSpec:
    """The first metric_list entry, with lm-eval's defaults for what it leaves out; refused if the gate cannot judge it."""
    entries = config.get("metric_list")
    if entries is None:
        return make_spec(*DEFAULT_METRIC[config["output_type"]])
    entry = _first_metric(entries, where)
    name = _metric_name(entry["metric"])
    _check_produced(name, entry["metric"], config, where)
    default_aggregation, default_direction = lm_eval_metric_defaults(name)
    aggregation = entry.get("aggregation", default_aggregation)
    higher_is_better = entry.get("higher_is_better", default_direction)
    _check_aggregation(name, aggregation, default_aggregation, where)
    if not isinstance(higher_is_better, bool):
        got = f"lm-eval has no default for {name!r}" if higher_is_better is None else f"got {higher_is_better!r}"
        raise InputError(f"must be true or false ({got})", file=where, field=f"{FIRST_METRIC}.higher_is_better")
    return make_spec(name, aggregation, higher_is_better)


def _first_metric(entries: Any, where: str) -> dict:
    if not isinstance(entries, list) or not entries:
        raise InputError("a list of {metric: ...} entries, the first one judged", file=where, field="metric_list")
    entry = entries[0]
    if not isinstance(entry, dict) or not isinstance(entry.get("metric"), str) or not entry["metric"]:
        raise InputError("needs a metric name", file=where, field=f"{FIRST_METRIC}.metric")
    return entry


def _metric_name(metric: str) -> str:
    """lm-eval names a `!function` metric by the function's __name__ (lm_eval/api/task.py)."""
    return metric.rsplit(".", 1)[-1] if isinstance(metric, FunctionRef) else metric


def _check_produced(name: str, metric: str, config: dict, where: str) -> None:
    output_type = config["output_type"]
    if isinstance(config.get("process_results"), FunctionRef):
        return  # the task's own function decides what is logged
    if isinstance(metric, FunctionRef) and output_type == "generate_until":
        return  # called on each (reference, prediction) pair
    produced = PRODUCED_METRICS[output_type]
    if name not in produced:
        raise InputError(
            f"lm-eval logs no per-item {name!r} for {output_type} (it logs {', '.join(sorted(produced))}; "
            "a task's own process_results may log others)",
            file=where, field=f"{FIRST_METRIC}.metric",
        )


def _check_aggregation(name: str, aggregation: Any, default: str | None, where: str) -> None:
    field = f"{FIRST_METRIC}.aggregation"
    if aggregation is None:
        raise InputError(f"lm-eval has no default aggregation for {name!r}: give one", file=where, field=field)
    if isinstance(aggregation, FunctionRef) or not isinstance(aggregation, str) or aggregation not in JUDGED_AGGREGATIONS:
        raise InputError(
            f"the gate cannot judge aggregation {aggregation!r}: use mean or one of {', '.join(sorted(CORPUS_AGGREGATIONS))}",
            file=where, field=field,
        )
    # A registered metric is logged per item as a number (mean) or as a list (corpus): the other kind fails in lm-eval.
    if default is not None and (aggregation == "mean") != (default == "mean"):
        raise InputError(f"{aggregation!r} cannot aggregate {name!r}; lm-eval's own aggregation for it is {default!r}", file=where, field=field)


def lm_eval_metric_defaults(name: str) -> tuple[str | None, bool | None]:
    """The aggregation name and direction lm-eval registers for a metric (lm_eval/api/metrics.py); None if unregistered."""
    import lm_eval.api.metrics  # noqa: F401 - registers lm-eval's metrics and aggregations
    from lm_eval.api.registry import (
        AGGREGATION_REGISTRY,
        HIGHER_IS_BETTER_REGISTRY,
        METRIC_AGGREGATION_REGISTRY,
    )

    aggregation_names = {function: key for key, function in AGGREGATION_REGISTRY.items()}
    return aggregation_names.get(METRIC_AGGREGATION_REGISTRY.get(name, None)), HIGHER_IS_BETTER_REGISTRY.get(name, None)


# ---------------------------------------------------------------- data items


def _check_items(config: dict, data: Path) -> int:
    needs: dict[str, set[str]] = {
        "doc_to_text": _template_fields(config["doc_to_text"], bare_is_field=False),
        "doc_to_target": _template_fields(config["doc_to_target"], bare_is_field=True),
        "doc_to_choice": _template_fields(config.get("doc_to_choice"), bare_is_field=True),
    }
    static_choices = config.get("doc_to_choice") if isinstance(config.get("doc_to_choice"), list) else None
    target_field = config["doc_to_target"] if config["doc_to_target"] in needs["doc_to_target"] else None
    count = 0
    for number, item in iter_jsonl(data):
        count += 1
        for key, fields in needs.items():
            missing = sorted(fields - set(item))
            if missing:
                raise InputError(f"item has no field {missing[0]!r}, which {key} needs", file=_display(data), field=f"line {number}")
        label = item.get(target_field) if target_field else None
        if static_choices and isinstance(label, int) and not 0 <= label < len(static_choices):
            raise InputError(f"{target_field} {label} is not an index into the {len(static_choices)} choices", file=_display(data), field=f"line {number}")
    if count == 0:
        raise InputError("no items", file=_display(data))
    return count


# ---------------------------------------------------------------- public API


def load_task_config(yaml_path: Path) -> dict:
    config = _load_yaml(yaml_path)
    if not isinstance(config, dict):
        raise InputError("a task YAML is a mapping of lm-eval TaskConfig keys", file=_display(yaml_path), field="(top level)")
    return config


def validate_eval_set(folder: Path) -> EvalSet:
    folder = Path(folder)
    yaml_path = folder / f"{folder.name}.yaml"
    if not yaml_path.is_file():
        raise InputError(f"no task YAML {yaml_path.name} (or {SET_FILE} with `kind: calibration`)", file=_display(folder))
    config = load_task_config(yaml_path)
    _check_config(config, yaml_path)
    data = _data_file(config, folder, yaml_path)
    metric = _metric_spec(config, _display(yaml_path))
    if not data.is_file():
        raise InputError(f"data file {_display(data)} not found", file=_display(yaml_path), field="dataset_kwargs.data_files")
    return EvalSet(
        name=folder.name,
        folder=folder,
        task_yaml=yaml_path,
        data=data,
        config=config,
        task_name=config["task"],
        output_type=config["output_type"],
        metric=metric,
        num_items=_check_items(config, data),
        sha256=_set_hash(yaml_path, data),
    )


def validate_calibration_set(folder: Path) -> CalibrationSet:
    folder = Path(folder)
    set_file = folder / SET_FILE
    try:
        SetFile.model_validate(_load_yaml(set_file) or {})
    except ValidationError as error:
        raise from_validation_error(error, _display(set_file)) from None
    data = folder / DATA_FILE
    count = 0
    for number, item in iter_jsonl(data):
        if not isinstance(item.get("text"), str) or not item["text"].strip():
            raise InputError("calibration lines need a non-empty string field 'text'", file=_display(data), field=f"line {number}")
        count += 1
    if count == 0:
        raise InputError("no calibration texts", file=_display(data))
    return CalibrationSet(name=folder.name, folder=folder, data=data, num_items=count, sha256=_set_hash(set_file, data))


def is_calibration_folder(folder: Path) -> bool:
    return (folder / SET_FILE).is_file()


def set_folders(root: Path = EVAL_SETS_DIR) -> list[Path]:
    """Every folder under root that is a set (hidden folders and those starting with '_' skipped)."""
    if not root.is_dir():
        raise InputError("eval sets folder not found", file=_display(root))
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def validate_folder(folder: Path) -> EvalSet | CalibrationSet:
    return validate_calibration_set(folder) if is_calibration_folder(folder) else validate_eval_set(folder)


def discover_eval_sets(root: Path = EVAL_SETS_DIR) -> list[EvalSet]:
    """Every eval set under root, validated; the first broken one raises InputError."""
    return [validate_eval_set(folder) for folder in set_folders(root) if not is_calibration_folder(folder)]


def materialize_task(eval_set: EvalSet, dest_dir: Path) -> Path:
    """Write the task YAML into dest_dir with its data path made absolute; returns lm-eval's include_path.

    Python files beside the YAML (for `!function` helpers) are copied along.
    """
    data_files = {eval_set.config["test_split"]: str(eval_set.data.resolve())}
    config = {**eval_set.config, "dataset_kwargs": {**eval_set.config["dataset_kwargs"], "data_files": data_files}}
    dest_dir.mkdir(parents=True, exist_ok=True)
    for helper in eval_set.folder.glob("*.py"):
        shutil.copy2(helper, dest_dir / helper.name)
    (dest_dir / eval_set.task_yaml.name).write_text(_dump_yaml(config))
    return dest_dir


def resolve_calibration_data(name_or_path: str, root: Path = EVAL_SETS_DIR) -> Path:
    """A set name under eval_sets/, a folder holding data.jsonl, or a JSONL file."""
    candidate = Path(name_or_path)
    for path in (candidate, root / name_or_path):
        if path.is_file():
            return path
        if path.is_dir():
            return path / DATA_FILE
    raise InputError("calibration data not found (a set under eval_sets/, a folder or a JSONL file)", file=name_or_path, field="calibration.dataset")


def load_calibration_texts(name_or_path: str, num_samples: int, seed: int) -> list[str]:
    """`num_samples` texts drawn without replacement, in a seed-fixed order."""
    data = resolve_calibration_data(name_or_path)
    texts = []
    for number, item in iter_jsonl(data):
        if not isinstance(item.get("text"), str):
            raise InputError("calibration lines need a string field 'text'", file=_display(data), field=f"line {number}")
        texts.append(item["text"])
    if num_samples > len(texts):
        raise InputError(f"asks for {num_samples} samples but the data has {len(texts)}", file=_display(data), field="calibration.num_samples")
    return random.Random(seed).sample(texts, num_samples)
