"""The Ray executor's logic without a cluster: each task's resources from the plan, the task graph (a baseline task
before the candidates that need it), the one-writer rule (workers never register nor touch the ledger; the driver
verifies before it records), the shared-store probe's verdicts, the address check and the progress line. The
runtime itself is exercised for real in tests/integration/test_ray_job.py."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest
from fakes import LLAMA_CONFIG, FakeRunner, demo_job, install, make_artifact, make_eval_set, make_model, write_job

from pipelines.commands import job as job_command
from pipelines.errors import InputError
from pipelines.evaluation import evalsets
from pipelines.gate.policy import FitRequirement
from pipelines.hardware.targets import CPU, parse_target
from pipelines.jobs.job import CandidateResult, Ledger, load_job, plan_candidates, plan_job
from pipelines.jobs.ray import driver
from pipelines.jobs.ray.cluster import check_address
from pipelines.jobs.ray.graph import baseline_groups, submit_graph
from pipelines.jobs.ray.probe import ProbeWritten, check_probes, write_probe
from pipelines.jobs.ray.resources import GiB, TaskResources, check_some_node_fits, task_resources, tensor_parallel_size
from pipelines.jobs.ray.tracker import Tracker
from pipelines.jobs.ray.worker import TaskStatus, candidate_task, read_status, status_path
from pipelines.planner import gpu_spec, plan
from pipelines.recipe import load_recipe

pytestmark = pytest.mark.unit

LLAMA_8B = {**LLAMA_CONFIG, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192}


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    sets = [make_eval_set(tmp_path / "eval_sets", "tickets"), make_eval_set(tmp_path / "eval_sets", "orders")]
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: sets)
    make_model(tmp_path / "models" / "demo-llama")
    return tmp_path


def config_only_model(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- resources from the plan ----------------------------------------------------------------------------------------


def test_a_cpu_target_asks_for_cpus_and_the_memory_of_two_servers(workspace):
    model = workspace / "models" / "demo-llama"
    request = task_resources(model, load_recipe("w8a8"), None, CPU, cpu_kv_cache_gib=1)
    assert (request.num_cpus, request.num_gpus) == (1, 0)
    weights = 7_344_640  # the demo model's 3,672,320 parameters in bf16 (README), as the planner predicts them from config.json
    assert request.memory_bytes == 2 * (3 * GiB + 1 * GiB + weights)  # two servers, each its overhead, 1 GiB of KV and the weights
    assert request.ray_options() == {"num_cpus": 1, "num_gpus": 0, "memory": request.memory_bytes}


def test_a_gpu_target_asks_for_the_tensor_parallel_size_at_which_the_plan_fits(tmp_path):
    model = config_only_model(tmp_path / "llama-8b", LLAMA_8B)
    fit = FitRequirement(gpu="L4-24GB", max_model_len=4096, concurrency=16)
    size = tensor_parallel_size(model, None, fit)
    assert size > 1  # 16 GB of 16-bit weights and 8 GiB of KV cache do not fit one 24 GB L4
    one = gpu_spec("L4-24GB")
    fits = [plan(model / "config.json", [None], one.model_copy(update={"memory_bytes": one.memory_bytes * n}), 4096, 16).rows[0].fits
            for n in (size // 2, size)]
    assert fits == [False, True]
    request = task_resources(model, None, fit, parse_target("cuda:8.9"), cpu_kv_cache_gib=1)
    assert request.num_gpus == size and request.why == f"tensor-parallel {size} on L4-24GB"
    # A recipe shrinks the weights, and with them the GPUs a candidate needs.
    assert tensor_parallel_size(model, load_recipe("w4a16").recipe, fit) <= size


def test_a_model_that_fits_one_gpu_asks_for_one_and_sizes_divide_the_heads(workspace, tmp_path):
    fit = FitRequirement(gpu="H100-80GB", max_model_len=512, concurrency=1)
    assert task_resources(workspace / "models" / "demo-llama", load_recipe("w8a8"), fit, parse_target("cuda:9.0"),
                          cpu_kv_cache_gib=1).num_gpus == 1
    six_heads = config_only_model(tmp_path / "six-heads", {**LLAMA_8B, "num_attention_heads": 6, "num_key_value_heads": 6,
                                                            "hidden_size": 6 * 128})
    tiny = FitRequirement(memory_gib=0.5, max_model_len=512, concurrency=1)
    assert tensor_parallel_size(six_heads, None, tiny) == 2  # nothing fits; 4 and 8 do not divide 6 heads


def test_no_node_that_fits_names_the_candidate_and_what_it_needs(tmp_path):
    request = TaskResources(num_cpus=1, num_gpus=2, memory_bytes=8 * GiB, why="tensor-parallel 2 on L4-24GB")
    nodes = [{"CPU": 8.0, "GPU": 1.0, "memory": 64.0 * GiB}, {"CPU": 2.0, "memory": 16.0 * GiB}]
    with pytest.raises(InputError) as raised:
        check_some_node_fits({"candidates [1/1] demo-llama x w8a8": request}, nodes, file=tmp_path / "job.yaml")
    line = raised.value.one_line()
    assert line.startswith(f"{tmp_path / 'job.yaml'}: executor: no node of the Ray cluster can run candidates [1/1] demo-llama x w8a8")
    assert "needs 2 GPU(s), 1 CPU(s), 8.0 GiB memory (tensor-parallel 2 on L4-24GB)" in line and "1 GPU(s) 8 CPU(s) 64.0 GiB" in line
    check_some_node_fits({"x": request}, [*nodes, {"CPU": 4.0, "GPU": 2.0, "memory": 8.0 * GiB}], file=tmp_path)


# --- the task graph -------------------------------------------------------------------------------------------------


def test_candidates_sharing_a_baseline_depend_on_one_baseline_task_submitted_first(workspace):
    other_model = make_model(workspace / "models" / "other-llama")
    path = write_job(
        workspace,
        "name: graph\nexecutor: ray\ncandidates:\n"
        "  - model: models/demo-llama\n    recipes: [w8a8, aggressive]\n"
        f"  - model: {other_model}\n    recipes: [w8a8]\n"
        "  - model: models/demo-llama\n    recipes: [w4a16]\n    eval_sets: [orders]\n"
        "  - model: models/demo-llama\n    recipes: [gptq]\n",
    )
    candidates = plan_candidates(load_job(path), path)
    groups = baseline_groups(candidates)
    assert [g.members for g in groups] == [[0, 1, 4], [2], [3]]  # same model, sets, policy, serve settings -> one baseline
    order: list[str] = []

    def submit_baseline(group):
        order.append(f"baseline {group.members}")
        return f"baseline-handle-{group.key}"

    def submit_candidate(position, baseline):
        assert f"baseline {next(g.members for g in groups if position in g.members)}" in order, "the baseline task goes first"
        order.append(f"candidate {position}")
        return (position, baseline)

    handles = submit_graph(groups, submit_baseline, submit_candidate)
    assert {p: h[1] for p, h in handles.items()} == {p: f"baseline-handle-{g.key}" for g in groups for p in g.members}
    assert order.count("baseline [0, 1, 4]") == 1 and len(order) == len(groups) + len(candidates)
    assert [g.members for g in baseline_groups(candidates, [1, 3])] == [[1], [3]]  # only the candidates still to run


# --- one writer -----------------------------------------------------------------------------------------------------


def test_a_worker_gates_without_the_registry_and_counts_its_attempts(workspace, monkeypatch):
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    seen: list = []
    monkeypatch.setattr("pipelines.jobs.job.quantize_and_gate",
                        lambda loaded, model, settings, **kw: seen.append(settings.registry_path) or fake(loaded, model, settings, **kw))
    monkeypatch.setattr("pipelines.jobs.ray.worker._stdout_to_stderr", lambda: None)
    path = demo_job(workspace, ["w8a8"])
    (candidate,) = plan_candidates(load_job(path), path)
    assert candidate.settings.registry_path is not None
    status_dir = workspace / "jobs" / "nightly.tasks"
    first = candidate_task(candidate, None, status_dir)
    again = candidate_task(candidate, None, status_dir)  # what Ray's retry runs after a worker died
    assert seen == [None, None], "a worker never gates with a registry"
    assert (first.status, first.registry_version, first.attempts, again.attempts) == ("promoted", None, 1, 2)
    assert not (workspace / "registry.db").exists() and not (workspace / "jobs" / "nightly.json").exists()
    status = read_status(status_path(status_dir, candidate.key))
    assert status is not None and status.attempt == 2 and status.node == first.node


def test_the_driver_verifies_the_artifact_before_it_registers_and_records(workspace, monkeypatch):
    path = demo_job(workspace, ["w8a8", "aggressive"])
    candidates = plan_candidates(load_job(path), path)
    registered: list[str] = []
    monkeypatch.setattr(driver, "register_run", lambda run_dir, model, settings, check: registered.append(run_dir.name) or len(registered))
    good = make_artifact(workspace / "candidates" / "good")
    from pipelines.artifact import verify_artifact

    check = verify_artifact(good)
    ledger = Ledger(workspace / "jobs" / "nightly.json")
    worker_result = CandidateResult(model="demo-llama", recipe="w8a8", status="promoted", key=candidates[0].key, run_dir=str(workspace / "run-1"),
                                    artifact_dir=str(good), manifest_sha256=check.manifest_sha256, fingerprint=check.fingerprint, node="n1")
    recorded = driver._record(worker_result, candidates[0], ledger)
    assert (recorded.status, recorded.registry_version, registered) == ("promoted", 1, ["run-1"])
    (good / "model.safetensors").write_bytes(b"swapped on the shared store")
    tampered = worker_result.model_copy(update={"key": candidates[1].key, "run_dir": str(workspace / "run-2")})
    refused = driver._record(tampered, candidates[1], ledger)
    assert refused.status == "error" and "model.safetensors" in refused.reasons[0] and registered == ["run-1"]
    on_disk = json.loads(ledger.path.read_text())["decided"]
    assert {entry["status"] for entry in on_disk.values()} == {"promoted", "error"}


# --- the job file, the address, the probe ---------------------------------------------------------------------------


def test_the_job_file_names_its_executor_and_retries(workspace):
    job = load_job(demo_job(workspace, ["w8a8"], extra="executor: ray\nmax_retries: 3\n"))
    assert (job.executor, job.max_retries) == ("ray", 3)
    assert load_job(demo_job(workspace, ["w8a8"])).executor == "local"
    with pytest.raises(InputError, match=r"executor"):
        load_job(demo_job(workspace, ["w8a8"], extra="executor: slurm\n"))
    with pytest.raises(InputError, match=r"max_retries"):
        load_job(demo_job(workspace, ["w8a8"], extra="max_retries: -1\n"))


def test_a_repair_candidate_is_refused_by_the_ray_executor_before_any_work(workspace, monkeypatch):
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    path = demo_job(workspace, ["w8a8"], extra="executor: ray\ndefaults:\n  repair: true\n")
    with pytest.raises(InputError, match=r"repair: true is not available with the ray executor.*demo-llama x w8a8"):
        driver.run_on_ray(plan_job(path, jobs_dir=workspace / "jobs"), address=None)
    assert fake.calls == []


def test_a_ray_address_needs_the_ray_executor(workspace, monkeypatch):
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(workspace / "artifacts"))
    with pytest.raises(InputError, match=r"--ray-address needs the ray executor"):
        job_command.run_job(demo_job(workspace, ["w8a8"]), ray_address="127.0.0.1:6379")
    assert fake.calls == []


def test_an_unreachable_or_malformed_address_is_one_line():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    with pytest.raises(InputError, match=rf"--ray-address: the Ray cluster at 127.0.0.1:{port} is unreachable"):
        check_address(f"127.0.0.1:{port}")
    for bad in ("no-port", "http://host:1", "ray://:10001", "host:notaport", "", "host:99999"):
        with pytest.raises(InputError, match=r"not a Ray address"):
            check_address(bad)
    check_address("auto")


def test_the_probe_names_the_node_that_cannot_write_or_is_not_shared(tmp_path):
    root = tmp_path / "artifacts"
    written = write_probe(root, "nonce-1", "node-a")
    check_probes(root, "nonce-1", [written])  # read back: shared
    assert not Path(written.path).exists(), "probes are removed"
    elsewhere = write_probe(tmp_path / "node-b-local-disk", "nonce-2", "node-b")
    moved = ProbeWritten(node="node-b", host="host-b", path=str(root / ".scaleout-probes" / "nonce-2-node-b"))
    Path(elsewhere.path).unlink()
    with pytest.raises(InputError, match=r"artifacts: the artifacts root is not shared: node host-b \(Ray node node-b\) wrote"):
        check_probes(root, "nonce-2", [moved])
    failed = ProbeWritten(node="node-c", host="host-c", error="Read-only file system")
    with pytest.raises(InputError, match=r"not writable on node host-c .*Read-only file system"):
        check_probes(root, "nonce-3", [failed])


def test_progress_says_where_candidates_run_and_the_time_left(tmp_path):
    tracker = Tracker({0: "[1/3] m x a", 1: "[2/3] m x b", 2: "[3/3] m x c"}, {0: "k0", 1: "k1", 2: "k2"}, tmp_path)
    assert tracker.line(now=0.0) == "3 queued, 0 running, 0 decided of 3; time left unknown until a candidate is decided"
    for key, attempt in (("k0", 1), ("k1", 2)):
        status_path(tmp_path, key).write_text(TaskStatus(node="gpu-node-1", pid=1, attempt=attempt, started_at=100.0).model_dump_json())
    assert tracker.poll() and not tracker.poll()
    tracker.finish(0, 120.0)
    line = tracker.line(now=160.0)
    # mean 120 s: one queued (120) + the running one's remaining 60, over the 2 seen running at once
    assert line == "1 queued, 1 running ([2/3] m x b on gpu-node-1 (attempt 2)), 1 decided of 3; about 1 min 30 s left"


def test_sigterm_stops_the_driver_between_waits_and_the_cli_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with driver.stop_requested() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # Ray's own handler would exit inside its wait; this one only asks to stop
        assert stop.wait(timeout=5)
    assert signal.getsignal(signal.SIGTERM) is before
