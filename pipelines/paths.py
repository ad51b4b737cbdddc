"""Where things live: the folders of pipelines.settings under the names the modules import.

Every name is computed from the environment when it is looked up (PEP 562 module __getattr__), not when
this module is imported: `paths.ARTIFACTS_DIR` follows QUANTGATE_ARTIFACTS set at any time. A module that
does `from pipelines.paths import X` holds the value of its own import time; code that must follow the
environment at run time calls `settings.current()`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipelines.settings import Settings, current

DEMO_MODEL_NAME = "demo-llama"
# The demo model's business sets (eval_sets/ also holds the real model's): demo runs select these.
DEMO_EVAL_SETS = ("ticket_routing", "payment_reference", "date_normalisation")

_FOLDERS: dict[str, Callable[[Settings], Path]] = {
    "REPO_ROOT": lambda s: s.root,
    "RECIPES_DIR": lambda s: s.root / "recipes",
    "EVAL_SETS_DIR": lambda s: s.eval_sets_dir,
    "MODELS_DIR": lambda s: s.root / "models",
    "DEMO_MODEL_DIR": lambda s: s.root / "models" / DEMO_MODEL_NAME,
    "ARTIFACTS_DIR": lambda s: s.artifacts_dir,
    "SERVE_VENV": lambda s: s.serve_venv_dir,
    "SERVE_PYTHON": lambda s: s.serve_python,
}

def __getattr__(name: str) -> Path:
    if name in _FOLDERS:
        return _FOLDERS[name](current())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
