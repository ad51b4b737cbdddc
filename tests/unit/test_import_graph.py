"""The package's import graph has no circles and no arrow back up to a package that holds the importer.

Every import counts: at the top of a module, inside a function (a lazy import hides a circle, it does not
remove it) and under TYPE_CHECKING. The graph is read from the source with ast; nothing is imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pipelines"


def module_files(package: Path) -> dict[str, Path]:
    files = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` names, or the nearest package above it that is one of ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The modules of ours one import statement loads: `from pkg import sub` loads pkg.sub, `from pkg.mod import name` pkg.mod."""
    if isinstance(node, ast.Import):
        named = [_known(alias.name, modules) for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known(base, modules) for alias in node.names]
    return {name for name in named if name}


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_files(package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                targets |= _targets(node, module, path.name == "__init__.py", modules)
        graph[module] = targets - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """A module importing a package that contains it (its __init__ imports the package's modules)."""
    return sorted((source, target) for source, targets in graph.items() for target in targets if source.startswith(target + "."))


def test_the_package_has_no_import_circles() -> None:
    assert circles(import_graph(PACKAGE)) == []


def test_no_module_imports_a_package_above_it() -> None:
    assert upward_arrows(import_graph(PACKAGE)) == []


def test_the_graph_is_read_whole() -> None:
    graph = import_graph(PACKAGE)
    assert {"pipelines.cli", "pipelines.runs.runner", "pipelines.planner.plan", "pipelines.repair.session"} <= graph.keys()
    assert "pipelines.quantize.compiler" in graph["pipelines.planner.plan"]
    assert "pipelines.planner" in graph["pipelines.commands.plan"]  # `from pipelines.planner import ...`


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg.a import x\n"}, [["pkg.a", "pkg.b"]]),
        ({"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n", "b.py": "import pkg.a\n"}, [["pkg.a", "pkg.b"]]),
        ({"a.py": "from . import b\n", "b.py": "from .c import y\n", "c.py": "from pkg.a import z\n"}, [["pkg.a", "pkg.b", "pkg.c"]]),
        ({"a.py": "from pkg import b\n", "b.py": "import json\n"}, []),
    ],
)
def test_a_circle_is_found_however_it_is_imported(tmp_path: Path, files: dict[str, str], expected: list[list[str]]) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in files.items():
        (package / name).write_text(text)
    assert circles(import_graph(package)) == expected


def test_an_arrow_to_the_package_above_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from pkg.sub.leaf import x\n")
    (package / "leaf.py").write_text("from pkg.sub import y\n")
    assert upward_arrows(import_graph(tmp_path / "pkg")) == [("pkg.sub.leaf", "pkg.sub")]


# --- floors: which room may import which -------------------------------------------------------------------------------
# A room is a subpackage of pipelines/ or a module at its root. A room imports only rooms on lower floors (or its own):
# the house is read bottom up, and a new room says where it stands here. Bottom first.
FLOORS: list[set[str]] = [
    {"errors", "schema", "settings"},
    {"bounds", "console", "files", "paths"},
    {"artifact", "recipe"},
    {"hardware", "models"},
    {"serve"},
    {"evaluation"},
    {"canary"},  # the golden set's distance is the divergence stage's coarse KL; runs, watch and fleet probe with it
    {"demo", "quantize"},
    {"planner"},
    {"loadtest"},
    {"gate"},
    {"registry"},
    {"reports"},  # the HTML pages of runs and models (a repair's is the repair's own); the runner writes report.html
    {"runs"},
    {"repair"},
    {"benchmarks"},  # figures of whole stages: the repair's sensitivity pass among them (cuda_check)
    {"jobs"},
    {"bakeoff"},  # one intent through every quantize backend: its rows run through the runner
    {"deploy"},  # the served spec, its envelope and the limits derived from it; the files that carry them
    {"watch"},  # holds a server to its deployment's limits
    {"fleet"},
    {"commands", "cli"},
]


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(package)"


def floor_of(name: str) -> int:
    return next(level for level, rooms in enumerate(FLOORS) if name in rooms)


def test_every_room_has_a_floor() -> None:
    rooms = {room(module) for module in import_graph(PACKAGE)} - {"(package)"}
    assert rooms <= set().union(*FLOORS), f"rooms without a floor (add them to FLOORS): {sorted(rooms - set().union(*FLOORS))}"


def test_no_room_imports_a_room_on_a_higher_floor() -> None:
    graph = import_graph(PACKAGE)
    upward = sorted(
        (source, target) for source, targets in graph.items() for target in targets
        if room(source) != "(package)" and room(target) != "(package)" and room(source) != room(target)
        and floor_of(room(target)) > floor_of(room(source))
    )
    assert upward == [], f"imports up the floors: {upward}"


def test_the_root_holds_few_modules() -> None:
    root = [path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"]
    assert len(root) <= 12, root


def test_every_command_loads_without_the_model_libraries() -> None:
    """`quantize --help` and every refusal of bad input stay light (the fuzz tests hold a 200 MB peak): torch,
    transformers and llm-compressor are imported by the work that needs them, never by loading a command."""
    probe = (
        "import sys\nfrom pipelines import cli\nfor name in cli.COMMANDS: cli.load_command(name)\n"
        "print(' '.join(m for m in ('torch', 'transformers', 'llmcompressor', 'datasets', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True, cwd=PACKAGE.parent)
    assert result.stdout.strip() == "", result.stdout


def test_the_serve_probe_imports_nothing_of_ours() -> None:
    """pipelines/hardware/serve_probe.py runs as a script in the serve environment (.venv-serve: vLLM's pins), where the
    project is not installed: an import of ours there fails on the user's machine, not here."""
    ours = import_graph(PACKAGE)["pipelines.hardware.serve_probe"]
    assert ours == set(), f"serve_probe.py imports {sorted(ours)}"
