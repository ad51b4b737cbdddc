"""The runner's bookkeeping without vLLM or lm-eval: baseline and candidate cache, run folders, failures, registry.

The servers, lm-eval and the KL requests are replaced by fakes that record what was started; everything
else (task materialization, pairing, the gate, gate.json, report.md, the SQLite registry) is real.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import gate_settings, make_eval_set, make_model

from pipelines.errors import EvalError, InputError, ServeError
from pipelines.evaluation import baseline as baseline_cache
from pipelines.evaluation import evalsets, evaluate
from pipelines.files.hashing import sha256_file
from pipelines.gate.report import UNVERIFIED_NOTE
from pipelines.registry.store import Registry
from pipelines.runs import runner
from pipelines.serve.serving import ServeSettings


def gate(ws: SimpleNamespace, settings: runner.GateSettings | None = None) -> runner.RunOutcome:
    job = runner.GateJob(artifact_dir=ws.artifact, baseline_dir=ws.baseline, recipe_name="w8a8", settings=settings or gate_settings(ws))
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
    assert version.gate.gate.verdict == "rejected" and version.gate == outcome.report  # gate.json, typed, as the run wrote it
    assert "max_abs_drop" in version.reason


def test_an_identical_rerun_starts_no_server_at_all(stack, workspace, capsys):
    first = gate(workspace)
    second = gate(workspace)
    assert stack.starts == ["baseline", "baseline_repeat", "candidate"]  # the baseline scored twice (the noise floor), then cached
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
    assert stack.starts == ["baseline", "baseline_repeat", "candidate", "candidate"]
    assert "baseline_serve_start_s" not in outcome.stages and "candidate_serve_start_s" in outcome.stages


def test_only_the_sets_missing_from_the_cache_are_scored(stack, workspace):
    gate(workspace)
    both = gate_settings(workspace).model_copy(update={"eval_sets": [workspace.eval_set, make_eval_set(workspace.root / "eval_sets", "orders")]})
    gate(workspace, both)
    assert stack.scored == [("baseline", ["tickets"]), ("baseline_repeat", ["tickets"]), ("candidate", ["tickets"]),
                            ("baseline", ["orders"]), ("baseline_repeat", ["orders"]), ("candidate", ["orders"])]


def _change_input(change: str, ws: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> runner.GateSettings:
    """Change one input of the cache key; returns the settings of the next run."""
    if change == "eval set data":
        return gate_settings(ws, eval_set=make_eval_set(ws.root / "eval_sets_v2", answers="xyz"))
    if change == "eval set helper":
        (ws.eval_set.folder / "utils.py").write_text("def process(doc):\n    return {**doc, 'q': doc['q'].strip()}\n")
    elif change == "max_model_len":
        return gate_settings(ws, serve=ServeSettings(max_model_len=1024))
    elif change == "dtype":
        return gate_settings(ws, serve=ServeSettings(dtype="float32"))
    elif change == "baseline model":
        (ws.baseline / "model.safetensors").write_bytes(b"retrained weights")
    elif change == "lm-eval arguments":
        command = evaluate.lm_eval_command
        monkeypatch.setattr(baseline_cache, "lm_eval_command", lambda *args: command(*args, num_concurrent=1))
    elif change == "datasets version":
        monkeypatch.setattr(baseline_cache, "project_versions", lambda: {"datasets": "0.0-other"})
    elif change == "scoring version":
        monkeypatch.setattr(baseline_cache, "SCORING_VERSION", baseline_cache.SCORING_VERSION + 1)
    return gate_settings(ws)


@pytest.mark.parametrize(
    "change",
    ["eval set data", "eval set helper", "max_model_len", "dtype", "baseline model", "lm-eval arguments", "datasets version", "scoring version"],
)
def test_a_changed_input_rescores_baseline_and_candidate(stack, workspace, monkeypatch, change):
    gate(workspace)
    outcome = gate(workspace, _change_input(change, workspace, monkeypatch))
    assert stack.starts == ["baseline", "baseline_repeat", "candidate", "baseline", "baseline_repeat", "candidate"]
    assert "baseline_serve_start_s" in outcome.stages


def test_timeouts_are_not_part_of_the_cache_key(stack, workspace):
    gate(workspace)
    gate(workspace, gate_settings(workspace, serve=ServeSettings(startup_timeout_s=999, request_timeout_s=9)))
    assert stack.starts == ["baseline", "baseline_repeat", "candidate"]


def test_a_corrupt_cache_entry_is_recomputed_not_trusted(stack, workspace):
    gate(workspace)
    for entry in (workspace.root / "cache").glob("*.json"):
        entry.write_text("{not json")
    gate(workspace)
    assert stack.starts == ["baseline", "baseline_repeat", "candidate", "baseline", "baseline_repeat", "candidate"]


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
    assert stack.starts == ["baseline", "baseline_repeat", "candidate", "candidate"]  # the baseline scores survived the failure
    assert len(run_folders(workspace)) == 2


def test_two_failures_of_one_recipe_in_the_same_second_keep_both_folders(stack, workspace, monkeypatch):
    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, check_lengths=lambda *args: (_ for _ in ()).throw(EvalError("too long"))))
    for _ in range(2):
        with pytest.raises(EvalError):
            gate(workspace)
    assert len([f for f in run_folders(workspace) if f.endswith("-error")]) == 2


def test_a_too_long_item_fails_before_any_server_starts(stack, workspace, monkeypatch):
    def too_long(eval_set, prompts, tokenizer_dir, max_model_len, reserve):
        raise EvalError(f"item 3 is 900 tokens; exceeds max_model_len {max_model_len}", file=eval_set.data, field=f"eval set {eval_set.name}")

    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, check_lengths=too_long))
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
    outcome = gate(workspace, gate_settings(workspace, registry=False))
    assert outcome.registry_version is None and outcome.gate_json.is_file()
    assert not workspace.registry.exists()


def test_an_artifact_without_manifest_is_refused_unless_unverified_is_allowed(stack, workspace):
    job = runner.GateJob(artifact_dir=workspace.baseline, baseline_dir=workspace.baseline, recipe_name="self", settings=gate_settings(workspace))
    with pytest.raises(InputError, match=r"manifest\.json: --artifact: .*--allow-unverified"):
        runner.run_gate(job)
    assert stack.starts == [] and not workspace.runs.exists() and not workspace.registry.exists()


def test_an_unverified_artifact_is_gated_and_reported_but_never_registered(stack, workspace, capsys):
    # `quantize gate --allow-unverified` on a model folder quantized elsewhere: a verdict, no registry entry.
    job = runner.GateJob(artifact_dir=workspace.baseline, baseline_dir=workspace.baseline, recipe_name="self",
                         settings=gate_settings(workspace), allow_unverified=True)
    outcome = runner.run_gate(job)
    assert (outcome.verdict, outcome.exit_code, outcome.registry_version, outcome.verified) == ("promoted", 0, None, False)
    assert not workspace.registry.exists() or Registry(workspace.registry).list() == []
    assert "UNVERIFIED" in capsys.readouterr().err
    artifact = json.loads(outcome.gate_json.read_text())["inputs"]["artifact"]
    assert artifact["verified"] is False and artifact["manifest_sha256"] is None and "unverified" in artifact
    assert UNVERIFIED_NOTE in outcome.report_md.read_text()


def test_a_rejected_unverified_run_still_exits_by_its_verdict(stack, workspace):
    stack.lost = 12
    job = runner.GateJob(artifact_dir=workspace.baseline, baseline_dir=workspace.baseline, recipe_name="self",
                         settings=gate_settings(workspace), allow_unverified=True)
    outcome = runner.run_gate(job)
    assert (outcome.verdict, outcome.exit_code, outcome.registry_version) == ("rejected", 1, None)
    assert not workspace.registry.exists() or Registry(workspace.registry).list() == []


def test_the_manifest_hash_is_in_gate_json_and_in_the_registry(stack, workspace):
    outcome = gate(workspace)
    expected = sha256_file(workspace.artifact / "manifest.json")
    artifact = json.loads(outcome.gate_json.read_text())["inputs"]["artifact"]
    assert (artifact["manifest_sha256"], artifact["verified"]) == (expected, True)
    assert outcome.manifest_sha256 == expected
    assert Registry(workspace.registry).list()[0].manifest_hash == expected


def test_a_tampered_artifact_is_refused_before_serving(stack, workspace):
    (workspace.artifact / "model.safetensors").write_bytes(b"swapped")
    with pytest.raises(InputError, match="model.safetensors.*sha256"):
        gate(workspace)
    assert stack.starts == [] and not workspace.runs.exists()


def test_a_folder_without_config_is_refused_naming_the_option(stack, workspace):
    job = runner.GateJob(artifact_dir=workspace.root / "nowhere", baseline_dir=workspace.baseline, recipe_name="x", settings=gate_settings(workspace))
    with pytest.raises(InputError, match="--artifact.*no config.json"):
        runner.run_gate(job)


def test_quantize_and_gate_records_the_quantize_step(stack, workspace, monkeypatch):
    import pipelines.quantize.oneshot

    manifest = SimpleNamespace(recipe="w8a8", recipe_text="name: w8a8\n", input_key="k" * 64, wall_time_s=4.25)
    calls = []

    def fake_quantize(recipe, model_dir, *, force=False, **kwargs):
        calls.append((recipe, model_dir, force))
        return SimpleNamespace(artifact_dir=workspace.artifact, manifest=manifest, reused=bool(calls[1:]))

    monkeypatch.setattr(pipelines.quantize.oneshot, "quantize_model", fake_quantize)
    first = runner.quantize_and_gate("w8a8", workspace.baseline, gate_settings(workspace), force=True)
    second = runner.quantize_and_gate("w8a8", workspace.baseline, gate_settings(workspace))
    assert calls == [("w8a8", workspace.baseline, True), ("w8a8", workspace.baseline, False)]
    assert (first.stages["quantize_s"], second.stages["quantize_s"]) == (4.25, 0.0)
    inputs = json.loads(second.gate_json.read_text())["inputs"]
    assert inputs["quantize_reused"] is True and inputs["quantize_input_key"] == "k" * 64
    assert Registry(workspace.registry).list()[0].recipe_hash == inputs["recipe_sha256"]


def test_select_eval_sets_names_unknown_sets(monkeypatch, workspace):
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: [workspace.eval_set])
    assert evalsets.select_eval_sets(None) == [workspace.eval_set]
    with pytest.raises(InputError, match=r"--eval-sets.*\['nope'\].*tickets"):
        evalsets.select_eval_sets(["tickets", "nope"])


# --- files readable as the umask allows --------------------------------------------------------------


@pytest.fixture
def umask():
    """Set the process umask for one test; restored afterwards."""
    before = os.umask(0o022)
    os.umask(before)
    yield lambda mask: os.umask(mask)
    os.umask(before)


@pytest.mark.parametrize(("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)])
def test_run_files_and_folders_get_the_umask_permissions(stack, workspace, umask, mask, file_mode, dir_mode):
    umask(mask)
    outcome = gate(workspace)
    assert stat.S_IMODE(outcome.run_dir.stat().st_mode) == dir_mode
    for path in (outcome.gate_json, outcome.report_md, *(workspace.root / "cache").glob("*.json")):
        assert stat.S_IMODE(path.stat().st_mode) == file_mode, path


@pytest.mark.parametrize(("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_atomic_writes_use_the_umask_not_mkstemp_private_modes(tmp_path, umask, mask, file_mode, dir_mode):
    from pipelines.files.atomic import atomic_dir, write_text_atomic

    umask(mask)
    write_text_atomic(tmp_path / "a.txt", "x")
    with atomic_dir(tmp_path / "folder") as staging:
        write_text_atomic(staging / "manifest.json", "{}")
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "folder").stat().st_mode) == dir_mode
    assert stat.S_IMODE((tmp_path / "folder" / "manifest.json").stat().st_mode) == file_mode


# --- full or read-only disk -----------------------------------------------------------------------------


def _fail(monkeypatch, target, name: str, predicate, code: int) -> None:
    real = getattr(target, name)

    def failing(*args, **kwargs):
        if predicate(*args):
            raise OSError(code, os.strerror(code), str(args[-1] if name == "replace" else args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)


@pytest.mark.parametrize("clean_up", ["works", "fails too"])
def test_a_full_disk_ends_exit_2_naming_the_first_error_and_leaves_no_staging(cli, workspace, monkeypatch, capsys, clean_up):
    # gate.json cannot be renamed into place: ENOSPC. With "fails too", error.txt and the rename of the
    # staging folder to <id>-error fail as well; the report must still name the first error.
    _fail(monkeypatch, os, "replace", lambda src, dst: Path(dst).name == "gate.json"
          or (clean_up == "fails too" and Path(dst).name.endswith("-error")), errno.ENOSPC)
    if clean_up == "fails too":
        _fail(monkeypatch, Path, "write_text", lambda path, *rest: path.name == "error.txt", errno.ENOSPC)
    assert cli() == 2
    err = capsys.readouterr().err
    assert "[Errno 28 ENOSPC] No space left on device" in err and "gate.json" in err, err
    assert "Traceback" not in err
    runs = workspace.root / "artifacts" / "runs"
    assert not list(runs.glob(".*.tmp")), list(runs.iterdir())
    folders = [p.name for p in runs.iterdir()]
    if clean_up == "works":
        (folder,) = folders
        assert folder.endswith("-error") and "ENOSPC" in (runs / folder / "error.txt").read_text()
    else:
        assert folders == []
    assert not workspace.registry.exists() or Registry(workspace.registry).list() == []


def test_a_read_only_runs_folder_ends_exit_2_naming_errno_and_path(cli, workspace, monkeypatch, capsys):
    runs = workspace.root / "artifacts" / "runs"
    _fail(monkeypatch, Path, "mkdir", lambda path, *rest: path.parent == runs, errno.EROFS)
    assert cli() == 2
    err = capsys.readouterr().err
    assert "[Errno 30 EROFS] Read-only file system" in err and str(runs) in err and "Traceback" not in err


@contextmanager
def tmpfs(folder: Path, size: str):
    """A real tmpfs of `size` at `folder` (root only); skips the test where mounting is not allowed."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(mounted.stderr or mounted.stdout).strip() or mounted.returncode}); "
                    "the monkeypatched ENOSPC/EROFS tests cover the same path")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_real_full_tmpfs_ends_exit_2_with_enospc(cli, workspace, capsys):
    root = workspace.root / "artifacts"
    with tmpfs(root, "64k"):
        (root / "runs").mkdir()
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        (root / "filler").write_bytes(b"\0" * max(free - 4096, 0))  # one page left
        assert cli() == 2
        err = capsys.readouterr().err
        assert "ENOSPC" in err and str(root) in err and "Traceback" not in err, err
        assert not list((root / "runs").glob(".*.tmp")), list((root / "runs").iterdir())


