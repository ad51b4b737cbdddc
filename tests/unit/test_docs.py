"""The README and docs/ point at things that exist: every `pipelines/...` path, `python -m pipelines.x` module,
`docs/*.md` page, `quantize COMMAND` and `make TARGET` they name (a move or a rename that forgets a page fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelines.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "eval_sets" / "README.md"]
# What the product ships (recipes/ and eval_sets/ paths in the pages are often a user's examples).
PATH = re.compile(r"(?<![\w./-])((?:pipelines|docs|scripts|tests)/[\w./-]*[\w/])")
MODULE = re.compile(r"python -m (pipelines(?:\.\w+)+)")
COMMAND = re.compile(r"`(?:\.venv/bin/)?quantize ([a-z][a-z-]*)")
MAKE = re.compile(r"`make ([a-z][a-z-]*)")
TARGETS = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_path_a_page_names_exists(page: Path) -> None:
    missing = []
    for path in PATH.findall(_text(page)):
        if any(mark in path for mark in ("<", "*", "...")) or path.endswith("/X") or re.search(r"/[A-Z]+(\.|$)", path):
            continue  # a pattern or a placeholder, not a path
        if not (ROOT / path).exists() and not (ROOT / path.rstrip(".")).exists():
            missing.append(path)
    assert not missing, f"{page.name} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_module_command_and_make_target_a_page_names_exists(page: Path) -> None:
    text = _text(page)
    modules = [m for m in MODULE.findall(text) if not (ROOT / (m.replace(".", "/") + ".py")).exists()
               and not (ROOT / m.replace(".", "/") / "__main__.py").exists()]
    commands = [c for c in COMMAND.findall(text) if c not in COMMANDS]
    targets = [t for t in MAKE.findall(text) if t not in TARGETS]
    assert (modules, commands, targets) == ([], [], []), f"{page.name}: unknown modules, commands or make targets"


def test_the_readme_is_a_users_page() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 15_000
