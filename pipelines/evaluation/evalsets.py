"""Business eval sets: folders under eval_sets/ holding an lm-eval task YAML and its JSONL data.

    eval_sets/<name>/<name>.yaml   an lm-eval task (dataset_path: json, data_files relative to the folder)
    eval_sets/<name>/data.jsonl    one JSON object per line
    eval_sets/<name>/set.yaml      `kind: calibration` instead of a task YAML: calibration data, one
                                   {"text": ...} per line in data.jsonl

Adding a set is dropping in a folder: nothing here names the shipped sets. Every problem found is an
InputError naming the file and the line or field, the most fundamental first.

The task YAML is parsed once, here: an EvalSet carries the config, the task name and the primary metric
(the first entry of `metric_list`, with its direction and aggregation) that scoring and the gate use.

Two things live in the task's `metadata` (free-form in lm-eval's TaskConfig, so plain lm-eval accepts the YAML):
`chat_template: true` asks for the model's chat template (lm-eval's --apply_chat_template) and
`system_instruction: "..."` for a system message (--system_instruction); sets are scored in one lm-eval
run per distinct pair.

`custom_dataset: !function pipelines.evaluation.evalsets.set_data` (SET_DATA_LOADER) makes lm-eval read `data_files`
relative to the YAML's folder, so that the folder runs in plain lm-eval from any working directory;
lm-eval 0.4.13 itself resolves them against the working directory. The product does not need it: it
hands lm-eval a copy of the YAML with the data path made absolute (materialize_task).
"""

from __future__ import annotations

import ast
import dataclasses
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from pipelines.console.output import progress
from pipelines.errors import InputError, from_validation_error
from pipelines.evaluation.item_render import CommandRenderStopped, compile_templates, render_item, template_fields
from pipelines.evaluation.metrics import MetricSpec
from pipelines.evaluation.set_metric import ROLLING, metric_spec
from pipelines.evaluation.templates import RenderBudget, render_template
from pipelines.files.hashing import sha256_file, sha256_json
from pipelines.files.jsonl import display_path, iter_jsonl
from pipelines.files.yamlio import FunctionRef, dump_yaml, load_yaml_file
from pipelines.schema import FrozenModel
from pipelines.settings import current as current_settings

# re-exported: they live in pipelines.files.yamlio, pipelines.evaluation.templates and pipelines.files.jsonl
__all__ = ["FunctionRef", "display_path", "iter_jsonl", "render_template"]

OUTPUT_TYPES = ("generate_until", "multiple_choice", "loglikelihood", "loglikelihood_rolling")
# Checked in this order, before the output type's own keys: the most fundamental problem is reported first.
SET_KEYS = ("task", "dataset_path", "dataset_kwargs", "test_split", "output_type")
NO_FILTER = "none"  # the filter name lm-eval gives a task without filter_list
SET_FILE = "set.yaml"
DATA_FILE = "data.jsonl"
# The one `custom_dataset` a set may name: the set's own data_files, read relative to the task YAML's folder.
SET_DATA_LOADER = "pipelines.evaluation.evalsets.set_data"
# Its name before the package was divided into subpackages: sets written then still validate (the product reads their
# data itself, without the loader; plain `lm_eval --include_path` needs the current name).
LEGACY_SET_DATA_LOADERS = ("pipelines.evalsets.set_data",)
# Keys of the task's `metadata` the product reads (anything else there is lm-eval's or the author's).
CHAT_TEMPLATE_KEY = "chat_template"
SYSTEM_INSTRUCTION_KEY = "system_instruction"

