"""The one YAML loader of the product: recipes, policies, job files and eval-set YAML all come through here.

Users' files are read defensively, since they arrive from CI jobs and pull requests:

- at most MAX_FILE_BYTES are read (a larger file is refused before it is parsed);
- the bytes must be UTF-8 (a leading byte-order mark is accepted), else an InputError names the file;
- nesting deeper than MAX_DEPTH, or more than MAX_NODES values, is refused as it is composed (no
  RecursionError, and time and memory stay bounded: PyYAML keeps a few hundred bytes per value);
- anchors and aliases are allowed, but an alias counts as the whole value it repeats, at the depth it
  is placed: a 1 KB file of nested aliases ("billion laughs"), which would expand to gigabytes as soon
  as anything walks it, is refused after reading a few hundred bytes; an alias inside its own anchor
  (a recursive value) is refused;
- a float that is not finite (`.nan`, `.inf`, `1.0e+999`) is refused wherever it appears;
- lm-eval's `!function module.name` tag is read as a FunctionRef: kept as data, never imported or run here.

Every refusal is an InputError naming the file and, where there is one, the line or the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pipelines.bounds import MiB
from pipelines.errors import InputError, from_validation_error

Model = TypeVar("Model", bound=BaseModel)

MAX_FILE_BYTES = MiB  # recipes, policies, job files, eval-set task YAML
MAX_JSON_BYTES = MiB  # small JSON documents users hand in (registry evidence)
MAX_DEPTH = 64
MAX_NODES = 10_000  # scalars and collections in one document (a recipe has about 50, a task YAML about 100)


class FunctionRef(str):
    """An lm-eval `!function module.name` value: kept as written, never run here."""


# ---------------------------------------------------------------- reading a user's file


def read_user_bytes(
    path: Path | str, *, what: str = "file", field: str | None = None, max_bytes: int = MAX_FILE_BYTES, name: str | None = None,
) -> bytes:
    """The file's bytes, at most `max_bytes`; a missing, unreadable or oversized file is an InputError.

    `name` is how errors call the file (default: the path as given)."""
    name = str(path) if name is None else name
    path = Path(path)
    try:
        if not path.is_file():
            raise InputError(f"no such {what} file", file=name, field=field)
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    except InputError:
        raise
    except (OSError, ValueError) as error:  # permission denied, name too long, embedded NUL, ...
        reason = getattr(error, "strerror", None) or str(error)
        raise InputError(f"cannot read the {what} file ({reason})", file=name, field=field) from None
    if len(data) > max_bytes:
        raise InputError(f"the {what} file is larger than {_size(max_bytes)}; refused", file=name, field=field)
    return data


def decode_utf8(data: bytes, path: Path | str) -> str:
    """UTF-8 text (a leading byte-order mark is dropped); anything else is an InputError naming the file and line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        bad = data[error.start : error.start + 1].hex()
        message = f"not UTF-8 text (byte 0x{bad} at offset {error.start}); save the file as UTF-8"
        raise InputError(message, file=str(path), field=f"line {line}") from None


def read_user_text(
    path: Path | str, *, what: str = "file", field: str | None = None, max_bytes: int = MAX_FILE_BYTES, name: str | None = None,
) -> str:
    """A user's text file: bounded in size, UTF-8 (BOM accepted), every failure one InputError."""
    data = read_user_bytes(path, what=what, field=field, max_bytes=max_bytes, name=name)
    return decode_utf8(data, str(path) if name is None else name)


def _size(count: int) -> str:
    return f"{count // MiB} MiB" if count % MiB == 0 else f"{count} bytes"


# ---------------------------------------------------------------- the loader


