"""The registry job on a real Ray runtime (no mock of Ray): a local cluster started here by `ray.init` (2 CPUs,
a 256 MB object store, no dashboard, its temporary folder under this session's tmp), and the real `quantize job`
command connecting to it as the driver.

Cost on a 2-core machine is kept down the way test_registry_job.py keeps it: the job gates on the one set the
session's aggressive run failed first, with the load test off, and reuses the session's artifacts and cached
scores. So the demo job's two candidates (w8a8, aggressive) run in Ray workers without a server, which is what
makes "the same ledger and registry as the local run" cheap to compare; the retry test quantizes, serves and
scores a fresh artifact in a Ray worker (a copy of the gptq recipe), killed with SIGKILL during its quantize.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import INT4_WEIGHT_ONLY, NEGATIVE_CONTROL, QUANTIZE, CommandRun, Workspace, processes_with_marker

from pipelines.gate.policy import DEFAULT_POLICY
from pipelines.paths import DEMO_MODEL_DIR, REPO_ROOT

pytestmark = pytest.mark.integration

RECIPES = ("w8a8", NEGATIVE_CONTROL)
SOURCE = "gptq" if INT4_WEIGHT_ONLY else "w8a8"
FRESH = f"{SOURCE}-ray"
EXPECTED = {"w8a8": "promoted", NEGATIVE_CONTROL: "rejected"}
# Ledger fields that say where and when, not what: they differ between any two runs.
CIRCUMSTANCES = {"run_dir", "registry_version", "wall_s", "skipped", "node", "attempts", "fingerprint"}


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory: pytest.TempPathFactory):
    """One local Ray runtime for the module; `quantize job --ray-address` connects to it."""
    import ray

    temp_dir = tmp_path_factory.mktemp("ray")
    # One CPU: one task at a time, so the driver can be stopped between the two candidates' decisions.
    ray.init(num_cpus=1, object_store_memory=256 * 1024**2, include_dashboard=False, _temp_dir=str(temp_dir),
             logging_level=logging.WARNING)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def job_inputs(workspace: Workspace, aggressive_run: CommandRun) -> tuple[str, Path]:
    """The eval set the session's aggressive run failed first, and the default policy with the load test off."""
    assert aggressive_run.code == 1, aggressive_run.describe()
    report = json.loads(Path(aggressive_run.json["gate_json"]).read_text())
    deciding = next(s["eval_set"] for s in report["gate"]["sets"] if not s["passed"])
    policy = workspace.root / "ray-job-policy.yaml"
    policy.write_text(DEFAULT_POLICY.read_text().replace("performance:\n  enabled: true", "performance:\n  enabled: false"))
    return deciding, policy


def ray_job_run(workspace: Workspace, path: Path, address: str, *args: str, **options) -> CommandRun:
    """`quantize job PATH --ray-address ADDRESS`: a driver joining the module's runtime, which (like any Ray 2.60
    runtime started by ray.init) takes clients with its token (~/.ray/auth_token) only."""
    env = {"RAY_AUTH_MODE": "token", **options.pop("env", {})}
    return workspace.run([*options.pop("prefix", []), str(QUANTIZE), "job", str(path), "--json", "--ray-address", address, *args],
                         env=env, **options)


def job_registry(workspace: Workspace, name: str) -> Path:
    """Each job's registry in its own folder: a registry keeps its signed bundles beside it (promoted/), and two in one
    folder would promote into the same bundle folders (the product refuses that: pipelines/registry/evidence.py)."""
    folder = workspace.root / "job-registries" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "registry.db"


def write_job(workspace: Workspace, name: str, recipes: list[str], job_inputs: tuple[str, Path], extra: str = "", *,
              registry_line: bool = True) -> Path:
    """The job file; without `registry_line` the job's registry is $QUANTGATE_REGISTRY as the command runs."""
    eval_set, policy = job_inputs
    path = workspace.root / f"{name}.yaml"
    registry = f"registry: {job_registry(workspace, name)}\n" if registry_line else ""
    path.write_text(
        f"name: {name}\n{registry}{extra}"
        f"defaults:\n  eval_sets: [{eval_set}]\n  policy: {policy}\n"
        f"candidates:\n  - model: {DEMO_MODEL_DIR}\n    recipes: [{', '.join(recipes)}]\n"
    )
    return path


def ledger(workspace: Workspace, name: str) -> dict[str, dict]:
    return json.loads((workspace.artifacts / "jobs" / f"{name}.json").read_text())["decided"]


