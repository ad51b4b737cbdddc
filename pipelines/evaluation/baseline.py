"""Per-set results of a served model, cached by content: the 16-bit baseline's and each candidate's.

A baseline entry (scores + the KL reference paths) is keyed by the model's content hash, every file
of the eval set's folder (task YAML, data, `!function` helpers), the serve settings, the lm-eval
arguments, the versions of vLLM, lm-eval, datasets and transformers, the host class and serve dtype,
SCORING_VERSION and the KL method. A candidate entry (scores + per-item KL) is keyed the same way on the artifact's content
hash, plus the baseline entry it was measured against. A repeat entry (the baseline scored a second time, for the
noise floor) is keyed on the baseline entry it repeats. A rerun with the same inputs starts no server.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import TypeVar, overload

from pydantic import BaseModel, ValidationError

from pipelines.evaluation.divergence import KL_METHOD, Reference
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import SetScore, lm_eval_command
from pipelines.files.atomic import write_json_atomic
from pipelines.files.hashing import folder_hash, sha256_json
from pipelines.hardware.targets import host_record
from pipelines.serve.serving import RunningServer, ServeSettings, serve_versions

# Bump when the scoring code (evaluate, divergence, pairing of items) changes what a cached entry means.
SCORING_VERSION = 2
PROJECT_PACKAGES = ("lm-eval", "datasets", "transformers")


class BaselineEntry(BaseModel):
    key: str
    model_hash: str
    score: SetScore
    references: list[Reference]


class RepeatEntry(BaseModel):
    """The baseline's second scoring on the same runtime (the policy's noise_floor: pipelines.gate.noise)."""

    key: str
    model_hash: str
    score: SetScore
    first_key: str  # the BaselineEntry it repeats


class CandidateEntry(BaseModel):
    key: str
    model_hash: str
    score: SetScore
    kl_by_doc: dict[int, float | None]


Entry = TypeVar("Entry", BaselineEntry, CandidateEntry, RepeatEntry)


def lm_eval_arguments() -> list[str]:
    """lm-eval's command line with placeholders for the server, paths and tasks: any other argument is keyed."""
    server = RunningServer.model_construct(
        model_dir=Path("model"), served_name="model", port=0, log_path=Path("log"), process=None,  # type: ignore[arg-type]  # no process: only the name, URL and timeout reach the command
        startup_s=0.0,
        request_timeout_s=0.0,
    )
    command = lm_eval_command(server, Path("tokenizer"), ["task"], Path("tasks"), Path("output"))
    return command[1:]  # [0] is this interpreter's path


def project_versions() -> dict[str, str]:
    return {package: version(package) for package in PROJECT_PACKAGES}


def runtime_key() -> dict[str, str]:
    """What of the host decides the numbers a server computes: its class (the ISA vLLM's library is built for) and the
    serve dtype. Scores from another host class, an emulated one included, are never reused."""
    host = host_record()
    return {"host_class": str(host["host_class"]), "library": str(host.get("library", "")), "serve_dtype": str(host.get("serve_dtype", ""))}


def cache_key(model_hash: str, eval_set: EvalSet, settings: ServeSettings) -> str:
    return sha256_json(
        {
            "model": model_hash,
            "eval_set": folder_hash(eval_set.folder),
            "serve": settings.cache_fields(),
            "lm_eval": lm_eval_arguments(),
            "versions": {**serve_versions(), **project_versions()},
            "runtime": runtime_key(),
            "scoring": SCORING_VERSION,
            "kl": KL_METHOD,
        }
    )


def candidate_key(artifact_hash: str, eval_set: EvalSet, settings: ServeSettings, baseline: BaselineEntry) -> str:
    """KL is measured along the baseline's reference paths: a re-scored baseline is a new candidate key."""
    return sha256_json(
        {
            "candidate": cache_key(artifact_hash, eval_set, settings),
            "baseline": baseline.key,
            "references": sha256_json([reference.model_dump(mode="json") for reference in baseline.references]),
        }
    )


def repeat_key(first_key: str) -> str:
    """The second scoring of a cached baseline: its own entry, keyed on the first's key (its inputs, runtime included)."""
    return sha256_json({"repeat_of": first_key, "pass": 2})


def _entry_path(key: str, cache_dir: Path) -> Path:
    return cache_dir / f"{key}.json"


@overload
def load_cached(key: str, cache_dir: Path) -> BaselineEntry | None: ...
@overload
def load_cached(key: str, cache_dir: Path, entry_type: type[Entry]) -> Entry | None: ...
def load_cached(key: str, cache_dir: Path, entry_type: type[BaseModel] = BaselineEntry) -> BaseModel | None:
    """The cached entry under `key`, or None (none, or a corrupt one: recomputed, never trusted)."""
    path = _entry_path(key, cache_dir)
    if not path.is_file():
        return None
    try:
        return entry_type.model_validate_json(path.read_text())
    except (ValidationError, json.JSONDecodeError):
        return None


def store(entry: BaselineEntry | CandidateEntry | RepeatEntry, cache_dir: Path) -> None:
    write_json_atomic(_entry_path(entry.key, cache_dir), entry.model_dump(mode="json"))
