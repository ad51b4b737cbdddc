"""The registry job without servers: validation up front (recipes compiled against each model), failures
recorded and survived, the ledger (verified cached skips; a corrupt ledger is named)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import JOB_RECIPES, LLAMA_CONFIG, FakeRunner, demo_job, install, make_eval_set, make_model, write_job

from pipelines.errors import InputError, ServeError
from pipelines.evaluation import evalsets
from pipelines.jobs import job as job_module
from pipelines.jobs.job import JobSummary, load_job, plan_candidates, run_job


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    sets = [make_eval_set(tmp_path / "eval_sets", "tickets"), make_eval_set(tmp_path / "eval_sets", "orders")]
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: sets)
    make_model(tmp_path / "models" / "demo-llama")  # config.json + safetensors: the compiler can check recipes against it
    return tmp_path


def statuses(summary: JobSummary) -> dict[str, tuple[str, bool]]:
    return {r.recipe: (r.status, r.skipped) for r in summary.results}


def test_validation_lists_every_problem_before_anything_runs(workspace, monkeypatch):
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    path = write_job(
        workspace,
        "name: broken\ncandidates:\n"
        "  - model: models/no-such-model\n    recipes: [w8a8, no-such-recipe]\n"
        "  - model: models/demo-llama\n    recipes: [w8a8]\n    eval_sets: [tickets, no-such-set]\n",
    )
    with pytest.raises(InputError) as raised:
        run_job(path, jobs_dir=workspace / "jobs")
    message = raised.value.one_line()
    assert message.startswith(f"{path}: 3 problem(s)")
    assert "candidates.0.model: not a model folder" in message and "no-such-model" in message
    assert "candidates.0.recipes" in message and "no-such-recipe" in message
    assert "candidates.1" in message and "no-such-set" in message
    assert fake.calls == [] and not (workspace / "jobs").exists()


def test_an_unknown_key_in_the_job_file_is_one_line_naming_it(workspace):
    path = write_job(workspace, "name: x\ncandidates:\n  - model: models/demo-llama\n    recipes: [w8a8]\n    recipe_typo: 1\n")
    with pytest.raises(InputError, match=r"candidates\.0\.recipe_typo: unknown key"):
        load_job(path)


def test_candidates_are_resolved_relative_to_the_job_file_with_defaults_and_overrides(workspace):
    path = demo_job(workspace, ["w8a8"], extra="max_model_len: 256\ndefaults:\n  eval_sets: [orders]\n")
    (candidate,) = plan_candidates(load_job(path), path)
    assert candidate.model == (workspace / "models" / "demo-llama").resolve()
    assert [s.name for s in candidate.settings.eval_sets] == ["orders"]
    assert candidate.settings.serve.max_model_len == 256
    assert candidate.settings.registry_path == (workspace / "registry.db").resolve()


def test_a_failing_candidate_is_recorded_and_the_job_goes_on(workspace, monkeypatch):
    behaviour = {"w4a16": ServeError("vLLM exited during start-up"), "gptq": RuntimeError("oom"), "aggressive": "rejected"}
    fake = install(monkeypatch, FakeRunner(workspace, behaviour))
    summary = run_job(demo_job(workspace), jobs_dir=workspace / "jobs")
    assert [recipe for _, recipe in fake.calls] == JOB_RECIPES
    assert statuses(summary) == {
        "w8a8": ("promoted", False), "w4a16": ("error", False), "gptq": ("error", False), "aggressive": ("rejected", False),
    }
    errors = {r.recipe: r.reasons for r in summary.results if r.status == "error"}
    assert "vLLM exited during start-up" in errors["w4a16"][0] and errors["gptq"] == ["RuntimeError: oom"]
    assert summary.exit_code == 2
    ledger = json.loads((workspace / "jobs" / "nightly.json").read_text())
    assert sorted(entry["status"] for entry in ledger["decided"].values()) == ["error", "error", "promoted", "rejected"]


def test_a_rerun_skips_decided_candidates_and_retries_errored_ones(workspace, monkeypatch):
    path = demo_job(workspace)
    install(monkeypatch, FakeRunner(workspace, {"gptq": ServeError("died"), "aggressive": "rejected"}))
    assert run_job(path, jobs_dir=workspace / "jobs").exit_code == 2
    retry = install(monkeypatch, FakeRunner(workspace, {"aggressive": "rejected"}))
    summary = run_job(path, jobs_dir=workspace / "jobs")
    assert retry.calls == [("demo-llama", "gptq")]
    assert statuses(summary) == {
        "w8a8": ("promoted", True), "w4a16": ("promoted", True), "gptq": ("promoted", False), "aggressive": ("rejected", True),
    }
    assert summary.exit_code == 0  # a rejection is a decision, not an error
    third = install(monkeypatch, FakeRunner(workspace, {}))
    assert all(skipped for _, skipped in statuses(run_job(path, jobs_dir=workspace / "jobs")).values())
    assert third.calls == []


def test_changed_inputs_are_not_skipped(workspace, monkeypatch):
    path = demo_job(workspace, ["w8a8"])
    install(monkeypatch, FakeRunner(workspace, {}))
    run_job(path, jobs_dir=workspace / "jobs")
    (workspace / "models" / "demo-llama" / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "rope_theta": 20000.0}))
    again = install(monkeypatch, FakeRunner(workspace, {}))
    summary = run_job(path, jobs_dir=workspace / "jobs")
    assert again.calls == [("demo-llama", "w8a8")] and not summary.results[0].skipped


def test_an_interrupt_stops_the_job_and_keeps_what_was_decided(workspace, monkeypatch):
    path = demo_job(workspace)
    install(monkeypatch, FakeRunner(workspace, {"gptq": KeyboardInterrupt()}))
    with pytest.raises(KeyboardInterrupt):
        run_job(path, jobs_dir=workspace / "jobs")
    resumed = install(monkeypatch, FakeRunner(workspace, {}))
    run_job(path, jobs_dir=workspace / "jobs")
    assert resumed.calls == [("demo-llama", "gptq"), ("demo-llama", "aggressive")]


def test_the_summary_table_shows_one_line_per_failed_set():
    from pipelines.commands.job import reasons_by_set

    reasons = [
        "dates: drop 68.00 points > max_abs_drop 2.0",
        "dates: mean KL 0.4160 nats/token > max_kl 0.1",
        "refs: drop 96.40 points > max_abs_drop 1.0",
    ]
    assert reasons_by_set(reasons) == "dates: drop 68.00 points > max_abs_drop 2.0 (+1 more)\nrefs: drop 96.40 points > max_abs_drop 1.0"
    assert reasons_by_set([]) == ""


def test_a_recipe_that_cannot_apply_to_its_model_fails_at_plan_time(workspace, monkeypatch):
    # intermediate 808 is not a multiple of 32, which vLLM's CPU 4-bit kernel needs (w4a16's group_size auto
    # would pick 8): quantize would refuse it after loading and hashing the model; the job refuses it before
    # any candidate runs, naming file, candidate, reason.
    odd = make_model(workspace / "models" / "odd-llama")
    (odd / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "intermediate_size": 808}))
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    path = write_job(
        workspace,
        "name: nightly\ncandidates:\n  - model: models/demo-llama\n    recipes: [w8a8, w4a16]\n"
        "  - model: models/odd-llama\n    recipes: [w8a8, w4a16]\n",
    )
    with pytest.raises(InputError) as raised:
        run_job(path, jobs_dir=workspace / "jobs")
    message = raised.value.one_line()
    assert message.startswith(f"{path}: 1 problem(s)")
    assert "candidates.1 (odd-llama x w4a16): recipe cannot apply to this model" in message
    assert "multiples of 32; model.layers.0.mlp.gate_proj+up_proj is 256 -> 1616" in message and "w4a16.yaml" in message
    assert fake.calls == [] and not (workspace / "jobs").exists()


def test_a_fixed_group_size_that_does_not_divide_names_the_fix_at_plan_time(workspace, monkeypatch):
    wide = make_model(workspace / "models" / "wide-llama")
    (wide / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}))
    (workspace / "g128.yaml").write_text(
        "name: g128\nalgorithm: {method: rtn}\ngroups:\n  attention:\n    weights: {bits: 4, granularity: group, group_size: 128}\n"
    )
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    path = write_job(workspace, f"name: nightly\ncandidates:\n  - model: models/wide-llama\n    recipes: [w4a16, {workspace / 'g128.yaml'}]\n")
    with pytest.raises(InputError) as raised:
        run_job(path, jobs_dir=workspace / "jobs")
    message = raised.value.one_line()
    assert "1 problem(s)" in message and "(wide-llama x w4a16)" not in message  # group_size auto applies
    assert ("group_size 128 does not divide the input size 576 of model.layers.0.self_attn.q_proj; 64, 32 would; "
            "write `group_size: 64` or `group_size: auto`") in message
    assert fake.calls == []


def calibration_job(workspace: Path, calibration: str, recipes: str = "[w8a8, w4a16]", where: str = "candidate") -> Path:
    own = f"    calibration: {calibration}\n" if where == "candidate" else ""
    default = f"defaults:\n  calibration: {calibration}\n" if where == "defaults" else ""
    return write_job(workspace, f"name: nightly\n{default}candidates:\n  - model: models/demo-llama\n    recipes: {recipes}\n{own}")


def write_texts(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


@pytest.mark.parametrize("where", ["candidate", "defaults"])
def test_a_candidate_calibration_path_is_resolved_against_the_job_file_and_passed_to_quantize(workspace, monkeypatch, where):
    data = write_texts(workspace / "data" / "cal.jsonl", ["a support ticket", "a refund request"])
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    path = calibration_job(workspace, "data/cal.jsonl", where=where)
    candidates = plan_candidates(load_job(path), path)
    assert [c.calibration for c in candidates] == [str(data.resolve())] * 2
    run_job(path, jobs_dir=workspace / "jobs")
    assert fake.kwargs == [{"calibration": str(data.resolve())}] * 2


def test_without_calibration_the_call_and_the_ledger_key_are_what_they_were(workspace, monkeypatch):
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    path = demo_job(workspace, ["w8a8"])
    (candidate,) = plan_candidates(load_job(path), path)
    assert candidate.calibration is None
    assert candidate.key == job_module._key(candidate.model, load_job_recipe_text("w8a8"), candidate.settings)
    run_job(path, jobs_dir=workspace / "jobs")
    assert fake.kwargs == [{}]  # quantize_and_gate called exactly as before `calibration:` existed


def load_job_recipe_text(name: str) -> str:
    from pipelines.recipe import load_recipe

    return load_recipe(name).text


def test_changed_calibration_data_is_not_skipped(workspace, monkeypatch):
    data = write_texts(workspace / "cal.jsonl", ["first text"])
    path = calibration_job(workspace, "cal.jsonl", recipes="[w8a8]")
    install(monkeypatch, FakeRunner(workspace, {}))
    run_job(path, jobs_dir=workspace / "jobs")
    same = install(monkeypatch, FakeRunner(workspace, {}))
    run_job(path, jobs_dir=workspace / "jobs")
    assert same.calls == []
    write_texts(data, ["another text"])
    changed = install(monkeypatch, FakeRunner(workspace, {}))
    run_job(path, jobs_dir=workspace / "jobs")
    assert changed.calls == [("demo-llama", "w8a8")]


def test_bad_candidate_calibration_fails_at_plan_time(workspace, monkeypatch):
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    path = write_job(
        workspace,
        "name: nightly\ncandidates:\n  - model: models/demo-llama\n    recipes: [w8a8]\n    calibration: nowhere.jsonl\n"
        "  - model: models/demo-llama\n    recipes: [gptq]\n    calibration: from-eval-sets\n",
    )
    with pytest.raises(InputError) as raised:
        run_job(path, jobs_dir=workspace / "jobs")
    message = raised.value.one_line()
    assert "2 problem(s)" in message
    assert "candidates.0.calibration: nowhere.jsonl: calibration.dataset: calibration data not found" in message
    assert "candidates.1.calibration:" in message and "add calibration.jsonl" in message
    assert fake.calls == []


def test_from_eval_sets_in_a_job_uses_the_candidates_sets(workspace, monkeypatch):
    for name in ("tickets", "orders"):
        (workspace / "eval_sets" / name / "calibration.jsonl").write_text(json.dumps({"q": f"held-out {name}", "a": "x"}) + "\n")
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    path = calibration_job(workspace, "from-eval-sets", recipes="[gptq]")
    (candidate,) = plan_candidates(load_job(path), path)
    assert candidate.calibration == "from-eval-sets"
    run_job(path, jobs_dir=workspace / "jobs")
    assert fake.kwargs == [{"calibration": "from-eval-sets"}]


def test_a_model_folder_without_valid_weights_fails_at_plan_time(workspace, monkeypatch):
    (workspace / "models" / "demo-llama" / "model.safetensors").write_bytes(b"\x08")
    fake = install(monkeypatch, FakeRunner(workspace, {}))
    with pytest.raises(InputError, match=r"candidates\.0\.model: .*model\.safetensors.*truncated"):
        run_job(demo_job(workspace, ["w8a8"]), jobs_dir=workspace / "jobs")
    assert fake.calls == []


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", '{"decided": []}', '{"decided": {"k": {"status": "promoted"}}}', '{"decided": {"k": NaN}}', "\xff\xfe"],
    ids=["bad-json", "not-object", "decided-not-object", "entry-missing-fields", "nan", "not-utf8"],
)
def test_a_corrupt_ledger_is_exit_2_naming_the_file(workspace, monkeypatch, capsys, content):
    from pipelines.cli import main

    install(monkeypatch, FakeRunner(workspace, {}))
    ledger = workspace / "jobs" / "nightly.json"
    ledger.parent.mkdir()
    ledger.write_bytes(content.encode("latin-1"))
    path = demo_job(workspace, ["w8a8"])
    with pytest.raises(InputError, match="corrupt job ledger") as raised:
        run_job(path, jobs_dir=workspace / "jobs")
    assert raised.value.file == str(ledger)
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(workspace))
    code = main(["job", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and str(ledger) in err and "Traceback" not in err


def test_the_ledger_records_which_artifact_was_judged(workspace, monkeypatch):
    install(monkeypatch, FakeRunner(workspace, {}))
    run_job(demo_job(workspace, ["w8a8"]), jobs_dir=workspace / "jobs")
    (entry,) = json.loads((workspace / "jobs" / "nightly.json").read_text())["decided"].values()
    artifact = workspace / "candidates" / "demo-llama" / "w8a8"
    assert entry["artifact_dir"] == str(artifact)
    assert entry["manifest_sha256"] == job_module.sha256_file(artifact / "manifest.json")
    assert set(entry["fingerprint"]) == {"manifest.json", "model.safetensors", "config.json", "sub/tokenizer.json"}


def test_an_old_ledger_entry_without_its_artifact_is_run_again_not_trusted(workspace, monkeypatch):
    path = demo_job(workspace, ["w8a8"])
    install(monkeypatch, FakeRunner(workspace, {}))
    run_job(path, jobs_dir=workspace / "jobs")
    ledger = workspace / "jobs" / "nightly.json"
    data = json.loads(ledger.read_text())
    for entry in data["decided"].values():
        for field in ("artifact_dir", "manifest_sha256", "fingerprint"):
            entry.pop(field)
    ledger.write_text(json.dumps(data))
    again = install(monkeypatch, FakeRunner(workspace, {}))
    summary = run_job(path, jobs_dir=workspace / "jobs")
    assert again.calls == [("demo-llama", "w8a8")] and not summary.results[0].skipped


def test_a_cached_rejection_stands_even_when_its_artifact_was_deleted(workspace, monkeypatch):
    import shutil

    path = demo_job(workspace, ["aggressive"])
    install(monkeypatch, FakeRunner(workspace, {"aggressive": "rejected"}))
    run_job(path, jobs_dir=workspace / "jobs")
    shutil.rmtree(workspace / "candidates" / "demo-llama" / "aggressive")  # rejected artifacts pruned to save disk
    again = install(monkeypatch, FakeRunner(workspace, {}))
    summary = run_job(path, jobs_dir=workspace / "jobs")
    assert again.calls == [] and statuses(summary) == {"aggressive": ("rejected", True)}