def wait_for_no_process(run: CommandRun, within_s: float = 30.0) -> None:
    """Ray stops a driver's workers (and their watchdogs the servers) shortly after the driver is gone."""
    deadline = time.monotonic() + within_s
    while processes_with_marker(run.marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_marker(run.marker) == [], f"processes of `{' '.join(run.argv[1:])}` still running"


@pytest.fixture(scope="module")
def local_job(workspace: Workspace, job_inputs) -> CommandRun:
    """The demo job's two candidates through the local executor: everything comes from the session's caches."""
    return workspace.quantize("job", str(write_job(workspace, "ray-local", list(RECIPES), job_inputs)), "--json")


def _first_decision(stderr: str) -> bool:
    return any(f"demo-llama x {recipe}: {verdict}" in stderr for recipe, verdict in EXPECTED.items())


@pytest.fixture(scope="module")
def ray_registry(postgres) -> str:
    """The Ray job promotes into PostgreSQL (a database of the session's throwaway cluster), named by QUANTGATE_REGISTRY."""
    return postgres.create_database("ray_demo")


@pytest.fixture(scope="module")
def ray_job_file(workspace: Workspace, job_inputs) -> Path:
    return write_job(workspace, "ray-demo", list(RECIPES), job_inputs, extra="executor: ray\n", registry_line=False)


@pytest.fixture(scope="module")
def killed_driver(workspace: Workspace, ray_job_file: Path, ray_address: str, ray_registry: str, local_job) -> tuple[CommandRun, dict[str, dict]]:
    """The Ray job's driver SIGTERMed once the first candidate is decided, and the ledger it left."""
    run = ray_job_run(workspace, ray_job_file, ray_address, terminate_when=_first_decision, grace_s=0.2,
                      env={"QUANTGATE_REGISTRY": ray_registry})
    return run, ledger(workspace, "ray-demo")


@pytest.fixture(scope="module")
def ray_job(workspace: Workspace, ray_job_file: Path, ray_address: str, ray_registry: str, killed_driver) -> CommandRun:
    """The same job again: it resumes from the ledger the killed driver left."""
    return ray_job_run(workspace, ray_job_file, ray_address, env={"QUANTGATE_REGISTRY": ray_registry})


def test_a_killed_driver_leaves_a_ledger_of_what_was_decided(killed_driver):
    run, decided = killed_driver
    assert run.code == 2, run.describe()
    assert "interrupted" in run.stderr
    assert len(decided) == 1, decided
    assert {entry["recipe"]: entry["status"] for entry in decided.values()}.items() <= EXPECTED.items()
    wait_for_no_process(run)


def test_the_rerun_resumes_and_gives_the_local_verdicts(workspace, killed_driver, ray_job, local_job):
    assert local_job.code == 0 and ray_job.code == 0, ray_job.describe() + local_job.describe()
    results = {r["recipe"]: r for r in ray_job.json["results"]}
    assert {recipe: r["status"] for recipe, r in results.items()} == EXPECTED
    decided_by_the_killed_driver = {entry["recipe"] for entry in killed_driver[1].values()}
    assert {recipe: r["skipped"] for recipe, r in results.items()} == {recipe: recipe in decided_by_the_killed_driver for recipe in RECIPES}
    local = {r["recipe"]: r for r in local_job.json["results"]}
    for recipe in RECIPES:
        assert results[recipe]["manifest_sha256"] == local[recipe]["manifest_sha256"], recipe
        assert results[recipe]["artifact_dir"] == local[recipe]["artifact_dir"], recipe
        assert results[recipe]["node"], recipe
    wait_for_no_process(ray_job)


def _content(entries: dict[str, dict]) -> dict[str, dict]:
    return {key: {field: value for field, value in entry.items() if field not in CIRCUMSTANCES} for key, entry in entries.items()}


def test_the_ledger_and_registry_match_the_local_run(workspace, ray_job, ray_registry, local_job, monkeypatch):
    assert _content(ledger(workspace, "ray-demo")) == _content(ledger(workspace, "ray-local"))
    from pipelines.registry.store import Registry

    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(workspace.artifacts))  # where a PostgreSQL registry keeps its files

    def versions(name: str) -> list[tuple]:
        registry = Registry(ray_registry if name == "ray-demo" else job_registry(workspace, name))
        return sorted(
            (v.model, v.recipe_name, v.status, v.artifact_path, v.artifact_hash, v.source_hash, v.recipe_hash, v.manifest_hash,
             tuple((s.name, s.hash) for s in v.eval_sets), v.reason, v.verdict)
            for v in registry.list()
        )

    assert versions("ray-demo") == versions("ray-local")
    assert len(versions("ray-demo")) == len(RECIPES)
    promoted = [v for v in Registry(ray_registry).list() if v.status == "promoted"]
    assert promoted and all(Registry(ray_registry).verify_signature(v, required=True) for v in promoted)


def test_the_ledger_records_node_and_wall_time(workspace, ray_job):
    for entry in ledger(workspace, "ray-demo").values():
        assert entry["node"] and entry["wall_s"] > 0 and entry["attempts"] == 1, entry


# --- a worker killed during quantize ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_recipe(workspace: Workspace) -> Path:
    """gptq (w8a8 on AVX2 hosts, which serve no int4 weight-only) under another name: an artifact no earlier test made,
    so the worker really quantizes it (GPTQ in both)."""
    path = workspace.root / f"{FRESH}.yaml"
    path.write_text((REPO_ROOT / "recipes" / f"{SOURCE}.yaml").read_text().replace(f"name: {SOURCE}\n", f"name: {FRESH}\n", 1))
    return path