class EvalSet(FrozenModel):
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
    # lm-eval's --apply_chat_template / --system_instruction for this set (metadata.chat_template, .system_instruction)
    chat_template: bool = False
    system_instruction: str | None = None
    # The requests lm-eval sends for the set (one per item, one per choice for multiple choice, ...);
    # None when it depends on the model (rolling windows)
    num_requests: int | None = None

    @property
    def lm_eval_options(self) -> tuple[bool, str | None]:
        """What the lm-eval run scoring this set is started with: sets that differ are scored in separate runs."""
        return self.chat_template, self.system_instruction

    @property
    def filter_name(self) -> str:
        """The filter whose results are judged: the first of filter_list (lm-eval logs one per filter)."""
        filters = self.config.get("filter_list")
        return str(filters[0]["name"]) if filters else NO_FILTER


class CalibrationSet(FrozenModel):
    name: str
    folder: Path
    data: Path
    num_items: int
    sha256: str


class SetFile(FrozenModel):
    """set.yaml: marks a folder as calibration data (the only kind that has no task YAML)."""

    kind: Literal["calibration"]
    description: str = ""


# ---------------------------------------------------------------- YAML (pipelines.files.yamlio: `!function` kept as data)


def _load_yaml(path: Path) -> Any:
    """The product's one YAML loader: bounded size and depth, no aliases, UTF-8, `!function` as FunctionRef."""
    return load_yaml_file(path, what="eval-set YAML", name=display_path(path))


@lru_cache(maxsize=1)
def task_config_keys() -> frozenset[str]:
    """The keys lm-eval's TaskConfig accepts (imported lazily: lm-eval is slow to import)."""
    from lm_eval.api.task import TaskConfig  # heavy: imported when used

    return frozenset(field.name for field in dataclasses.fields(TaskConfig))


# ---------------------------------------------------------------- data files


def _set_hash(*files: Path) -> str:
    return sha256_json({path.name: sha256_file(path) for path in files})


# ---------------------------------------------------------------- task YAML checks


def _data_file(config: dict, folder: Path, yaml_path: Path) -> Path:
    where = display_path(yaml_path)
    if config["dataset_path"] != "json":
        raise InputError(
            f"only local JSONL data is supported: use `dataset_path: json` (got {config['dataset_path']!r})", file=where, field="dataset_path",
        )
    kwargs = config["dataset_kwargs"]
    data_files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if isinstance(data_files, str):
        data_files = {"train": data_files}
    if not isinstance(data_files, dict) or not data_files:
        raise InputError(
            "needs `data_files: {test: data.jsonl}` (a path relative to the set's folder)", file=where, field="dataset_kwargs.data_files",
        )
    split = config["test_split"]
    if not isinstance(split, str) or split not in data_files:
        raise InputError(f"test_split {split!r} is not a key of data_files ({', '.join(map(str, data_files))})", file=where, field="test_split")
    others = sorted(str(key) for key in kwargs if key != "data_files")
    if others:
        raise InputError("only data_files may be given: the data is the set's own JSONL file", file=where, field=f"dataset_kwargs.{others[0]}")
    for key, relative in data_files.items():
        if not isinstance(relative, str):
            raise InputError("one data file per set: give a single path", file=where, field=f"dataset_kwargs.data_files.{key}")
        _inside(folder, relative, where, f"dataset_kwargs.data_files.{key}")
    return folder / data_files[split]


def _inside(folder: Path, relative: str, where: str, field: str) -> Path:
    """A data path must name a file inside the set's folder: relative, no `..`, no symlink leading out."""
    candidate = Path(relative)
    if not relative or "\0" in relative or candidate.is_absolute() or relative.startswith("~"):
        raise InputError(f"must be a path relative to the set's folder (got {relative!r})", file=where, field=field)
    if ".." in candidate.parts:
        raise InputError(f"must stay inside the set's folder: no '..' (got {relative!r})", file=where, field=field)
    if "://" in relative or any(char in relative for char in "*?[]{}"):
        raise InputError(f"must be one plain file name: no URL, no glob pattern (got {relative!r})", file=where, field=field)
    try:
        resolved, root = (folder / candidate).resolve(), folder.resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop
        raise InputError(f"cannot resolve {relative!r} ({error})", file=where, field=field) from None
    if not resolved.is_relative_to(root):
        raise InputError(f"{relative!r} leads outside the set's folder (a symlink to {resolved})", file=where, field=field)
    return resolved


