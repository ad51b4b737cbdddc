"""Which --out folder `serve export` may replace: only one it wrote itself, exactly as it wrote it.

kustomization.yaml, app.yaml and overlays/ are names users give their own files, so no file name marks an earlier
export. The export writes a marker, quantgate-export.json, holding `written_by` and the sha256 of every file it wrote;
an existing --out is replaced only when it is empty, or holds that marker and nothing else but those files with those
hashes. A folder with anything the export did not write (a file of the user's, a manifest edited since, a link, a
sub-folder) or without the marker is refused with one line: nothing deletes a file it did not write.
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

from pipelines.errors import InputError
from pipelines.files.jsonio import parse_json_strict
from pipelines.files.run_input import read_regular

MARKER = "quantgate-export.json"
WRITTEN_BY = "quantize serve export"
MAX_EXPORT_FILE_BYTES = 16 * 1024 * 1024  # a manifest is kilobytes; the proxy's ConfigMap the largest
MAX_EXPORT_FILES = 1000


def marker_document(files: dict[str, str]) -> str:
    """The marker's text for an export of `files` (name -> its text)."""
    hashes = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(files.items())}
    return json.dumps({"written_by": WRITTEN_BY, "files": hashes}, indent=2) + "\n"


def check_out(out: Path) -> None:
    """Nothing when `out` is new, empty or an earlier export left as written; an InputError (one line) otherwise."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise InputError("exists and is not a folder (or is a link): choose a new folder", file=out, field="--out")
    names = {path.name for path in out.iterdir()}
    if not names:
        return
    if MARKER not in names:
        raise InputError(f"is not empty and is not an earlier export (no {MARKER}): nothing there is replaced; choose a new folder",
                         file=out, field="--out")
    written = _written_files(out / MARKER)
    for name in sorted(names - {MARKER}):
        problem = "not written by the export" if name not in written else _changed(out / name, written[name])
        if problem:
            raise InputError(f"an earlier export holding {name[:80]!r}, {problem}: nothing there is replaced; move it or choose a new folder",
                             file=out, field="--out")


def _written_files(marker: Path) -> dict[str, str]:
    document: Any = parse_json_strict(read_regular(marker, "export marker", MAX_EXPORT_FILE_BYTES), marker)
    files = document.get("files") if isinstance(document, dict) and document.get("written_by") == WRITTEN_BY else None
    if not isinstance(files, dict) or len(files) > MAX_EXPORT_FILES or not all(isinstance(value, str) for value in files.values()):
        raise InputError(f"{MARKER} is not a marker `{WRITTEN_BY}` wrote: nothing there is replaced; choose a new folder", file=marker,
                         field="--out")
    return files


def _changed(path: Path, digest: str) -> str | None:
    """Why the file at `path` is no longer the one the export wrote with `digest`, or None when it is."""
    if not stat.S_ISREG(path.lstat().st_mode):
        return "not a regular file (a link, a folder, a FIFO)"
    if path.lstat().st_size > MAX_EXPORT_FILE_BYTES:
        return "larger than any file the export writes"
    if hashlib.sha256(read_regular(path, "exported file", MAX_EXPORT_FILE_BYTES)).hexdigest() != digest:
        return "changed since the export wrote it"
    return None
