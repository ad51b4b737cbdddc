"""Session fixtures for the end-to-end tests: the real `quantize` command on the demo model, each run once.

Everything writes under one temporary folder (QUANTGATE_ARTIFACTS, QUANTGATE_REGISTRY), never into the
repository's artifacts/. The runs share that folder on purpose: the first run scores the 16-bit baseline,
every later run (and the job) reuses its cached scores and the quantized artifacts, which is what keeps
this suite at a few minutes on a 2-core machine. Each fixture runs its command once per session and
the tests read its exit code, JSON, gate.json, run folder and registry.

Every command gets its own marker in the environment, which vLLM and lm-eval inherit: after a command
returns, no process carrying its marker may be alive (servers are always stopped).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import NEGATIVE_CONTROL, NEGATIVE_CONTROL_SETS, QUANTIZE, CommandRun, Workspace, processes_with_marker

from pipelines.evaluation.evalsets import discover_eval_sets
from pipelines.paths import DEMO_EVAL_SETS, DEMO_MODEL_DIR, REPO_ROOT

CI_GATE_SCRIPT = REPO_ROOT / "scripts" / "ci_gate_example.sh"


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the demo model is missing ({DEMO_MODEL_DIR}); the end-to-end tests run on it")
    if not QUANTIZE.exists():
        pytest.fail(f"{QUANTIZE} is missing: install the package into the project environment (make setup)")
    return Workspace(tmp_path_factory.mktemp("quantgate"))


@pytest.fixture(scope="session")
def eval_set_names() -> list[str]:
    return list(DEMO_EVAL_SETS)


@pytest.fixture(scope="session")
def smallest_set(eval_set_names: list[str]) -> str:
    """The eval set with the fewest items: for checks that need one set, not all of them."""
    sets = {s.name: s.num_items for s in discover_eval_sets()}
    return min(eval_set_names, key=lambda name: (sets[name], name))


@pytest.fixture(scope="session")
def w8a8_run(workspace: Workspace) -> CommandRun:
    """The first run of the session: quantizes, scores the 16-bit baseline on every set (cold cache)."""
    return workspace.quantize("--recipe", "w8a8", "--eval-sets", ",".join(DEMO_EVAL_SETS), "--json")


@pytest.fixture(scope="session")
def aggressive_run(workspace: Workspace, w8a8_run: CommandRun) -> CommandRun:
    """The negative control under the default policy, after w8a8: a warm run (the baseline's scores are cached).
    `aggressive` where vLLM has a 4-bit weight-only kernel, `aggressive-w4a8` on AVX2 hosts (helpers.NEGATIVE_CONTROL)."""
    return workspace.quantize("--recipe", NEGATIVE_CONTROL, "--eval-sets", ",".join(NEGATIVE_CONTROL_SETS), "--json")


@pytest.fixture(scope="session")
def broken_model(workspace: Workspace) -> Path:
    """The demo model with an architecture no vLLM knows: passes every check before serving, fails to start."""
    folder = workspace.root / "broken-model"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def broken_start_run(workspace: Workspace, w8a8_run: CommandRun, broken_model: Path, smallest_set: str) -> CommandRun:
    return workspace.quantize(
        "gate", "--artifact", str(broken_model), "--baseline", str(DEMO_MODEL_DIR), "--eval-sets", smallest_set, "--json",
        "--allow-unverified",
    )


@pytest.fixture(scope="session")
def self_gate_run(workspace: Workspace, broken_start_run: CommandRun, smallest_set: str) -> CommandRun:
    """The CI example script gating the 16-bit model against itself; it runs after the failed start on purpose.
    Without the load test (it would start the baseline server once more; test_loadtest_e2e.py covers it)."""
    return workspace.run(
        ["bash", str(CI_GATE_SCRIPT), str(DEMO_MODEL_DIR), str(DEMO_MODEL_DIR), "--eval-sets", smallest_set, "--allow-unverified",
         "--no-loadtest"],
        env={"QUANTIZE": str(QUANTIZE), "PYTHON": sys.executable},
    )


@pytest.fixture(scope="session")
def no_process_left():
    """assert_no_process_left(run): nothing the command started (vLLM, engine core, lm-eval) is still alive."""

    def check(run: CommandRun) -> None:
        left = processes_with_marker(run.marker)
        assert left == [], f"processes of `{' '.join(run.argv[1:])}` still running: {left}"

    return check
