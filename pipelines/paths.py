"""Where things live. Everything is relative to the repository root unless overridden by environment."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(os.environ.get("QUANTGATE_ROOT", Path(__file__).resolve().parent.parent))
RECIPES_DIR = REPO_ROOT / "recipes"
EVAL_SETS_DIR = REPO_ROOT / "eval_sets"
MODELS_DIR = REPO_ROOT / "models"
DEMO_MODEL_DIR = MODELS_DIR / "demo-llama"
# The demo model's business sets (eval_sets/ also holds the real model's): demo runs select these.
DEMO_EVAL_SETS = ("ticket_routing", "payment_reference", "date_normalisation")
ARTIFACTS_DIR = Path(os.environ.get("QUANTGATE_ARTIFACTS", REPO_ROOT / "artifacts"))
SERVE_VENV = Path(os.environ.get("QUANTGATE_SERVE_VENV", REPO_ROOT / ".venv-serve"))
SERVE_PYTHON = SERVE_VENV / "bin" / "python"
