"""Content hashes: the identity of models, artifacts, eval sets and cached results."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipelines.errors import InputError

_CHUNK = 1 << 20


def sha256_file(path: Path, *, size: int | None = None) -> str:
    """sha256 of the file's bytes. With `size` (what a record says the file holds, its size already compared), at most
    size + 1 bytes are read: a file that grew past it meanwhile is refused, never hashed to its end."""
    digest = hashlib.sha256()
    left = None if size is None else size + 1
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK if left is None else min(_CHUNK, left)):
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
                if left == 0:
                    raise InputError(f"file grew past its recorded {size} bytes while it was read", file=path)
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