class Killer(threading.Thread):
    """Waits for the candidate's first worker to say it runs (its status file), checks it is still quantizing
    (no manifest.json yet), and SIGKILLs that worker process; records the timeline."""

    def __init__(self, status_dir: Path, artifacts: Path):
        super().__init__(daemon=True)
        self.status_dir, self.artifacts = status_dir, artifacts
        self.started = time.monotonic()
        self.timeline: dict[str, float] = {}
        self.killed_pid: int | None = None
        self.quantizing = False

    def run(self) -> None:
        deadline = self.started + 600
        while time.monotonic() < deadline:
            for path in self.status_dir.glob("*.json"):
                status = json.loads(path.read_text())
                if status["attempt"] == 1 and self.killed_pid is None:
                    self.timeline["worker 1 started"] = round(time.monotonic() - self.started, 1)
                    time.sleep(2.0)  # inside quantize: torch and llm-compressor loading, or GPTQ itself
                    self.quantizing = not list(self.artifacts.glob(f"candidates/demo-llama/{FRESH}-*/manifest.json"))
                    os.kill(status["pid"], signal.SIGKILL)
                    self.killed_pid = status["pid"]
                    self.timeline["worker 1 SIGKILLed"] = round(time.monotonic() - self.started, 1)
                elif status["attempt"] == 2:
                    self.timeline["worker 2 started (Ray's retry)"] = round(time.monotonic() - self.started, 1)
                    return
            time.sleep(0.1)


@pytest.fixture(scope="module")
def retried_job(workspace: Workspace, job_inputs, fresh_recipe: Path, ray_address: str, ray_job):
    path = write_job(workspace, "ray-retry", [str(fresh_recipe)], job_inputs, extra="executor: ray\nmax_retries: 1\n")
    killer = Killer(workspace.artifacts / "jobs" / "ray-retry.tasks", workspace.artifacts)
    killer.start()
    run = ray_job_run(workspace, path, ray_address)
    killer.join(timeout=5)
    killer.timeline["job done"] = run.wall_s
    return run, killer


def test_a_worker_killed_during_quantize_is_retried_and_the_job_completes(workspace, retried_job):
    run, killer = retried_job
    print(f"retry timeline (s since the command started): {killer.timeline}")
    assert killer.killed_pid is not None and killer.quantizing, killer.timeline
    assert not psutil.pid_exists(killer.killed_pid) or psutil.Process(killer.killed_pid).status() == psutil.STATUS_ZOMBIE
    assert run.code == 0, run.describe()
    (result,) = run.json["results"]
    assert result["status"] == "promoted" and result["attempts"] == 2, result
    (entry,) = ledger(workspace, "ray-retry").values()
    assert entry["attempts"] == 2 and entry["status"] == "promoted"
    from pipelines.artifact import verify_artifact

    verify_artifact(Path(result["artifact_dir"]), manifest_sha256=result["manifest_sha256"])  # complete, every byte as listed
    gate = json.loads((Path(result["run_dir"]) / "gate.json").read_text())
    assert "candidate_serve_start_s" in gate["stages"], "the retried worker served the fresh artifact on vLLM"
    wait_for_no_process(run)


# --- refused before any work ---------------------------------------------------------------------------------------


def test_an_artifacts_root_the_workers_do_not_share_is_refused(workspace, job_inputs, ray_address, ray_job):
    """The driver sees a private tmpfs over the artifacts root (its own mount namespace): what the workers write
    there never reaches it, as on a node whose path is a local disk rather than the shared volume."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a mount namespace (unshare -m) to give the driver a store the workers do not see")
    root = workspace.root / "unshared-artifacts"
    root.mkdir()
    path = write_job(workspace, "ray-unshared", ["w8a8"], job_inputs, extra="executor: ray\n")
    script = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
    run = ray_job_run(workspace, path, ray_address, prefix=["unshare", "-m", "sh", "-c", script, str(root)],
                      env={"QUANTGATE_ARTIFACTS": str(root)})
    assert run.code == 2, run.describe()
    error = run.error_line
    assert error.startswith(f"quantize: error: {root}: the artifacts root is not shared: node "), error
    assert "cannot read back" in error and run.new_runs == []


def test_a_cluster_without_the_gpu_a_candidate_needs_is_refused(workspace, job_inputs, ray_address, ray_job):
    path = write_job(workspace, "ray-gpu", ["w8a8"], job_inputs, extra="executor: ray\n")
    run = ray_job_run(workspace, path, ray_address, env={"QUANTGATE_SERVE_TARGET": "cuda:8.9"})
    assert run.code == 2, run.describe()
    assert run.error_line.startswith(f"quantize: error: {path}: executor: no node of the Ray cluster can run "), run.error_line
    assert "demo-llama x w8a8: it needs 1 GPU(s)" in run.error_line and "tensor-parallel 1 on L4-24GB" in run.error_line
    assert run.new_runs == [] and not (workspace.artifacts / "jobs" / "ray-gpu.json").exists()