class _Loader(yaml.SafeLoader):
    """SafeLoader with a depth limit, a limit on values counted with every alias expanded, and lm-eval's
    `!function` tag.

    Anchors and aliases are allowed (yaml.safe_dump writes them for a value used twice), but each alias
    counts as the whole value it repeats, at the depth it is placed: a "billion laughs" file is refused
    after a few hundred events, long before anything walks the structure it describes.
    """

    max_depth = MAX_DEPTH
    max_nodes = MAX_NODES

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0  # collections open around the node being composed
        self._deepest = 0  # deepest level reached inside the node being composed
        self._expanded = 0  # values so far, aliases counted as what they repeat
        self._measures: dict[int, tuple[int, int]] = {}  # anchored node -> (values, height)

    def _refuse(self, problem: str, mark) -> None:
        raise yaml.composer.ComposerError(None, None, problem, mark)

    def _count(self, values: int, mark) -> None:
        self._expanded += values
        if self._expanded > self.max_nodes:
            self._refuse(f"more than {self.max_nodes} values in one file (aliases counted as what they repeat)", mark)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)  # the anchored node (an undefined alias raises)
            if id(node) not in self._measures:
                self._refuse(f"alias *{event.anchor} refers to a value that contains it", event.start_mark)
            values, height = self._measures[id(node)]
            if self._depth + height > self.max_depth:
                self._refuse(f"nested deeper than {self.max_depth} levels (alias *{event.anchor} expanded)", event.start_mark)
            self._deepest = max(self._deepest, self._depth + height)
            self._count(values, event.start_mark)
            return node
        self._count(1, event.start_mark)
        before, depth, outer_deepest = self._expanded - 1, self._depth, self._deepest
        self._deepest = depth
        collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if collection:
            self._depth += 1
            self._deepest = self._depth
            if self._depth > self.max_depth:
                self._refuse(f"nested deeper than {self.max_depth} levels", event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth = depth
        if getattr(event, "anchor", None) is not None:
            self._measures[id(node)] = (self._expanded - before, self._deepest - depth)
        self._deepest = max(outer_deepest, self._deepest)
        return node

    def fetch_flow_collection_start(self, TokenClass):
        # Refused while scanning: PyYAML's scanner looks ahead over open brackets (quadratic in their number).
        if self.flow_level >= self.max_depth:
            raise yaml.scanner.ScannerError(None, None, f"nested deeper than {self.max_depth} levels", self.get_mark())
        super().fetch_flow_collection_start(TokenClass)


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_constructor("!function", lambda loader, node: FunctionRef(loader.construct_scalar(node)))
_Dumper.add_representer(FunctionRef, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def load_yaml_text(text: str, path: Path | str) -> Any:
    """Parse one YAML document under the rules above; every failure is an InputError naming file and line."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise InputError(f"larger than {_size(MAX_FILE_BYTES)}; refused", file=str(path))
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "YAML"
        problem = getattr(error, "problem", None) or str(error)
        raise InputError(f"malformed YAML: {problem}", file=str(path), field=where) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as error:
        # A scalar the constructor cannot build: an integer of more than 4,300 digits, a date like 2024-13-45.
        raise InputError(f"malformed YAML value: {error}", file=str(path), field="YAML") from None
    _check_finite(data, path, "")
    return data


def _check_finite(value: Any, path: Path | str, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"must be a finite number (got {value})", file=str(path), field=where or "(top level)")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(key, path, where)
            _check_finite(item, path, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_finite(item, path, f"{where}[{index}]" if where else f"[{index}]")


def load_yaml_file(path: Path | str, *, what: str = "YAML", field: str | None = None, name: str | None = None) -> Any:
    """Read (bounded, UTF-8) and parse a user's YAML file; `name` is how errors call it (default: the path)."""
    name = str(path) if name is None else name
    return load_yaml_text(read_user_text(path, what=what, field=field, name=name), name)


def dump_yaml(value: Any) -> str:
    """YAML text that keeps `!function` tags as written (for task YAML handed to lm-eval)."""
    return yaml.dump(value, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)


# ---------------------------------------------------------------- typed documents


def parse_yaml_mapping(text: str, path: Path | str, what: str) -> dict:
    """The text's top-level mapping; malformed YAML is reported with the file and line number."""
    data = load_yaml_text(text, path)
    if not isinstance(data, dict):
        raise InputError(f"a {what} is a YAML mapping", file=path, field="(top level)")
    return data


def parse_yaml_model(text: str, path: Path | str, model: type[Model], what: str) -> Model:
    """Parse and validate; bad YAML, an unknown key or a wrong type is one InputError line."""
    try:
        return model.model_validate(parse_yaml_mapping(text, path, what))
    except ValidationError as error:
        raise from_validation_error(error, path) from None


def load_yaml_model(path: Path, model: type[Model], what: str) -> Model:
    return parse_yaml_model(read_user_text(path, what=what, field=what), path, model, what)
