"""Registry versions with a gate report and a signed promotion bundle, made without a gate run (no vLLM, no scoring):
what the MLflow export and mirror tests (unit and integration) mirror."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fakes import promote

from pipelines.evaluation.metrics import make_spec
from pipelines.files.hashing import file_hashes
from pipelines.gate.policy import DEFAULT_POLICY, load_policy
from pipelines.gate.schema import GateReport
from pipelines.gate.verdict import PairedItem, SetComparison, decide
from pipelines.registry.store import MANIFEST_FILES_KEY, NewVersion, Registry, Version


def comparison(name: str, lost: int, kl: float | None) -> SetComparison:
    items = [PairedItem(item_id=f"{name}{i}", baseline=1.0, candidate=0.0 if i < lost else 1.0, kl=kl) for i in range(200)]
    return SetComparison(eval_set=name, metric=make_spec("exact_match"), items=items, kl_method="top-20 logprobs" if kl is not None else None)


# tickets: 3 of 200 lost (delta -1.5 points, flip rate 0.015), KL measured; orders: none lost, KL not measured.
GATE_REPORT = GateReport(
    inputs={"artifact": {"hash": "abc"}},
    gate=decide([comparison("tickets", 3, 0.004), comparison("orders", 0, None)], load_policy(DEFAULT_POLICY), "w8a8"),
)


def make_candidate(root: Path, model: str = "demo-llama", weights: bytes = b"int8 weights",
                   registry: Registry | None = None) -> tuple[Registry, Version]:
    """A registered candidate: an artifact under root/run-<weights' hash>/, its gate.json and report.md beside it."""
    run = root / f"run-{hashlib.sha256(weights).hexdigest()[:16]}"
    artifact = run / "artifact"
    artifact.mkdir(parents=True)
    (artifact / "model.safetensors").write_bytes(weights)
    (artifact / "config.json").write_text("{}")
    (artifact / "manifest.json").write_text(json.dumps({MANIFEST_FILES_KEY: file_hashes(artifact)}))
    (run / "gate.json").write_text(GATE_REPORT.model_dump_json())
    (run / "report.md").write_text(f"# {model}: promoted\n")
    registry = registry if registry is not None else Registry(root / "registry.db")
    version = registry.register(NewVersion(
        source_model=model, source_hash="src", artifact_path=artifact, recipe_name="w8a8", recipe_hash="rh",
        gate_path=run / "gate.json",
    ))
    return registry, version


def make_promoted(root: Path, model: str = "demo-llama", weights: bytes = b"int8 weights",
                  registry: Registry | None = None) -> tuple[Registry, Version]:
    """make_candidate, promoted through the registry's one door (its bundle signed with a project key)."""
    registry, version = make_candidate(root, model, weights, registry)
    return registry, promote(registry, version, run_dir=Path(version.gate_path or "").parent)
