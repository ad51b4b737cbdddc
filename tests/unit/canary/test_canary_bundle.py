"""The golden set through the product's own promotion: the runner fixes it on the promoted candidate's server (here a
fake OpenAI server stands behind the faked vLLM), the bundle carries it as evidence/canary.json under the signature, and
a golden set edited after signing is refused by `quantize registry verify` like any tampered bundle file."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, ToyModel
from fakes import promoted

from pipelines.canary.build import build_golden, draw, write_golden
from pipelines.canary.golden import GOLDEN_FILE, load_golden
from pipelines.cli import main
from pipelines.registry.evidence import EVIDENCE_DIR
from pipelines.runs import runner

MODEL = "demo-llama"
pytestmark = pytest.mark.slow  # whole gate runs and watch windows (several seconds each)


@pytest.fixture
def golden_stack(stack, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fake stack with a golden-set step that serves through the runner's factory and asks a fake OpenAI server."""
    served: list[str] = []

    def golden(serve, sources, path: Path) -> None:
        with serve() as server, FakeOpenAI(ToyModel()) as fake:
            served.append(server.served_name)
            write_golden(build_golden(fake.base_url, model="demo", api_key=None, drawn=draw(sources, 6, 0), seed=0, timeout_s=10), path)

    monkeypatch.setattr(runner, "STACK", stack.stack(golden=golden))
    return served


def test_a_promotion_signs_its_golden_set_and_an_edit_after_signing_is_refused(cli, workspace, golden_stack, capsys) -> None:
    version = promoted(cli, workspace)
    assert golden_stack == ["candidate"]
    bundle = workspace.registry.parent / "promoted" / MODEL / f"v{version.version}"
    golden = load_golden(bundle)
    assert golden is not None and len(golden.prompts) == 6 and golden.eval_sets == ["tickets"]
    registry = ["--registry", str(workspace.registry)]
    assert main(["registry", "verify", f"{MODEL}@{version.version}", *registry]) == 0
    path = bundle / EVIDENCE_DIR / GOLDEN_FILE
    loosened = golden.model_copy(update={"tolerance": golden.tolerance.model_copy(update={"kl_bound": 100.0})})
    path.write_text(loosened.model_dump_json(indent=1) + "\n")
    capsys.readouterr()
    assert main(["registry", "verify", f"{MODEL}@{version.version}", *registry]) == 2
    assert str(path) in capsys.readouterr().err


def test_a_rejected_candidate_gets_no_golden_set(cli, workspace, stack, golden_stack) -> None:
    stack.lost = 40  # every candidate item lost: rejected
    assert cli() == 1
    assert golden_stack == []
    assert not list(workspace.root.rglob(GOLDEN_FILE))