def test_a_real_read_only_tmpfs_ends_exit_2_with_erofs(cli, workspace, capsys):
    root = workspace.root / "artifacts"
    with tmpfs(root, "64k"):
        remount = subprocess.run(["mount", "-o", "remount,ro", str(root)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount the tmpfs read-only ({remount.stderr.strip()})")
        assert cli() == 2
        err = capsys.readouterr().err
        assert "EROFS" in err and str(root / "runs") in err and "Traceback" not in err, err
        assert list(root.iterdir()) == []


# --- staging folders of dead runs ------------------------------------------------------------------------


def test_a_run_reclaims_staging_folders_left_by_dead_runs(stack, workspace):
    workspace.runs.mkdir()
    stale = workspace.runs / ".20200101T000000Z-w8a8-999999-abcdef.tmp"
    stale.mkdir()
    (stale / "baseline-server.log").write_text("killed mid-run\n")
    os.utime(stale, (0, 0))
    finished = workspace.runs / "20200101T000000Z-w8a8-999999-abcdef-error"
    finished.mkdir()
    outcome = gate(workspace)
    assert not stale.exists() and finished.is_dir() and outcome.run_dir.is_dir()


def test_a_registry_that_cannot_be_written_fails_the_run_before_serving(stack, workspace, monkeypatch):
    from pipelines.registry import sqlite_db as registry_module

    Registry(workspace.registry)
    monkeypatch.setattr(registry_module, "_writable", lambda path: False)  # an existing registry ...
    monkeypatch.setattr(registry_module, "_creatable", lambda path: False)  # ... or one not created yet (the first write makes it)
    with pytest.raises(InputError, match="--registry: the registry cannot be written"):
        gate(workspace)
    assert stack.starts == [] and not workspace.runs.exists()
