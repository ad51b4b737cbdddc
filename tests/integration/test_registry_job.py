"""The registry job end to end: the demo model x the four shipped recipes, killed midway (SIGTERM while
the second candidate is being scored), resumed to the end, then rerun to show it does nothing.

It shares the session's artifacts root with test_pipeline.py: the w8a8 and aggressive artifacts and the
baseline's scores are reused from their caches. To keep it to a few minutes it gates on one set the
aggressive recipe failed on (one that tells the recipes apart). Each recipe's run serves its artifact on
vLLM and scores it, which is also the check that vLLM loads and answers every shipped recipe's artifact.
The job's policy is the default one with the load test off (`performance: {enabled: false}`): it would start
the baseline server again for every promoted candidate, minutes of CI for what tests/integration/test_loadtest_e2e.py
already checks on the session's w8a8 run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import INT4_WEIGHT_ONLY, NEGATIVE_CONTROL

from pipelines.gate.policy import DEFAULT_POLICY
from pipelines.paths import DEMO_MODEL_DIR

pytestmark = pytest.mark.integration

# Where vLLM has a 4-bit weight-only kernel, the four shipped recipes; on an AVX2 host (none there, test_hardware_e2e.py)
# the ones it serves: w8a8, an int8 recipe with dynamic activations written for the job (so that its second candidate is
# scored, not found cached, when the job is killed), and the W4A8 negative control.
INT8_DYNAMIC = "int8-dynamic"
RECIPES = ("w8a8", "w4a16", "gptq", "aggressive") if INT4_WEIGHT_ONLY else ("w8a8", INT8_DYNAMIC, NEGATIVE_CONTROL)
EXPECTED = {"w8a8": "promoted", "w4a16": "promoted", "gptq": "promoted", INT8_DYNAMIC: "promoted", NEGATIVE_CONTROL: "rejected"}
EXPECTED = {name: EXPECTED[name] for name in RECIPES}
INT8_DYNAMIC_RECIPE = (
    f"name: {INT8_DYNAMIC}\nalgorithm: {{method: rtn}}\ngroups:\n"
    + "".join(f"  {group}:\n    weights: {{bits: 8, granularity: channel}}\n    activations: {{bits: 8, granularity: token, dynamic: true}}\n"
              for group in ("attention", "mlp"))
)


@pytest.fixture(scope="module")
def job_file(workspace, aggressive_run) -> Path:
    assert aggressive_run.code == 1, aggressive_run.describe()
    report = json.loads(Path(aggressive_run.json["gate_json"]).read_text())
    deciding = [s["eval_set"] for s in report["gate"]["sets"] if not s["passed"]]
    policy = workspace.root / "job-policy.yaml"
    policy.write_text(DEFAULT_POLICY.read_text().replace("performance:\n  enabled: true", "performance:\n  enabled: false"))
    (workspace.root / f"{INT8_DYNAMIC}.yaml").write_text(INT8_DYNAMIC_RECIPE)
    recipes = [str(workspace.root / f"{name}.yaml") if name == INT8_DYNAMIC else name for name in RECIPES]
    path = workspace.root / "demo-job.yaml"
    path.write_text(
        "name: integration-demo\n"
        f"registry: {workspace.registry_path}\n"
        f"defaults:\n  eval_sets: [{deciding[0]}]\n  policy: {policy}\n"
        f"candidates:\n  - model: {DEMO_MODEL_DIR}\n    recipes: [{', '.join(recipes)}]\n"
    )
    return path


def _second_candidate_is_being_scored(stderr: str) -> bool:
    """The second candidate's server is up (its start-up progress line ended) and lm-eval is scoring."""
    second = stderr.find("[2/")
    return second >= 0 and "starting vLLM (candidate): done" in stderr[second:] and "scoring " in stderr[second:]


@pytest.fixture(scope="module")
def killed_job(workspace, job_file: Path):
    """The job terminated (SIGTERM) while the second candidate's vLLM server is up and lm-eval is scoring."""
    return workspace.quantize("job", str(job_file), "--json", terminate_when=_second_candidate_is_being_scored)


@pytest.fixture(scope="module")
def job_run(workspace, job_file: Path, killed_job):
    """The same job run again after the kill: it must resume, not redo the candidate already decided."""
    return workspace.quantize("job", str(job_file), "--json")


@pytest.fixture(scope="module")
def job_rerun(workspace, job_file: Path, job_run):
    return workspace.quantize("job", str(job_file), "--json")


