"""`quantize` run / gate / job: argument handling, dispatch, exit codes and --json, with the work faked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import cli
from pipelines.commands import gate as gate_command
from pipelines.commands import job as job_command
from pipelines.commands import run as run_command
from pipelines.errors import ServeError
from pipelines.jobs.job import CandidateResult, JobSummary
from pipelines.paths import DEMO_MODEL_DIR
from pipelines.runs.runner import RunOutcome


def outcome(tmp_path: Path, verdict: str = "promoted") -> RunOutcome:
    run_dir = tmp_path / "runs" / "run-1"
    return RunOutcome(
        verdict=verdict, exit_code=0 if verdict == "promoted" else 1, run_dir=run_dir, gate_json=run_dir / "gate.json",
        report_md=run_dir / "report.md", artifact_dir=tmp_path / "artifact", registry_version=None,
        reasons=[] if verdict == "promoted" else ["tickets: drop 9.00 points > max_abs_drop 2.0"], stages={"gate_s": 0.1},
    )


@pytest.fixture(autouse=True)
def no_eval_sets_needed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # An empty eval-sets folder, not a patched function: a command module imported during the test keeps what it imported.
    (tmp_path / "no-eval-sets").mkdir()
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(tmp_path / "no-eval-sets"))
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "library-logs-root"))  # library logs stay out of the repository


@pytest.fixture(autouse=True)
def sigterm_handler_restored():
    # cli.main turns SIGTERM into KeyboardInterrupt; left in place, forked workers of later tests ignore
    # Pool.terminate() and the test run hangs.
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list:
    """Fakes for the run and gate entry points; each call is recorded, the verdict comes from `verdict`."""
    calls: list = []

    def fake_run(recipe, model_dir, settings, *, force=False):
        name = recipe.name  # the command loads the recipe once and passes it on
        calls.append(("run", name, model_dir, settings, force))
        return outcome(tmp_path, "rejected" if name == "aggressive" else "promoted")

    def fake_gate(job):
        calls.append(("gate", job))
        return outcome(tmp_path)

    monkeypatch.setattr(run_command, "quantize_and_gate", fake_run)
    monkeypatch.setattr(gate_command, "run_gate", fake_gate)
    return calls


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_recipe_without_a_command_dispatches_to_run(capsys, recorded):
    code, out, _ = run_cli(capsys, "--recipe", "w8a8", "--no-registry", "--json")
    assert code == 0
    ((kind, recipe, model, settings, force),) = recorded
    assert (kind, recipe, model, force) == ("run", "w8a8", DEMO_MODEL_DIR.resolve(), False)
    assert settings.registry_path is None and settings.serve.max_model_len == 512
    assert json.loads(out)["verdict"] == "promoted"


NOISY_RUN = """
import os, sys
from pathlib import Path
from pipelines import cli
from pipelines.evaluation import evalsets
from pipelines.runs import runner
from pipelines.commands import run as run_command
from pipelines.console.output import progress
from pipelines.runs.runner import RunOutcome

def noisy(*args, **kwargs):
    os.write(1, b"2026 | get_main_device | WARNING - No accelerator available!\\n")  # like llm-compressor's logger
    print("a library print")
    print("a library warning", file=sys.stderr)
    os.write(2, b"C code on fd 2\\n")
    progress("quantizing")  # the product's next line says where library output went
    folder = Path(sys.argv[1])
    return RunOutcome(verdict="promoted", exit_code=0, run_dir=folder, gate_json=folder / "gate.json",
                      report_md=folder / "report.md", artifact_dir=folder, reasons=[], stages={})

