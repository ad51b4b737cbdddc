"""`quantize bakeoff` through cli.main, the row runner faked: bad input is one line and exit 2 before any row; a run prints
the table and the folder (or the JSON document) and exits by its rows."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator

import pytest

from pipelines.bakeoff import loop
from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.evaluation import evalsets


@pytest.fixture
def quantize(bake, monkeypatch: pytest.MonkeyPatch, capsys) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """`quantize bakeoff ARGS --model <the workspace's model>`: (exit code, stdout, stderr)."""
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: [bake.workspace.eval_set])
    handler = signal.getsignal(signal.SIGTERM)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["bakeoff", "--model", str(bake.workspace.baseline), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    signal.signal(signal.SIGTERM, handler)


@pytest.fixture
def runner(fake_runner, monkeypatch: pytest.MonkeyPatch):
    """The fake stands in for quantize_and_gate; gptq passes, gptq on bitsandbytes is refused with vLLM's reason."""
    fake = fake_runner({"gptq": {"speed": (1.2, (1.1, 1.3), "faster")},
                        "gptq-bitsandbytes": InputError("Unknown quantization method: bitsandbytes", field="backend")})
    monkeypatch.setattr(loop, "quantize_and_gate", fake)
    return fake


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--recipes", "gptq", "--backends", "llm-compressor,autogptq"], ["--backends", "'autogptq'", "gptqmodel"]),
        (["--recipes", "gptq", "--backends", " , "], ["--backends", "at least one backend"]),
        (["--recipes", "gptq,no-such-recipe"], ["no such recipe", "no-such-recipe"]),
        (["--recipes", "gptq", "--policy", "missing-policy.yaml"], ["missing-policy.yaml"]),
        (["--recipes", "gptq", "--eval-sets", "no-such-set"], ["no-such-set"]),
        (["--recipes", "gptq", "--registry", "registry.db"], ["--registry", "never registers"]),
        (["--backends", "gptqmodel"], ["--recipes"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_row(quantize, runner, argv, names) -> None:
    code, out, err = quantize(*argv)
    assert code == 2 and out == "" and runner.calls == []
    assert len(err.strip().splitlines()) == 1 and err.startswith("quantize: error:")
    assert all(name in err for name in names), err


def test_a_bad_model_folder_is_exit_2(quantize, runner, tmp_path) -> None:
    code = main(["bakeoff", "--recipes", "gptq", "--model", str(tmp_path / "nowhere")])
    assert code == 2 and runner.calls == []


def test_a_bakeoff_prints_its_table_conclusions_and_folder(quantize, runner, bake) -> None:
    code, out, err = quantize("--recipes", "gptq", "--backends", "llm-compressor,bitsandbytes")
    assert code == 0 and len(runner.calls) == 2
    assert "bake-off: 2 row(s): gptq on llm-compressor, gptq on bitsandbytes" in err
    assert "bake-off: row 2/2: gptq on bitsandbytes: refused (backend: Unknown quantization method: bitsandbytes)" in err
    assert "row 2 (gptq on bitsandbytes): refused: backend: Unknown quantization method: bitsandbytes" in out
    assert "smallest passing: gptq on llm-compressor" in out and "fastest passing: gptq on llm-compressor" in out
    [folder] = bake.bakeoffs.iterdir()
    assert f"in {folder} (exit 0)" in " ".join(out.split())


def test_json_is_the_bakeoff_document(quantize, runner, bake) -> None:
    code, out, _ = quantize("--recipes", "gptq", "--backends", "bitsandbytes,gptqmodel", "--json")
    document = json.loads(out)
    assert code == document["exit_code"] == 0
    assert [(row["recipe_name"], row["status"]) for row in document["rows"]] == [("gptq-bitsandbytes", "refused"), ("gptq-gptqmodel", "passed")]
    assert document["fastest_passing"] is None and "none is proven faster" in document["conclusions"][1]
    assert (bake.bakeoffs / document["folder"].rsplit("/", 1)[1] / "bakeoff.json").is_file()


def test_no_row_passing_exits_1_after_a_rejection_and_2_when_nothing_was_gated(quantize, fake_runner, monkeypatch) -> None:
    monkeypatch.setattr(loop, "quantize_and_gate", fake_runner({"gptq": {"verdict": "rejected"}, "gptq-gptqmodel": InputError("no")}))
    assert quantize("--recipes", "gptq", "--backends", "llm-compressor,gptqmodel")[0] == 1
    monkeypatch.setattr(loop, "quantize_and_gate", fake_runner({"gptq-gptqmodel": InputError("no")}))
    assert quantize("--recipes", "gptq", "--backends", "gptqmodel")[0] == 2