def test_killing_the_job_midway_leaves_nothing_half_written(workspace, killed_job, no_process_left):
    assert killed_job.code == 2, killed_job.describe()
    assert "interrupted" in killed_job.stderr
    no_process_left(killed_job)
    assert not [str(p) for p in workspace.artifacts.rglob(".*.tmp*")], "no temporary folder may be left"
    # The first candidate may finish within the second (its scores are cached), so runs are found by kind.
    failed = [run for run in killed_job.new_runs if run.name.endswith("-error")]
    complete = [run for run in killed_job.new_runs if not run.name.endswith("-error")]
    assert len(failed) == 1 and len(complete) == 1, killed_job.new_runs
    first, second = complete[0], failed[0]
    assert (first / "gate.json").is_file() and f"-{RECIPES[0]}-" in first.name, killed_job.new_runs
    assert not (second / "gate.json").exists()
    ledger = json.loads((workspace.artifacts / "jobs" / "integration-demo.json").read_text())
    assert [entry["recipe"] for entry in ledger["decided"].values()] == [RECIPES[0]]
    killed_runs = {path.resolve() for path in killed_job.new_runs}
    registered = {v.recipe_name for v in workspace.registry().list() if v.gate_path and Path(v.gate_path).resolve().parent in killed_runs}
    assert registered == {RECIPES[0]}, "the interrupted candidate must not reach the registry"


def test_the_resumed_job_promotes_and_rejects_as_expected(workspace, job_run, no_process_left):
    assert job_run.code == 0, job_run.describe()
    summary = job_run.json
    assert summary["exit_code"] == 0
    assert {Path(r["recipe"]).stem: r["status"] for r in summary["results"]} == EXPECTED, summary["results"]
    assert {Path(r["recipe"]).stem: r["skipped"] for r in summary["results"]} == {name: name == RECIPES[0] for name in RECIPES}
    registry = workspace.registry()
    for result in summary["results"]:
        version = registry.show(DEMO_MODEL_DIR.name, result["registry_version"])
        assert (version.recipe_name, version.status) == (Path(result["recipe"]).stem, result["status"])
        assert (Path(result["run_dir"]) in job_run.new_runs) == (not result["skipped"])
    assert len(job_run.new_runs) == len(RECIPES) - 1
    ledger = json.loads((workspace.artifacts / "jobs" / "integration-demo.json").read_text())
    assert sorted(entry["status"] for entry in ledger["decided"].values()) == sorted(EXPECTED.values())
    no_process_left(job_run)


def test_the_job_reuses_cached_artifacts_and_baseline_scores(job_run):
    for result in job_run.json["results"]:
        gate = json.loads((Path(result["run_dir"]) / "gate.json").read_text())
        assert "baseline_serve_start_s" not in gate["stages"], Path(result["recipe"]).stem
        if Path(result["recipe"]).stem in ("w8a8", NEGATIVE_CONTROL):  # quantized by the earlier CLI runs
            assert gate["inputs"]["quantize_reused"] is True, Path(result["recipe"]).stem


def test_a_rerun_of_the_job_does_nothing(job_run, job_rerun):
    assert job_rerun.code == 0, job_rerun.describe()
    results = job_rerun.json["results"]
    assert all(r["skipped"] for r in results), results
    assert {Path(r["recipe"]).stem: r["status"] for r in results} == EXPECTED
    assert job_rerun.new_runs == [], "a rerun must not gate anything again"
    assert "starting vLLM" not in job_rerun.stderr


def _served_in(run_dir: Path, artifact: Path) -> bool:
    log = run_dir / "candidate-server.log"
    return log.is_file() and str(artifact) in log.read_text() and bool(list((run_dir / "candidate" / "lm_eval").rglob("samples_*.jsonl")))


def test_vllm_loaded_and_scored_every_shipped_recipe_artifact(workspace, job_run):
    # A candidate whose scores are cached is not served again: some run of the session served it.
    for result in job_run.json["results"]:
        run_dir = Path(result["run_dir"])
        gate = json.loads((run_dir / "gate.json").read_text())
        artifact = Path(gate["inputs"]["artifact"]["path"])
        config = json.loads((artifact / "config.json").read_text())
        assert "quantization_config" in config, Path(result["recipe"]).stem
        assert all(s["n"] > 0 for s in gate["gate"]["sets"]), Path(result["recipe"]).stem
        if not _served_in(run_dir, artifact):
            assert "candidate_serve_start_s" not in gate["stages"], Path(result["recipe"]).stem
            assert any(_served_in(other, artifact) for other in workspace.runs_dir.iterdir()), Path(result["recipe"]).stem
