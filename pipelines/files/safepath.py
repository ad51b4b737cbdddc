"""The one place where a name becomes a path: safe components and the `inside` check before writing.

Names that end up in a path (a recipe name from `gate --recipe-name` or from a third-party manifest.json,
a model folder's name, a run id, a job's name) are REFUSED, not mapped, when they are not a safe
component: InputError naming the field (and the file the name came from). Refusing rather than mapping
because these names are identities: a run id is quoted in reports, an artifact folder is content
addressed under `candidates/<model>/<recipe>-<hash>/`, and the registry records the model name. A
mapping (`a/b` -> `a_b`, `ɑ` -> `a`) would make different inputs collide on one folder and make the
name on disk differ from the name in the evidence, silently; a refusal costs one rename and says which.

A safe component is ASCII letters, digits, '.', '_' and '-', 1 to MAX_COMPONENT characters, with no
leading '.' (so neither '.', '..' nor hidden names). Everything else is refused: '/', '\\', NUL and
other control characters, spaces, and every non-ASCII character (unicode lookalikes of '.' and '/').

Paths read from a manifest (its `artifact_files` keys) are relative paths of such-or-looser components
(`safe_relative`): never absolute, never '..', never NUL or a backslash.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from pipelines.errors import InputError

MAX_COMPONENT = 100
_SAFE = re.compile(r"[A-Za-z0-9._-]+")


def safe_component(name: object, field: str, *, file: str | Path | None = None, max_length: int = MAX_COMPONENT) -> str:
    """`name` itself when it is a safe path component; InputError naming `field` (and `file`) otherwise."""
    problem = component_problem(name, max_length)
    if problem is not None:
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:77] + "...")
        raise InputError(
            f"{shown} cannot be used in a path: {problem} (allowed: letters, digits, '.', '_', '-';"
            f" not starting with '.'; at most {max_length} characters)",
            file=file, field=field,
        )
    return name  # type: ignore[return-value]


def component_problem(name: object, max_length: int = MAX_COMPONENT) -> str | None:
    """Why `name` is not a safe component, or None when it is."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name:
        return "empty"
    if len(name) > max_length:
        return f"{len(name)} characters"
    if name in (".", ".."):
        return "a relative folder reference"
    if name.startswith("."):
        return "starts with '.'"
    if not _SAFE.fullmatch(name):
        bad = next(c for c in name if not _SAFE.fullmatch(c))
        return f"contains {bad!r} (U+{ord(bad):04X})"
    return None


def safe_relative(relative: object, field: str, *, file: str | Path | None = None) -> str:
    """A relative posix path read from a file (a manifest key): no absolute path, '..', NUL or backslash."""
    if not isinstance(relative, str) or not relative:
        raise InputError(f"{relative!r} is not a relative file path", file=file, field=field)
    parts = relative.split("/")
    if (
        relative.startswith("/")
        or "\\" in relative
        or any(ord(c) < 32 or c == "\x7f" for c in relative)
        or any(part in ("", ".", "..") for part in parts)
        or len(relative) > 4096
    ):
        shown = relative if len(relative) <= 80 else relative[:77] + "..."
        raise InputError(f"{shown!r} is not a plain relative file path (absolute, '..', empty part, control character or backslash)",
                         file=file, field=field)
    return relative


def inside(root: Path | str, path: Path | str) -> bool:
    """Whether `path` is `root` or below it once both are resolved (symbolic links followed, '..' folded)."""
    try:
        root_resolved = Path(os.path.realpath(root))
        path_resolved = Path(os.path.realpath(path))
    except (ValueError, OSError):  # NUL in the path, a symlink loop
        return False
    return path_resolved == root_resolved or root_resolved in path_resolved.parents


def ensure_inside(root: Path | str, path: Path | str, field: str) -> Path:
    """`path` when it stays inside `root` (checked before anything is written there); InputError otherwise."""
    if not inside(root, path):
        raise InputError(f"refusing to write outside {root}: {str(path)!r}", file=root, field=field)
    return Path(path)


def own_regular_file(path: Path, where: str) -> os.stat_result:
    """The lstat of a regular file that has no other name: a symbolic link, a hard link (another name anywhere on the
    disk, whose owner could change these bytes later, unseen), or anything but a regular file is an InputError."""
    status = path.lstat()
    if stat.S_ISLNK(status.st_mode):
        raise InputError(f"a symbolic link in {where}: its files must be its own", file=path)
    if not stat.S_ISREG(status.st_mode):
        raise InputError(f"not a regular file, in {where}", file=path)
    if status.st_nlink > 1:
        raise InputError(f"a hard link ({status.st_nlink} names for these bytes) in {where}: its files must be its own copies", file=path)
    return status
