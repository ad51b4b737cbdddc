"""The product's one pydantic base: what a document or record may hold is its model's fields, nothing else.

StrictModel: an unknown key is an error (never silently dropped), a number must be finite (NaN and
infinity are refused, never compared), and a number or a flag must be written as one: pydantic's lax mode
would read `confidence: "0.95"` as 0.95 and `max_retries: true` as 1, so text or a boolean where a number
belongs, and anything but true/false where a flag belongs, is refused naming the field. FrozenModel: the
same, immutable once built (parsed inputs).
"""

from __future__ import annotations

import types
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

ScalarKind = Literal["number", "flag"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_and_flags_as_written(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, (str, int)) or info.field_name is None:  # bool is an int: checked below
            return value
        kind = scalar_kinds(cls).get(info.field_name)
        if kind == "number" and isinstance(value, (str, bool)):
            raise ValueError(f"must be a number, not {_shown(value)}")
        if kind == "flag" and not isinstance(value, bool):
            raise ValueError(f"must be true or false, not {_shown(value)}")
        return value


class FrozenModel(StrictModel):
    model_config = ConfigDict(frozen=True)


@cache
def scalar_kinds(model: type[BaseModel]) -> dict[str, ScalarKind]:
    """The fields of `model` that hold only numbers (int, float; or null) or only flags (bool; or null)."""
    kinds: dict[str, ScalarKind] = {}
    for name, field in model.model_fields.items():
        leaves = _leaf_types(field.annotation) - {type(None)}
        if leaves and leaves <= {int, float}:
            kinds[name] = "number"
        elif leaves == {bool}:
            kinds[name] = "flag"
    return kinds


def _leaf_types(annotation: Any) -> set[Any]:
    """The types a field's annotation admits at its top level, through Annotated and unions (`int | None`)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _leaf_types(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_leaf_types(arg) for arg in get_args(annotation)))
    return {annotation}


def _shown(value: str | int) -> str:
    if isinstance(value, bool):
        return "a boolean" + f" ({str(value).lower()})"
    if isinstance(value, str):
        return f"text ({value[:40]!r}{'...' if len(value) > 40 else ''}): write it without quotes"
    return f"the number {value}"