def _check_config(config: dict, yaml_path: Path) -> None:
    where = display_path(yaml_path)
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
    _check_custom_dataset(config, where)
    _chat_options(config, where)


def _check_custom_dataset(config: dict, where: str) -> None:
    """Only the product's own loader (the set's data_files, beside the YAML): the data stays the set's JSONL file."""
    loader = config.get("custom_dataset")
    if loader is None:
        return
    if not isinstance(loader, FunctionRef) or str(loader).strip() not in (SET_DATA_LOADER, *LEGACY_SET_DATA_LOADERS):
        raise InputError(
            f"only `!function {SET_DATA_LOADER}` (reads data_files relative to this folder) may load a set's data (got {loader!r})",
            file=where, field="custom_dataset",
        )


def _chat_options(config: dict, where: str) -> tuple[bool, str | None]:
    """metadata.chat_template (lm-eval's --apply_chat_template) and metadata.system_instruction (--system_instruction)."""
    metadata = config.get("metadata")
    if metadata is None:
        return False, None
    if not isinstance(metadata, dict):
        raise InputError("a mapping (lm-eval's free-form task metadata)", file=where, field="metadata")
    chat = metadata.get(CHAT_TEMPLATE_KEY, False)
    if not isinstance(chat, bool):
        raise InputError(f"must be true or false (got {chat!r})", file=where, field=f"metadata.{CHAT_TEMPLATE_KEY}")
    if chat and config["output_type"] == ROLLING:
        raise InputError(
            f"a {ROLLING} set scores its text without a prompt: a chat template does not apply to it",
            file=where, field=f"metadata.{CHAT_TEMPLATE_KEY}",
        )
    instruction = metadata.get(SYSTEM_INSTRUCTION_KEY)
    if instruction is not None and (not isinstance(instruction, str) or not instruction.strip()):
        raise InputError(f"must be a non-empty string (got {instruction!r})", file=where, field=f"metadata.{SYSTEM_INSTRUCTION_KEY}")
    if instruction is not None and config["output_type"] == ROLLING:
        raise InputError(f"a {ROLLING} set scores its text without a prompt: a system instruction does not apply to it",
                         file=where, field=f"metadata.{SYSTEM_INSTRUCTION_KEY}")
    return chat, instruction


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


# ---------------------------------------------------------------- data items


def _check_items(config: dict, data: Path, yaml_path: Path) -> tuple[int, int | None]:
    """The number of items (every one checked) and of the requests lm-eval sends for them."""
    where = display_path(yaml_path)
    needs: dict[str, set[str]] = {
        "doc_to_text": template_fields(config["doc_to_text"], bare_is_field=False, where=where, key="doc_to_text"),
        "doc_to_target": template_fields(config["doc_to_target"], bare_is_field=True, where=where, key="doc_to_target"),
        "doc_to_choice": template_fields(config.get("doc_to_choice"), bare_is_field=True, where=where, key="doc_to_choice"),
    }
    compiled = compile_templates(config, where)
    static_choices = config.get("doc_to_choice") if isinstance(config.get("doc_to_choice"), list) else None
    target_field = config["doc_to_target"] if config["doc_to_target"] in needs["doc_to_target"] else None
    count = 0
    requests: int | None = 0
    budget = RenderBudget()
    for number, item in iter_jsonl(data):
        count += 1
        for key, fields in needs.items():
            missing = sorted(fields - set(item))
            if missing:
                raise InputError(f"item has no field {missing[0]!r}, which {key} needs", file=display_path(data), field=f"line {number}")
        _check_target(item, target_field, needs["doc_to_target"], display_path(data), number)
        rendered = render_item(compiled, config, item, where, data, number, budget)
        requests = None if requests is None else _add_requests(requests, config, rendered, item)
        label = item.get(target_field) if target_field else None
        if static_choices and isinstance(label, int) and not 0 <= label < len(static_choices):
            raise InputError(
                f"{target_field} {label} is not an index into the {len(static_choices)} choices", file=display_path(data), field=f"line {number}",
            )
    if count == 0:
        raise InputError("no items", file=display_path(data))
    return count, requests