evalsets.discover_eval_sets = lambda: []
run_command.quantize_and_gate = noisy
sys.exit(cli.main(["--recipe", "w8a8", "--no-registry", *sys.argv[2:]]))
"""
LIBRARY_TEXT = ("No accelerator available", "a library print", "a library warning", "C code on fd 2")


def noisy_run(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    """The CLI in a real process (file descriptors 1 and 2 are real), its artifacts root in tmp_path."""
    env = {**os.environ, "QUANTGATE_ARTIFACTS": str(tmp_path / "artifacts")}
    return subprocess.run([sys.executable, "-c", NOISY_RUN, str(tmp_path), *options], capture_output=True, text=True, timeout=60, env=env)


def library_log_of(result: subprocess.CompletedProcess) -> Path:
    (line,) = [line for line in result.stderr.splitlines() if "library output" in line]
    return Path(re.search(r"goes to (\S+\.log);", line).group(1))


def test_json_stays_parseable_and_library_output_goes_to_a_log(tmp_path):
    result = noisy_run(tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdict"] == "promoted"
    assert not any(text in result.stderr for text in LIBRARY_TEXT), result.stderr
    log = library_log_of(result)
    assert log.parent == tmp_path / "artifacts" / "logs"
    assert all(text in log.read_text() for text in LIBRARY_TEXT)


def test_library_output_stays_off_the_result_on_stdout(tmp_path):
    from fakes import make_report

    (tmp_path / "gate.json").write_text(make_report().model_dump_json())
    result = noisy_run(tmp_path)
    assert result.returncode == 0, result.stderr
    assert not any(text in result.stdout or text in result.stderr for text in LIBRARY_TEXT)
    assert "Model: models/demo-llama" in result.stdout and "verdict: PROMOTED" in result.stderr
    assert result.stderr.index("library output") < result.stderr.index("> quantizing")


def test_a_refused_run_leaves_no_library_log_and_prints_its_error_alone(tmp_path):
    result = noisy_run(tmp_path, "--policy", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "artifacts").exists()


def test_verbose_shows_library_output_on_stderr_never_on_stdout(tmp_path):
    result = noisy_run(tmp_path, "--json", "--verbose")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdict"] == "promoted"
    assert all(text in result.stderr for text in LIBRARY_TEXT) and "library output" not in result.stderr
    assert result.stderr.index("C code on fd 2") < result.stderr.index("> quantizing")
    assert not (tmp_path / "artifacts" / "logs").exists()


def test_the_library_log_path_is_printed_whole_on_one_line(tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-" * 8)  # the path is wider than the 160 columns of a log
    deep.mkdir()
    result = noisy_run(deep, "--json")
    log = library_log_of(result)
    assert log.is_file() and len(str(log)) > 160


def error_lines(err: str) -> list[str]:
    """What stderr holds besides the product's progress lines ("> ...", e.g. where library output goes)."""
    return [line for line in err.strip().splitlines() if not line.startswith("> ")]


def test_backend_runs_the_recipe_on_another_toolkit_under_its_own_name(capsys, recorded):
    code, _, _ = run_cli(capsys, "--recipe", "gptq", "--backend", "gptqmodel", "--no-registry", "--json")
    assert code == 0 and recorded[0][1] == "gptq-gptqmodel"
    code, _, err = run_cli(capsys, "--recipe", "gptq", "--backend", "autogptq", "--no-registry")
    assert code == 2 and "--backend" in err and "autogptq" in err


