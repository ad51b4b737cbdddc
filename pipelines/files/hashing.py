"""Content hashes: the identity of models, artifacts, eval sets and cached results."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(folder: Path, *, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file below folder, keyed by its relative posix path, in sorted order."""
    return {
        path.relative_to(folder).as_posix(): sha256_file(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.relative_to(folder).as_posix() not in exclude
    }


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_json(value: Any) -> str:
    """A stable hash of a JSON-serialisable value (keys sorted)."""
    return sha256_text(json.dumps(value, sort_keys=True, default=str))


def folder_hash(folder: Path, *, exclude: tuple[str, ...] = ()) -> str:
    return sha256_json(file_hashes(folder, exclude=exclude))
