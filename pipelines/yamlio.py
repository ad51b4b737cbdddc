"""Reading the YAML files users write (recipes, policies, job files) into validated pydantic models."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pipelines.errors import InputError, from_validation_error

Model = TypeVar("Model", bound=BaseModel)


def parse_yaml_mapping(text: str, path: Path | str, what: str) -> dict:
    """The text's top-level mapping; malformed YAML is reported with the file and line number."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "YAML"
        raise InputError(f"malformed YAML: {getattr(error, 'problem', None) or error}", file=path, field=where) from None
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
    if not path.is_file():
        raise InputError(f"no such {what} file", file=path, field=what)
    return parse_yaml_model(path.read_text(), path, model, what)