def test_a_rejected_run_exits_1_and_reports_its_reasons_as_json(capsys, recorded, tmp_path):
    code, out, _ = run_cli(capsys, "run", "--recipe", "aggressive", "--registry", str(tmp_path / "r.db"), "--max-model-len", "256", "--json")
    result = json.loads(out)
    assert code == 1 and result["verdict"] == "rejected" and result["exit_code"] == 1
    assert result["reasons"] == ["tickets: drop 9.00 points > max_abs_drop 2.0"]
    settings = recorded[0][3]
    assert settings.registry_path == tmp_path / "r.db" and settings.serve.max_model_len == 256


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--recipe", "w8a8", "--policy", "no/such/policy.yaml"], "no/such/policy.yaml"),
        (["--recipe", "w8a8", "--eval-sets", "tickets,nope"], "--eval-sets"),
        (["gate", "--artifact", "a", "--baseline", "b", "--policy", "no/such/policy.yaml"], "no/such/policy.yaml"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_does_no_work(capsys, recorded, argv, named):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and recorded == []
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("quantize: error: ") and named in err


def test_a_bad_policy_file_names_the_field(capsys, recorded, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults:\n  max_abs_drop: lots\n")
    code, _, err = run_cli(capsys, "--recipe", "w8a8", "--policy", str(policy))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert str(policy) in err and "defaults.max_abs_drop" in err


def test_a_serving_failure_exits_2_with_one_line(capsys, monkeypatch):
    def failing(*args, **kwargs):
        raise ServeError("vLLM exited during start-up (exit code 1): ValueError: unknown architecture", file="run/candidate-server.log")

    monkeypatch.setattr(run_command, "quantize_and_gate", failing)
    code, out, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry")
    assert code == 2 and out == ""
    assert error_lines(err) == [
        "quantize: error: run/candidate-server.log: vLLM exited during start-up (exit code 1): ValueError: unknown architecture",
    ]


def test_gate_takes_the_recipe_name_from_the_manifest(capsys, recorded, tmp_path):
    artifact = tmp_path / "w8a8-0123"
    artifact.mkdir()
    (artifact / "manifest.json").write_text(json.dumps({"recipe": "w8a8"}))
    code, out, _ = run_cli(capsys, "gate", "--artifact", str(artifact), "--baseline", "models/demo-llama", "--no-registry", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "promoted"
    ((_, job),) = recorded
    assert job.recipe_name == "w8a8" and job.artifact_dir == artifact.resolve()
    assert job.baseline_dir == Path("models/demo-llama").resolve()


def test_gate_without_a_manifest_uses_the_folder_name_or_the_option(capsys, recorded, tmp_path):
    run_cli(capsys, "gate", "--artifact", str(tmp_path / "my-int8"), "--baseline", "b", "--no-registry", "--json")
    run_cli(capsys, "gate", "--artifact", str(tmp_path / "my-int8"), "--baseline", "b", "--recipe-name", "w8a8", "--no-registry", "--json")
    assert [job.recipe_name for _, job in recorded] == ["my-int8", "w8a8"]


@pytest.mark.parametrize(("statuses", "expected"), [(["promoted", "rejected"], 0), (["promoted", "error"], 2)])
def test_job_prints_a_json_summary_and_exits_by_its_results(capsys, monkeypatch, tmp_path, statuses, expected):
    results = [CandidateResult(model="demo-llama", recipe=f"r{i}", status=s, key=f"k{i}") for i, s in enumerate(statuses)]
    monkeypatch.setattr(job_command, "run_job", lambda path, **options: JobSummary(job="nightly", results=results, wall_s=1.0))
    code, out, _ = run_cli(capsys, "job", str(tmp_path / "job.yaml"), "--json")
    summary = json.loads(out)
    assert code == expected and summary["exit_code"] == expected
    assert [r["status"] for r in summary["results"]] == statuses


def test_job_without_json_prints_a_table(capsys, monkeypatch, tmp_path):
    results = [CandidateResult(model="demo-llama", recipe="w8a8", status="promoted", key="k", skipped=True)]
    monkeypatch.setattr(job_command, "run_job", lambda path, **options: JobSummary(job="nightly", results=results, wall_s=1.0))
    code, out, _ = run_cli(capsys, "job", str(tmp_path / "job.yaml"))
    assert code == 0 and "promoted (cached)" in out and "job nightly" in out


CI_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ci_gate_example.sh"


def fake_quantize(tmp_path: Path, code: int, verdict: str = "promoted") -> Path:
    """A stand-in `quantize` that writes a gate.json, prints the --json outcome and exits with `code`."""
    gate_json = tmp_path / "run" / "gate.json"
    gate_json.parent.mkdir()
    sets = [{"eval_set": "tickets", "metric": "exact_match", "baseline_score": 90.0, "candidate_score": 80.0,
             "delta": -10.0, "ci_low": -14.0, "ci_high": -6.0, "passed": verdict == "promoted"}]
    reasons = [] if verdict == "promoted" else ["tickets: drop 10.00 points > max_abs_drop 2.0"]
    warnings = ["tickets: 120 items < min_items 200"]
    gate_json.write_text(json.dumps({"gate": {"verdict": verdict, "reasons": reasons, "warnings": warnings, "sets": sets}}))
    script = tmp_path / "quantize"
    outcome = json.dumps({"verdict": verdict, "gate_json": str(gate_json)})
    prints = f"echo '{outcome}'\n" if code in (0, 1) else "echo 'quantize: error: boom' >&2\n"
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\n" + prints + f"exit {code}\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    ("code", "verdict", "expected", "first_line"),
    [
        (0, "promoted", 0, "verdict: promoted (exit 0)"),
        (1, "rejected", 1, "verdict: rejected (exit 1)"),
        (2, "promoted", 2, None),
        (0, "rejected", 2, "verdict: rejected (exit 0)"),  # gate.json and the exit code disagree: no decision
    ],
)
def test_the_ci_example_script_follows_the_exit_code_and_gate_json(tmp_path, code, verdict, expected, first_line):
    env = {"QUANTIZE": str(fake_quantize(tmp_path, code, verdict)), "PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    result = subprocess.run(["bash", str(CI_SCRIPT), "art", "base", "--eval-sets", "tickets"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == expected, result.stdout + result.stderr
    assert (tmp_path / "args").read_text().split() == ["gate", "--artifact", "art", "--baseline", "base", "--json", "--eval-sets", "tickets"]
    if first_line is None:
        assert result.stdout == "" and "NO DECISION (exit 2)" in result.stderr
        return
    assert result.stdout.splitlines()[0] == first_line
    assert "set tickets: exact_match 90.0 -> 80.0 (delta -10.00 points" in result.stdout
    assert "warning: tickets: 120 items < min_items 200" in result.stdout
    if verdict == "rejected":
        assert "reason: tickets: drop 10.00 points > max_abs_drop 2.0" in result.stdout


# --- the exit contract (docs/exit-codes.md) ------------------------------------------------------------------


@pytest.fixture
def logs_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The artifacts root internal-error tracebacks go under (logs/), private to the test."""
    root = tmp_path / "artifacts"
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(root))
    return root


def crash_with(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def crash(*args, **kwargs):
        raise error

    monkeypatch.setattr(run_command, "quantize_and_gate", crash)


def test_an_unexpected_exception_exits_2_with_one_line_and_the_traceback_in_a_log(capsys, monkeypatch, logs_root):
    crash_with(monkeypatch, RuntimeError("disk on\nfire"))
    code, out, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry")
    (line,) = error_lines(err)
    assert code == 2 and out == ""
    assert line.startswith("quantize: internal error: RuntimeError: disk on fire (traceback in ")
    log = Path(line.rsplit("traceback in ", 1)[1].removesuffix(")"))
    assert log.parent == logs_root / "logs"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: disk on" in text and "'--recipe', 'w8a8'" in text


def test_an_internal_error_with_json_is_one_object_on_stdout(capsys, monkeypatch, logs_root):
    crash_with(monkeypatch, KeyError("x"))
    code, out, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry", "--json")
    document = json.loads(out)
    assert code == 2 and document["exit_code"] == 2 and document["kind"] == "internal"
    assert document["error"] == "KeyError: 'x'" and Path(document["traceback"]).is_file()
    assert len(error_lines(err)) == 1


def test_the_traceback_goes_to_the_temporary_folder_when_the_artifacts_root_is_not_writable(capsys, monkeypatch, tmp_path):
    import tempfile

    blocker = tmp_path / "artifacts-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(blocker))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    crash_with(monkeypatch, RuntimeError("boom"))
    code, _, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry")
    assert code == 2 and f"(traceback in {tmp_path / 'tmp' / 'quantgate-logs'}" in err


@pytest.mark.parametrize("error", [SystemExit(1), SystemExit("library gave up"), MemoryError(), RecursionError("deep")])
def test_nothing_a_library_raises_exits_1(capsys, monkeypatch, logs_root, error):
    crash_with(monkeypatch, error)
    code, _, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry")
    (line,) = error_lines(err)
    assert code == 2 and line.startswith("quantize: internal error: ")


def test_an_error_claiming_exit_1_still_exits_2(capsys, monkeypatch):
    class Odd(ServeError):
        exit_code = 1

    crash_with(monkeypatch, Odd("server said no", file="server.log"))
    code, _, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry")
    assert code == 2 and error_lines(err) == ["quantize: error: server.log: server said no"]


def test_a_handler_returning_something_else_than_0_1_2_is_an_internal_error(capsys, monkeypatch, logs_root):
    monkeypatch.setattr(run_command, "quantize_and_gate", lambda *a, **k: None)
    monkeypatch.setattr(run_command, "print_outcome", lambda outcome, as_json: 7)
    code, _, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry")
    assert code == 2 and "returned 7, not 0, 1 or 2" in err


def test_an_interrupt_exits_2(capsys, monkeypatch):
    crash_with(monkeypatch, KeyboardInterrupt())
    code, _, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry")
    assert code == 2 and error_lines(err) == ["quantize: interrupted; servers stopped and partial outputs removed"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--recipe"], "argument --recipe: expected one argument"),
        ([], "the following arguments are required: --recipe"),
        (["registry", "show", "demo-llama"], "quantize registry show: the following arguments are required"),
        (["registry", "promote", "demo-llama", "99999999999999999999999", "--reason", "x"], "argument VERSION: must be an integer from 1 to"),
        (["plan", "--gpu", "T4", "--max-model-len", "0"], "argument --max-model-len: must be an integer from 1 to"),
        (["plan", "--gpu-memory-gib", "1e300"], "argument --gpu-memory-gib: must be a finite number"),
        (["plan", "--gpu-memory-gib", "nan"], "argument --gpu-memory-gib: must be a finite number"),
        (["eval-sets", "nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, argv, words):
    code, out, err = run_cli(capsys, *argv)
    (line,) = err.strip().splitlines()
    assert code == 2 and out == "" and line.startswith("quantize: error: quantize") and words in line
    with_json = ["--json", *argv] if argv[:1] == ["--recipe"] else [*argv, "--json"]  # `--recipe` would take it as its value
    code, out, _ = run_cli(capsys, *with_json)
    document = json.loads(out)
    assert code == 2 and document["kind"] == "usage" and document["exit_code"] == 2 and words in document["error"]


# --- the lazy command table ------------------------------------------------------------------------------------

IMPORTED_COMMANDS = """
import sys
from pipelines import cli
code = cli.main(sys.argv[1:])
loaded = sorted(name for name, command in cli.COMMANDS.items() if command.module in sys.modules)
print("LOADED", ",".join(loaded), code)
"""


def commands_loaded_by(tmp_path: Path, *argv: str) -> tuple[list[str], str]:
    env = {**os.environ, "QUANTGATE_ARTIFACTS": str(tmp_path / "artifacts")}
    result = subprocess.run([sys.executable, "-c", IMPORTED_COMMANDS, *argv], capture_output=True, text=True, timeout=120, env=env)
    last = result.stdout.strip().splitlines()[-1].split()
    assert last[0] == "LOADED", result.stderr
    return [name for name in last[1].split(",") if name] if len(last) == 3 else [], result.stdout


def test_help_lists_every_command_of_the_table_and_imports_none(tmp_path):
    loaded, out = commands_loaded_by(tmp_path, "--help")
    assert loaded == [] and out.rstrip().endswith(" 0")
    for name, command in cli.COMMANDS.items():
        assert re.search(rf"^\s+{re.escape(name)}\s", out, re.MULTILINE), name
        assert " ".join(command.summary.split()[:3]) in " ".join(out.split()), name


def test_only_the_chosen_command_is_imported(tmp_path):
    loaded, _ = commands_loaded_by(tmp_path, "eval-sets", "list", "--root", str(tmp_path))
    assert loaded == ["eval-sets"]


@pytest.mark.parametrize(("module", "words"), [
    ("pipelines.commands.no_such_module", "command 'broken' cannot be loaded from pipelines.commands.no_such_module: ModuleNotFoundError"),
    ("pipelines.console.output", "command 'broken': pipelines.console.output has no register(subparsers)"),
])
def test_a_command_that_cannot_load_is_an_internal_error_not_a_missing_command(capsys, monkeypatch, logs_root, module, words):
    monkeypatch.setitem(cli.COMMANDS, "broken", cli.Command(module, "a command whose module is broken"))
    code, out, err = run_cli(capsys, "broken")
    (line,) = error_lines(err)
    assert code == 2 and out == "" and line.startswith(f"quantize: internal error: CommandLoadError: {words}")
    assert "Traceback (most recent call last)" in Path(line.rsplit("traceback in ", 1)[1].removesuffix(")")).read_text()
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "a command whose module is broken" in out  # still listed: nothing is dropped


def test_a_command_that_does_not_register_its_name_is_an_internal_error(capsys, monkeypatch, logs_root, tmp_path):
    (tmp_path / "misnamed_command.py").write_text("def register(subparsers):\n    subparsers.add_parser('other-name')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "renamed", cli.Command("misnamed_command", "registers `other-name`, not `renamed`"))
    code, _, err = run_cli(capsys, "renamed")
    assert code == 2 and "command 'renamed': misnamed_command.register() did not add it" in err


def test_json_input_errors_name_file_and_field(capsys, recorded, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults:\n  max_abs_drop: .nan\n")
    code, out, err = run_cli(capsys, "--recipe", "w8a8", "--policy", str(policy), "--json")
    assert code == 2 and recorded == []
    assert json.loads(out) == {
        "error": "must be a finite number (got nan)", "file": str(policy), "field": "defaults.max_abs_drop",
        "kind": "input", "exit_code": 2,
    }
    assert err.strip() == f"quantize: error: {policy}: defaults.max_abs_drop: must be a finite number (got nan)"


def test_control_characters_in_an_error_are_shown_escaped(capsys, monkeypatch):
    crash_with(monkeypatch, ServeError("model \x1b]8;;http://evil.example\x07click\x1b]8;;\x07 died", file="x\x1b[2J.log"))
    _, _, err = run_cli(capsys, "--recipe", "w8a8", "--no-registry")
    assert "\x1b" not in err and "\x07" not in err and "x\\x1b[2J.log" in err


# --- what the registry prints is literal: rich markup in names and reasons is text ----------------------------


def test_registry_output_shows_markup_literally_and_renders_no_link(capsys, monkeypatch, tmp_path):
    import io

    from fakes import make_artifact, make_gate, new_version, promote
    from rich.console import Console

    from pipelines.console import output
    from pipelines.registry.store import Registry

    # A model name with markup is registered and judged (its bundle folder could not be named after it: it is never
    # promoted); a path-safe one is promoted with a reason full of markup, and aliased.
    model, reason = "m[/x]", "[/x] see [link=http://evil.example]here[/link]"
    registry = Registry(tmp_path / "r.db")
    rejected = registry.register(new_version(make_artifact(tmp_path / "a"), make_gate(tmp_path / "g.json"), model=model))
    registry.reject(rejected.id, reason)
    version = registry.register(new_version(make_artifact(tmp_path / "b", b"b"), make_gate(tmp_path / "h.json"), model="plain"))
    promote(registry, version, reason)
    terminal = io.StringIO()
    monkeypatch.setattr(output, "console", Console(file=terminal, force_terminal=True, width=250, highlight=False, emoji=False))
    monkeypatch.setattr("pipelines.commands.registry.say", output.say)
    db = ["--registry", str(tmp_path / "r.db")]
    for argv in (["show", model, "1"], ["show", "plain", "1"], ["list"], ["history"], ["alias", "plain", "prod", "1", "--reason", "[bold]x[/bold]"]):
        assert cli.main(["registry", *argv, *db]) == 0, capsys.readouterr().err
    printed = terminal.getvalue()
    assert "\x1b]8;" not in printed  # no OSC 8 hyperlink
    plain = re.sub(r"\x1b\[[0-9;]*m", "", printed)
    assert plain.count(reason) == 4 and plain.count(model) >= 3 and "plain: prod -> v1" in plain


def test_an_unknown_command_is_refused_with_the_list_and_the_nearest(capsys: pytest.CaptureFixture) -> None:
    from pipelines.cli import COMMANDS, main

    assert main(["bogus"]) == 2
    error = capsys.readouterr().err
    assert "unknown command 'bogus'" in error and all(name in error for name in COMMANDS) and "--recipe" not in error
    assert main(["doctr", "--help"]) == 2
    assert "did you mean 'doctor'?" in capsys.readouterr().err
    assert main(["\x1b[31m" + "x" * 500]) == 2
    error = capsys.readouterr().err
    assert "\x1b" not in error and len(error) < 400
