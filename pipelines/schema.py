"""The product's one pydantic base: what a document or record may hold is its model's fields, nothing else.

StrictModel: an unknown key is an error (never silently dropped) and a number must be finite (NaN and
infinity are refused, never compared). FrozenModel: the same, immutable once built (parsed inputs).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FrozenModel(StrictModel):
    model_config = ConfigDict(frozen=True)
