"""The README and docs/ point at things that exist: every `pipelines/...` path, `python -m pipelines.x` module,
`docs/*.md` page, `quantize COMMAND` and `make TARGET` they name (a move or a rename that forgets a page fails here); their
```python blocks run (in a temporary folder, with a temporary registry), or, listed in ILLUSTRATIVE, call what exists as
it is called."""

from __future__ import annotations

import ast
import importlib
import inspect
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


# --- the pages' Python code blocks ----------------------------------------------------------------------------------

BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Blocks that sketch an API rather than run (placeholders, a model or a server they would need): each is still held to
# the package (tests below: its imports exist, its calls bind to the signatures). Keep this list short.
ILLUSTRATIVE: dict[tuple[str, int], str] = {
    ("planner.md", 0): "a signature sketch over the caller's config, recipe and KV space",
    ("registry.md", 0): "the verbs on a version a gate run made: an artifact, its gate.json and the run folder",
    ("serving.md", 0): "starts a vLLM server",
    ("serving.md", 1): "a job's settings",
}


def _blocks() -> list[tuple[str, int, str]]:
    return [(page.name, index, code) for page in PAGES for index, code in enumerate(BLOCK.findall(_text(page)))]


BLOCKS = _blocks()
RUNNABLE = [block for block in BLOCKS if block[:2] not in ILLUSTRATIVE]
SKETCHES = [block for block in BLOCKS if block[:2] in ILLUSTRATIVE]


def test_the_illustrative_list_names_blocks_that_exist() -> None:
    assert set(ILLUSTRATIVE) <= {block[:2] for block in BLOCKS}


@pytest.mark.parametrize(("page", "index", "code"), RUNNABLE, ids=[f"{page}-{index}" for page, index, _ in RUNNABLE])
def test_a_pages_python_block_runs(page: str, index: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))  # a registry or a run it makes is a temporary one
    monkeypatch.setenv("QUANTGATE_REGISTRY", str(tmp_path / "artifacts" / "registry.db"))
    exec(compile(code, f"{page} block {index}", "exec"), {"__name__": f"docs_{index}"})


def _imported(tree: ast.AST) -> dict[str, object]:
    """What the block's `from pipelines... import name` statements bind (an import that fails fails the test)."""
    names: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipelines":
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _instances(tree: ast.AST, names: dict[str, object]) -> dict[str, type]:
    """Names the block binds to an instance of an imported class (`registry = Registry()`)."""
    found: dict[str, type] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            made = names.get(node.value.func.id)
            if inspect.isclass(made):
                found.update({target.id: made for target in node.targets if isinstance(target, ast.Name)})
    return found


def _call_problems(code: str) -> list[str]:
    """Each call of an imported function or class, or of a method on an instance of an imported class, that does not bind
    to its signature (an unknown keyword, too many arguments, a method that does not exist)."""
    tree = ast.parse(code)
    names = _imported(tree)
    instances = _instances(tree, names)
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(isinstance(arg, ast.Starred) for arg in node.args):
            continue
        func, receiver = node.func, []
        if isinstance(func, ast.Name) and func.id in names:
            target, shown = names[func.id], func.id
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in instances:
            owner = instances[func.value.id]
            shown = f"{owner.__name__}.{func.attr}"
            if not hasattr(owner, func.attr):
                problems.append(f"{shown} does not exist")
                continue
            target, receiver = getattr(owner, func.attr), [None]
        else:
            continue
        try:
            signature = inspect.signature(target)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(*receiver, *[None] * len(node.args), **{keyword.arg: None for keyword in node.keywords if keyword.arg})
        except TypeError as error:
            problems.append(f"{shown}(...): {error}")
    return problems


@pytest.mark.parametrize(("page", "index", "code"), SKETCHES, ids=[f"{page}-{index}" for page, index, _ in SKETCHES])
def test_an_illustrative_block_calls_what_exists_as_it_is_called(page: str, index: int, code: str) -> None:
    assert _call_problems(code) == [], f"{page} block {index} ({ILLUSTRATIVE[page, index]})"


def test_a_sketch_calling_a_verb_with_a_keyword_it_lost_is_caught() -> None:
    stale = "from pipelines.registry.store import Registry\nregistry = Registry()\nregistry.promote(version.id, 'gate passed', evidence=...)\n"
    assert any("Registry.promote" in problem for problem in _call_problems(stale))
