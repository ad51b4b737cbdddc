"""Names that become paths go through one sanitiser, and nothing is written outside the artifacts root.

The sources of such names: `gate --recipe-name`, a third-party manifest.json's `recipe`, an artifact or
model folder's name, a job's name and its candidates' model folders, run ids. Each hostile name is
refused (exit 2 / InputError naming the field), and a listing of the artifacts root's parent is the same
before and after.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fakes import FakeRunner, gate_settings, install, make_model

from pipelines.errors import InputError
from pipelines.evaluation import evalsets
from pipelines.files.safepath import MAX_COMPONENT, ensure_inside, inside, safe_component, safe_relative
from pipelines.jobs.job import run_job
from pipelines.runs import runfolder, runner

HOSTILE = {
    "traversal": "x/../../..",
    "dotdot": "..",
    "dot": ".",
    "hidden": ".bashrc",
    "absolute": "/etc/cron.d/evil",
    "backslash": "..\\..\\evil",
    "nul": "w8a8\x00/../../x",
    "newline": "w8a8\n",
    "space": "w8 a8",
    "very-long": "a" * (MAX_COMPONENT + 1),
    "very-long-traversal": "a/" * 2000 + "../" * 2000,
    "division-slash": "x\u2215..\u2215..",
    "fullwidth-dots": "\uff0e\uff0e",
    "one-dot-leader": "\u2024\u2024",
    "cyrillic-a": "w8\u04308",
    "empty": "",
}
NAMES = pytest.mark.parametrize("name", list(HOSTILE.values()), ids=list(HOSTILE))


# --- the sanitiser ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["w8a8", "demo-llama", "Llama-3.1-8B_instruct", "a" * MAX_COMPONENT, "x..y", "-dash"])
def test_safe_names_pass_unchanged(name):
    assert safe_component(name, "recipe") == name


@NAMES
def test_hostile_names_are_refused_naming_the_field(name):
    with pytest.raises(InputError) as caught:
        safe_component(name, "--recipe-name", file="somewhere/manifest.json")
    assert (caught.value.field, caught.value.file) == ("--recipe-name", "somewhere/manifest.json")
    assert "\x00" not in caught.value.one_line() and "\n" not in caught.value.one_line()
    assert len(caught.value.one_line()) < 400  # a very long name is shortened in the message


def test_non_strings_are_refused():
    with pytest.raises(InputError, match="not a string"):
        safe_component(["w8a8"], "recipe")


@pytest.mark.parametrize("relative", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a\\b", "a\x00b", "", "a/"])
def test_manifest_paths_must_be_plain_relative_paths(relative):
    with pytest.raises(InputError):
        safe_relative(relative, "artifact_files key")


@pytest.mark.parametrize("relative", ["model.safetensors", "sub/tokenizer.json", "weird name+1.bin"])
def test_plain_relative_manifest_paths_pass(relative):
    assert safe_relative(relative, "artifact_files key") == relative


def test_inside_follows_symbolic_links_and_folds_dotdot(tmp_path):
    root = tmp_path / "artifacts"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    assert inside(root, root / "runs" / "x")
    assert not inside(root, root / "runs" / ".." / ".." / "x")
    assert not inside(root, root / "link" / "x")
    assert not inside(root, "/etc/passwd")
    assert not inside(root, root / "a\x00b")
    with pytest.raises(InputError, match="refusing to write outside"):
        ensure_inside(root, root / "link" / "x", "run id")


# --- from the command line and from a manifest: nothing written outside the artifacts root ------------------


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def watched(workspace, tmp_path):
    """The artifacts root's parent (tmp_path), listed now; call it to assert nothing changed."""
    before = listing(tmp_path)

    def unchanged() -> None:
        assert listing(tmp_path) == before

    return unchanged


@NAMES
def test_a_hostile_recipe_name_from_the_command_line_is_refused(cli, stack, workspace, watched, capsys, name):
    assert cli("--recipe-name", name) == 2
    err = capsys.readouterr().err
    assert "--recipe-name" in err and "cannot be used in a path" in err and "Traceback" not in err
    assert stack.starts == []
    watched()


@pytest.mark.parametrize("name", [v for k, v in HOSTILE.items() if k != "empty"], ids=[k for k in HOSTILE if k != "empty"])
def test_a_hostile_recipe_name_from_a_third_party_manifest_is_refused(cli, stack, workspace, watched, capsys, name):
    manifest = workspace.artifact / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "recipe": name}))
    before = listing(workspace.root)
    assert cli() == 2
    err = capsys.readouterr().err
    assert f"{manifest}: recipe" in err and "cannot be used in a path" in err and "Traceback" not in err
    assert stack.starts == [] and listing(workspace.root) == before