def _target_problem(value: Any) -> str | None:
    """Why an item's target (the field doc_to_target names) is not one lm-eval can score, or None: text, a number (a
    choice index), or a non-empty list of them (several accepted answers). lm-eval casts anything else to text, so a
    null becomes the answer "None" and an object its Python repr, silently."""
    if not isinstance(value, list):
        return _scalar_target_problem(value)
    if not value:
        return "an empty list (no accepted answer)"
    inner = [problem for problem in map(_scalar_target_problem, value) if problem]
    return f"a list holding {inner[0]}" if inner else None


def _scalar_target_problem(value: Any) -> str | None:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (str, int, float)):
        return None
    return {type(None): "null", dict: "an object", list: "a nested list"}.get(type(value), type(value).__name__)


def _check_target(item: dict, target_field: str | None, template_fields: set[str], where: str, number: int) -> None:
    """The target of one item: a field named by doc_to_target holds text, a number or a list of them; a field the
    doc_to_target template reads is not null (it would render "None")."""
    problem = _target_problem(item[target_field]) if target_field else None
    if problem is not None:
        raise InputError(f"target {target_field!r} is {problem}: give text, a number or a list of them", file=where, field=f"line {number}")
    for name in sorted(template_fields):
        if name in item and item[name] is None:
            raise InputError(f"field {name!r}, which doc_to_target renders, is null (the target would be the text 'None')",
                             file=where, field=f"line {number}")


def _add_requests(so_far: int, config: dict, rendered: dict[str, str], item: dict) -> int | None:
    """How many requests lm-eval sends for one item (lm_eval/api/task.py: construct_requests); None when
    that depends on the model (rolling windows) or on code (a `!function` doc_to_choice)."""
    output_type = config["output_type"]
    repeats = config.get("repeats", 1) if isinstance(config.get("repeats", 1), int) else 1
    if output_type == ROLLING:
        return None
    if output_type != "multiple_choice":
        return so_far + max(1, repeats)
    choices = config.get("doc_to_choice")
    if isinstance(choices, list):
        number = len(choices)
    elif isinstance(choices, str) and choices in item and isinstance(item[choices], list):
        number = len(item[choices])
    elif "doc_to_choice" in rendered:
        number = len(ast.literal_eval(rendered["doc_to_choice"].strip()))  # a list literal: checked by _render_item
    else:
        return None
    metrics = [entry.get("metric") for entry in config.get("metric_list") or [] if isinstance(entry, dict)]
    return so_far + number * (2 if "acc_mutual_info" in metrics else 1)


# ---------------------------------------------------------------- public API


def load_task_config(yaml_path: Path) -> dict:
    config = _load_yaml(yaml_path)
    if not isinstance(config, dict):
        raise InputError("a task YAML is a mapping of lm-eval TaskConfig keys", file=display_path(yaml_path), field="(top level)")
    return config


def validate_eval_set(folder: Path) -> EvalSet:
    folder = Path(folder)
    yaml_path = folder / f"{folder.name}.yaml"
    if not yaml_path.is_file():
        raise InputError(f"no task YAML {yaml_path.name} (or {SET_FILE} with `kind: calibration`)", file=display_path(folder))
    config = load_task_config(yaml_path)
    _check_config(config, yaml_path)
    data = _data_file(config, folder, yaml_path)
    metric = metric_spec(config, display_path(yaml_path))
    if not data.is_file():
        raise InputError(f"data file {display_path(data)} not found", file=display_path(yaml_path), field="dataset_kwargs.data_files")
    chat_template, system_instruction = _chat_options(config, display_path(yaml_path))
    num_items, num_requests = _check_items(config, data, yaml_path)
    return EvalSet(
        name=folder.name,
        folder=folder,
        task_yaml=yaml_path,
        data=data,
        config=config,
        task_name=config["task"],
        output_type=config["output_type"],
        metric=metric,
        num_items=num_items,
        sha256=_set_hash(yaml_path, data),
        chat_template=chat_template,
        system_instruction=system_instruction,
        num_requests=num_requests,
    )


