"""Fakes shared by the unit tests: real files in tmp folders, validated by the product's own code."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.evalsets import EvalSet, validate_eval_set

N_ITEMS = 120


def make_eval_set(root: Path, name: str = "tickets", answers: str = "abc", items: int = N_ITEMS) -> EvalSet:
    """A real eval set folder (task YAML, data, a `!function` helper), validated by pipelines.evalsets."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
    )
    (folder / "data.jsonl").write_text("".join(json.dumps({"q": f"q{i}", "a": answers}) + "\n" for i in range(items)))
    (folder / "utils.py").write_text("def process(doc):\n    return doc\n")
    return validate_eval_set(folder)