@pytest.mark.parametrize("folder", ["w8 a8", "w8\u04308", "\uff0e\uff0e"], ids=["space", "cyrillic", "fullwidth-dots"])
def test_an_artifact_folder_name_used_as_recipe_name_is_checked(cli, stack, workspace, capsys, folder):
    renamed = workspace.artifact.rename(workspace.artifact.parent / folder)
    (renamed / "manifest.json").unlink()
    before = listing(workspace.root)
    code = runner_main_gate(renamed, workspace)
    err = capsys.readouterr().err
    assert code == 2 and "--artifact (folder name; or give --recipe-name)" in err
    assert listing(workspace.root) == before


def runner_main_gate(artifact: Path, ws) -> int:
    from pipelines.cli import main

    return main(["gate", "--artifact", str(artifact), "--baseline", str(ws.baseline), "--registry", str(ws.registry), "--allow-unverified"])


@NAMES
def test_run_gate_refuses_a_hostile_recipe_name_from_a_library_caller(stack, workspace, name):
    job = runner.GateJob(artifact_dir=workspace.artifact, baseline_dir=workspace.baseline, recipe_name=name, settings=gate_settings(workspace))
    with pytest.raises(InputError, match="recipe"):
        runner.run_gate(job)
    assert not workspace.runs.exists() and stack.starts == []


def test_a_safe_name_writes_only_inside_the_artifacts_root(cli, stack, workspace, capsys, monkeypatch):
    outside = [p for p in listing(workspace.root) if not p.startswith("artifacts") and p != "registry.db"]
    assert cli("--recipe-name", "w8a8", "--no-registry") == 0
    assert [p for p in listing(workspace.root) if not p.startswith("artifacts") and p != "registry.db"] == outside
    (run,) = (workspace.root / "artifacts" / "runs").iterdir()
    assert "-w8a8-" in run.name and not run.name.startswith(".")


# --- job names and model folder names ------------------------------------------------------------------------


@pytest.fixture
def job_root(tmp_path, monkeypatch):
    from fakes import make_eval_set

    sets = [make_eval_set(tmp_path / "eval_sets", "tickets")]
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: sets)
    make_model(tmp_path / "models" / "demo-llama")
    return tmp_path


@pytest.mark.parametrize("name", ["..", ".hidden", "."])
def test_a_job_name_that_is_not_a_safe_file_name_is_refused(job_root, monkeypatch, name):
    fake = install(monkeypatch, FakeRunner(job_root, {}))
    path = job_root / "job.yaml"
    path.write_text(f"name: '{name}'\ncandidates:\n  - model: models/demo-llama\n    recipes: [w8a8]\n")
    before = listing(job_root)
    with pytest.raises(InputError) as caught:
        run_job(path, jobs_dir=job_root / "artifacts" / "jobs")
    assert caught.value.file == str(path) and "name" in caught.value.one_line()
    assert fake.calls == [] and listing(job_root) == before


@pytest.mark.parametrize("folder", ["demo llama", "demo-\u0142lama", ".hidden-model"], ids=["space", "non-ascii", "hidden"])
def test_a_job_model_folder_that_cannot_name_an_artifact_folder_is_refused_at_plan_time(job_root, monkeypatch, folder):
    make_model(job_root / "models" / folder)
    fake = install(monkeypatch, FakeRunner(job_root, {}))
    path = job_root / "job.yaml"
    path.write_text(f"name: nightly\ncandidates:\n  - model: 'models/{folder}'\n    recipes: [w8a8]\n")
    with pytest.raises(InputError, match=r"candidates\.0\.model.*cannot be used in a path"):
        run_job(path, jobs_dir=job_root / "artifacts" / "jobs")
    assert fake.calls == [] and not (job_root / "artifacts").exists()


def test_quantize_refuses_a_model_folder_name_before_any_work(tmp_path, monkeypatch):
    import pipelines.quantize.oneshot as quantize

    model = make_model(tmp_path / "models" / "tiny \u0142lama")
    monkeypatch.setattr(quantize, "gather_inputs", lambda *a: pytest.fail("heavy work started"))
    with pytest.raises(InputError, match="model \\(folder name\\).*cannot be used in a path"):
        quantize.quantize_model("w8a8", model, artifacts_root=tmp_path / "artifacts")
    assert not (tmp_path / "artifacts").exists()


def test_run_ids_are_safe_components(monkeypatch):
    identifier = runfolder.run_id("w8a8")
    assert safe_component(identifier, "run id", max_length=200) == identifier
    assert identifier.split("-")[1] == "w8a8" and str(os.getpid()) in identifier