def validate_calibration_set(folder: Path) -> CalibrationSet:
    folder = Path(folder)
    set_file = folder / SET_FILE
    try:
        SetFile.model_validate(_load_yaml(set_file) or {})
    except ValidationError as error:
        raise from_validation_error(error, display_path(set_file)) from None
    data = folder / DATA_FILE
    count = 0
    for number, item in iter_jsonl(data):
        if not isinstance(item.get("text"), str) or not item["text"].strip():
            raise InputError("calibration lines need a non-empty string field 'text'", file=display_path(data), field=f"line {number}")
        count += 1
    if count == 0:
        raise InputError("no calibration texts", file=display_path(data))
    return CalibrationSet(name=folder.name, folder=folder, data=data, num_items=count, sha256=_set_hash(set_file, data))


def is_calibration_folder(folder: Path) -> bool:
    return (folder / SET_FILE).is_file()


def set_folders(root: Path | None = None) -> list[Path]:
    """Every folder under root (default: eval_sets/) that is a set (hidden folders and those starting with '_' skipped)."""
    root = current_settings().eval_sets_dir if root is None else root
    if not root.is_dir():
        raise InputError("eval sets folder not found", file=display_path(root))
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def validate_folder(folder: Path) -> EvalSet | CalibrationSet:
    return validate_calibration_set(folder) if is_calibration_folder(folder) else validate_eval_set(folder)


class DiscoveredSets(list):
    """The eval sets under a folder, in name order, each validated the first time it is needed: iterating
    (or len, `broken`) validates every one; `select` validates only the sets it names, so a run never
    reads, renders or waits on a set it does not score (the others are known by their folder names only).
    `broken` maps each set that did not validate to its error (a broken set blocks only the runs that select it)."""

    def __init__(self, folders: list[Path]) -> None:
        super().__init__()
        self._folders = {folder.name: folder for folder in folders}
        self._found: dict[str, EvalSet] = {}
        self._broken: dict[str, InputError] = {}
        self._complete = False

    @property
    def names(self) -> list[str]:
        return list(self._folders)

    def _validate(self, name: str) -> EvalSet | None:
        if name not in self._found and name not in self._broken:
            try:
                self._found[name] = validate_eval_set(self._folders[name])
            except CommandRenderStopped:
                raise
            except InputError as error:
                self._broken[name] = error
        return self._found.get(name)

    def _validate_all(self) -> None:
        if not self._complete:
            for name in self._folders:
                self._validate(name)
            super().extend(self._found[name] for name in self._folders if name in self._found)
            self._complete = True

    def select(self, names: list[str]) -> list[EvalSet]:
        """The named sets, validated (the first broken one raises its own error); an unknown name is an InputError."""
        unknown = [n for n in names if n not in self._folders]
        for name in names:
            if name not in unknown and self._validate(name) is None:
                raise self._broken[name]
        if unknown:
            available = sorted(n for n in self._folders if n not in self._broken)
            raise InputError(f"unknown eval set(s) {unknown}; available: {available}", field="--eval-sets")
        return [self._found[n] for n in names]

    @property
    def broken(self) -> dict[str, InputError]:
        self._validate_all()
        return self._broken



def _validating_first(name: str) -> Any:
    """A list method of DiscoveredSets that validates every set before it reads the list."""
    method = getattr(list, name)

    def read(self: DiscoveredSets, *args: Any, **kwargs: Any) -> Any:
        self._validate_all()
        return method(self, *args, **kwargs)

    read.__name__ = name
    return read


