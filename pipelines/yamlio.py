"""Reading the YAML files users write (recipes, policies, job files) into validated pydantic models."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pipelines.errors import InputError, from_validation_error

Model = TypeVar("Model", bound=BaseModel)


def read_yaml_mapping(path: Path, what: str) -> dict:
    """The file's top-level mapping; malformed YAML is reported with its line number."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "YAML"
        raise InputError(f"malformed YAML: {getattr(error, 'problem', error)}", file=path, field=where) from None
    if not isinstance(data, dict):
        raise InputError(f"a {what} is a YAML mapping", file=path, field="(top level)")
    return data


def load_yaml_model(path: Path, model: type[Model], what: str) -> Model:
    """Parse and validate; a missing file, bad YAML, unknown key or wrong type is one InputError line."""
    if not path.is_file():
        raise InputError(f"no such {what} file", file=path, field=what)
    try:
        return model.model_validate(read_yaml_mapping(path, what))
    except ValidationError as error:
        raise from_validation_error(error, path) from None
