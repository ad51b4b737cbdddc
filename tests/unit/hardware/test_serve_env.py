"""The channel into the serve environment (pipelines/hardware/serve_env.py): the probe script's answer line is found by the
marker it prints. serve_probe.py runs in .venv-serve and imports nothing of ours (tests/unit/test_import_graph.py), so the
marker is spelled twice: this test pins that both spellings agree."""

from __future__ import annotations

import ast

from pipelines.hardware import serve_env


def _script_constant(name: str) -> str:
    tree = ast.parse(serve_env.PROBE_SCRIPT.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(target, ast.Name) and target.id == name for target in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    raise AssertionError(f"serve_probe.py defines no {name}")


def test_the_probe_prints_the_marker_the_channel_reads() -> None:
    assert _script_constant("MARKER") == serve_env.PROBE_MARKER



def test_a_cache_that_cannot_be_written_costs_nothing(tmp_path) -> None:
    taken = tmp_path / "host.json"
    taken.mkdir()  # the disk refuses the write (EISDIR), as a read-only or full one would
    serve_env.store_cache(taken, "{}")
    assert taken.is_dir()