for _name in ("__iter__", "__len__", "__getitem__", "__contains__", "__eq__", "__ne__", "__reversed__", "__repr__",
              "__add__", "__mul__", "index", "count", "copy"):
    setattr(DiscoveredSets, _name, _validating_first(_name))


def discover_eval_sets(root: Path | None = None) -> DiscoveredSets:
    """Every eval set under root (calibration sets left out), validated when first needed (DiscoveredSets)."""
    return DiscoveredSets([folder for folder in set_folders(root) if not is_calibration_folder(folder)])


def select_eval_sets(names: list[str] | None, found: list[EvalSet] | None = None) -> list[EvalSet]:
    """The sets a run scores: `names`, or every set. A broken set fails only a run that selects it (its own
    error, exit 2); a run of every set skips it with one warning line naming it; a run of named sets
    validates only those. `found`: the sets already discovered (a job's candidates select from one
    discovery: each task YAML is parsed once per job)."""
    found = discover_eval_sets() if found is None else found
    if names and isinstance(found, DiscoveredSets):
        return found.select(names)
    broken: dict[str, InputError] = getattr(found, "broken", {})
    available = {s.name: s for s in found}
    for name in (n for n in names or [] if n in broken):
        raise broken[name]
    if not names:
        for name, error in broken.items():
            progress(f"eval set {name} skipped: {error.one_line()}")
        if broken and not available:  # nothing left to score: the first broken set is the error
            raise next(iter(broken.values()))
        return list(available.values())
    unknown = [n for n in names if n not in available]
    if unknown:
        raise InputError(f"unknown eval set(s) {unknown}; available: {sorted(available)}", field="--eval-sets")
    return [available[n] for n in names]


def set_data(config_source: str | None = None, data_files: dict | str | None = None, **_metadata: Any):
    """lm-eval's `custom_dataset` for a set (`custom_dataset: !function pipelines.evaluation.evalsets.set_data`): the
    set's data_files read relative to the folder of the task YAML, whatever the working directory.

    lm-eval calls it with the task's metadata and dataset_kwargs as keyword arguments (lm_eval/api/task.py:
    ConfigurableTask.download); `config_source` is the YAML's path, which lm-eval adds to the metadata
    (lm_eval/tasks/_factory.py). The paths are held to the folder as the validator holds them."""
    import datasets  # heavy: imported when used

    if data_files is None:
        raise ValueError("set_data needs dataset_kwargs.data_files")
    files = {"train": data_files} if isinstance(data_files, str) else dict(data_files)
    source = Path(config_source) if config_source and config_source != "inline" else None
    folder = source.parent if source is not None else Path.cwd()
    where = str(source or folder)
    resolved = {}
    for split, relative in files.items():
        resolved[split] = str(_inside(folder, str(relative), where, f"dataset_kwargs.data_files.{split}"))
    return datasets.load_dataset("json", data_files=resolved)


def materialize_task(eval_set: EvalSet, dest_dir: Path) -> Path:
    """Write the task YAML into dest_dir with its data path made absolute; returns lm-eval's include_path.

    The copy reads its data with lm-eval's own JSON loading (no custom_dataset: the absolute path needs none).
    Python files beside the YAML (for `!function` helpers) are copied along.
    """
    data_files = {eval_set.config["test_split"]: str(eval_set.data.resolve())}
    config = {key: value for key, value in eval_set.config.items() if key != "custom_dataset"}
    config = {**config, "dataset_kwargs": {**eval_set.config["dataset_kwargs"], "data_files": data_files}}
    dest_dir.mkdir(parents=True, exist_ok=True)
    for helper in eval_set.folder.glob("*.py"):
        shutil.copy2(helper, dest_dir / helper.name)
    (dest_dir / eval_set.task_yaml.name).write_text(dump_yaml(config), encoding="utf-8")
    return dest_dir
