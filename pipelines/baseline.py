"""Scores of a model served by vLLM, per eval set, with a content-addressed cache for the 16-bit baseline.

A cache entry is keyed by the model's content hash, the eval set's hash, the serve settings and the
library versions (vLLM, lm-eval, the KL method): a second run with the same inputs does not start the
baseline server at all.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

from pydantic import BaseModel, ValidationError

from pipelines.atomic import write_json_atomic
from pipelines.divergence import KL_METHOD, Reference
from pipelines.evaluate import SetScore
from pipelines.evalsets import EvalSet
from pipelines.hashing import sha256_json
from pipelines.paths import ARTIFACTS_DIR
from pipelines.serving import ServeSettings, serve_versions

BASELINE_CACHE_DIR = ARTIFACTS_DIR / "cache" / "baseline"


class BaselineEntry(BaseModel):
    key: str
    model_hash: str
    score: SetScore
    references: list[Reference]


def cache_key(model_hash: str, eval_set: EvalSet, settings: ServeSettings) -> str:
    return sha256_json(
        {
            "model": model_hash,
            "eval_set": eval_set.sha256,
            "serve": settings.cache_fields(),
            "versions": {**serve_versions(), "lm-eval": version("lm-eval")},
            "kl": KL_METHOD,
        }
    )


def _entry_path(key: str, cache_dir: Path) -> Path:
    return cache_dir / f"{key}.json"


def load_cached(key: str, cache_dir: Path = BASELINE_CACHE_DIR) -> BaselineEntry | None:
    path = _entry_path(key, cache_dir)
    if not path.is_file():
        return None
    try:
        return BaselineEntry.model_validate_json(path.read_text())
    except (ValidationError, json.JSONDecodeError):
        return None  # a corrupt entry is recomputed, never trusted


def store(entry: BaselineEntry, cache_dir: Path = BASELINE_CACHE_DIR) -> None:
    write_json_atomic(_entry_path(entry.key, cache_dir), entry.model_dump(mode="json"))
