"""The bake-off's run loop with a fake row runner: what each row records, refusals and failures as rows, exit codes, the
folder written atomically with its JSON, Markdown, PNG and recipes."""

from __future__ import annotations

import errno
import json

import pytest

from pipelines.bakeoff import output
from pipelines.bakeoff.loop import run_bakeoff, run_rows
from pipelines.bakeoff.records import Bakeoff
from pipelines.bounds import MiB
from pipelines.errors import EXIT_ERROR, EXIT_OK, EXIT_REJECTED, InputError, QuantizeError, ServeError
from pipelines.files.atomic import StorageError
from pipelines.recipe import load_recipe

BNB_REFUSAL = InputError("vLLM's CPU build cannot serve this format: Unknown quantization method: bitsandbytes",
                         file="recipes/gptq.yaml", field="backend")


def three_rows(fake_runner, **gptq):
    """gptq on llm-compressor (passes, faster), on gptqmodel (rejected), on bitsandbytes (refused with vLLM's reason)."""
    return fake_runner({
        "gptq": {"bytes": 1_000_000, "speed": (1.25, (1.1, 1.4), "faster"), "quantize_s": 12.5, "peak": 1500 * MiB, **gptq},
        "gptq-gptqmodel": {"verdict": "rejected", "bytes": 1_100_000, "quantize_s": 70.6},
        "gptq-bitsandbytes": BNB_REFUSAL,
    })


def test_each_row_records_verdict_bytes_speed_bounds_time_and_memory(bake, fake_runner) -> None:
    runner = three_rows(fake_runner)
    bakeoff = run_bakeoff(bake.plan(["gptq"]), runner, bakeoffs_dir=bake.bakeoffs)
    passed, rejected, refused = bakeoff.rows
    assert [row.status for row in bakeoff.rows] == ["passed", "rejected", "refused"]
    assert (passed.weight_bytes, passed.baseline_weight_bytes, passed.bytes_ratio) == (1_000_000, runner.baseline_bytes, 0.25)
    assert passed.speed.throughput_ratio == 1.25 and passed.speed.interval == [1.1, 1.4] and passed.speed.outcome == "faster"
    assert (passed.quantize_s, passed.peak_memory_bytes) == (12.5, 1500 * MiB)
    assert passed.backend.model_dump() == {"name": "llm-compressor", "version": "0.14.0.1", "format": "compressed-tensors"}
    [bound] = passed.sets
    assert bound.eval_set == "tickets" and bound.passed and bound.tolerance is not None and bound.worst_bound < bound.tolerance
    assert rejected.backend.model_dump() == {"name": "gptqmodel", "version": "7.7.0", "format": "gptq"}  # the manifest's record
    assert rejected.recipe_name == "gptq-gptqmodel" and rejected.reason and rejected.reasons and rejected.speed.outcome == "not measured"
    assert not rejected.sets[0].passed
    assert refused.reason == BNB_REFUSAL.one_line() and refused.weight_bytes is None and "\n" not in refused.reason
    assert [call[1] for call in runner.calls] == ["llm-compressor", "gptqmodel", "bitsandbytes"]
    assert all(call[2] is runner.calls[0][2] and call[2].registry_path is None for call in runner.calls)  # one settings, no registry
    assert bakeoff.exit_code == EXIT_OK and bakeoff.smallest_passing == bakeoff.fastest_passing == "gptq on llm-compressor"


def test_a_failed_row_is_a_row_and_the_bakeoff_goes_on(bake, fake_runner, capsys) -> None:
    runner = fake_runner({"w4a16": ServeError("the vLLM server died: see server.log", file="runs/x/server.log"),
                          "gptq-gptqmodel": QuantizeError("gptqmodel died: RuntimeError: out of memory (log: logs/gptqmodel.log)")})
    bakeoff = run_bakeoff(bake.plan(["w4a16", "gptq"], ["llm-compressor", "gptqmodel"]), runner, bakeoffs_dir=bake.bakeoffs)
    assert [(row.label, row.status) for row in bakeoff.rows] == [
        ("w4a16 on llm-compressor", "failed"), ("w4a16 on gptqmodel", "passed"), ("gptq on llm-compressor", "passed"),
        ("gptq on gptqmodel", "failed"),
    ]
    assert bakeoff.rows[0].reason == "ServeError: runs/x/server.log: the vLLM server died: see server.log"
    assert bakeoff.exit_code == EXIT_OK
    progress = capsys.readouterr().err
    assert "bake-off: row 1/4: w4a16 on llm-compressor ..." in progress
    assert "bake-off: row 4/4: gptq on gptqmodel: failed (QuantizeError: gptqmodel died: RuntimeError: out of memory (log:" in progress
    assert "2 passed, 0 rejected, 0 refused, 2 failed; 0 row(s) left" in progress


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [
        ({"gptq-gptqmodel": {"verdict": "rejected"}}, EXIT_OK),  # one passed
        ({"gptq": {"verdict": "rejected"}, "gptq-gptqmodel": BNB_REFUSAL}, EXIT_REJECTED),  # none passed, the gate rejected one
        ({"gptq": ServeError("died"), "gptq-gptqmodel": BNB_REFUSAL}, EXIT_ERROR),  # nothing gated: only errors
    ],
)
def test_the_exit_code_says_whether_a_row_passed(bake, fake_runner, behaviour, expected) -> None:
    bakeoff = run_bakeoff(bake.plan(["gptq"], ["llm-compressor", "gptqmodel"]), fake_runner(behaviour), bakeoffs_dir=bake.bakeoffs)
    assert bakeoff.exit_code == expected


def test_an_interruption_ends_the_bakeoff_with_nothing_written(bake, fake_runner) -> None:
    runner = fake_runner({"gptq-gptqmodel": KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        run_bakeoff(bake.plan(["gptq"]), runner, bakeoffs_dir=bake.bakeoffs)
    assert len(runner.calls) == 2 and not bake.bakeoffs.exists()


def test_the_folder_holds_json_markdown_png_and_the_gated_rows_recipes(bake, fake_runner) -> None:
    bakeoff = run_bakeoff(bake.plan(["gptq"]), three_rows(fake_runner), bakeoffs_dir=bake.bakeoffs)
    [folder] = bake.bakeoffs.iterdir()  # nothing else: no staging folder left beside it
    assert str(folder) == bakeoff.folder and folder.name.startswith("demo-llama-") and folder.name.endswith("Z")
    assert sorted(path.name for path in folder.iterdir()) == ["bakeoff.json", "bakeoff.md", "bakeoff.png", "recipes"]
    assert Bakeoff.model_validate(json.loads((folder / "bakeoff.json").read_text())) == bakeoff
    assert (folder / "bakeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (folder / "bakeoff.md").read_text()
    assert "| # | recipe | backend (version, format) | verdict |" in markdown
    assert "smallest passing: gptq on llm-compressor (0.95 MiB of weights, 0.25x the 16-bit model's)" in markdown
    assert "Unknown quantization method: bitsandbytes" in markdown and "![bytes vs throughput ratio](bakeoff.png)" in markdown
    assert sorted(path.name for path in (folder / "recipes").iterdir()) == ["gptq-gptqmodel.yaml", "gptq.yaml"]  # not the refused row's
    rerun = load_recipe(bakeoff.rows[1].recipe_file or "")
    assert rerun.name == "gptq-gptqmodel" and rerun.recipe.backend == "gptqmodel"


def test_a_second_bakeoff_in_the_same_second_gets_its_own_folder(bake, fake_runner) -> None:
    plan = bake.plan(["gptq"], ["llm-compressor"])
    first = run_bakeoff(plan, fake_runner({}), bakeoffs_dir=bake.bakeoffs)
    second = output.write_bakeoff(plan, first.rows, created=output.datetime.fromisoformat(first.created_at), wall_s=0.0,
                                  bakeoffs_dir=bake.bakeoffs)
    assert second.folder == first.folder + "-2" and len(list(bake.bakeoffs.iterdir())) == 2


def test_a_failed_write_leaves_no_folder(bake, fake_runner, monkeypatch) -> None:
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output, "write_plot", full_disk)
    with pytest.raises(StorageError, match="ENOSPC"):
        run_bakeoff(bake.plan(["gptq"]), three_rows(fake_runner), bakeoffs_dir=bake.bakeoffs)
    assert list(bake.bakeoffs.iterdir()) == []


def test_a_peak_the_process_had_reached_before_an_in_process_row_is_an_upper_bound(bake, fake_runner) -> None:
    plan = bake.plan(["gptq"], ["llm-compressor", "gptqmodel"])
    behaviour = {"gptq": {"peak": 900 * MiB}, "gptq-gptqmodel": {"peak": 900 * MiB}}
    earlier_rows_peak = run_rows(plan, fake_runner(behaviour), process_peak=lambda: 2000 * MiB)
    assert [row.peak_memory_upper_bound for row in earlier_rows_peak] == [True, False]  # gptqmodel's ran in its own process
    own_peak = run_rows(plan, fake_runner(behaviour), process_peak=lambda: 300 * MiB)
    assert [row.peak_memory_upper_bound for row in own_peak] == [False, False]
    reused = run_rows(plan, fake_runner({"gptq": {"reused": True}}), process_peak=lambda: 2000 * MiB)
    assert reused[0].quantize_reused is True and not reused[0].peak_memory_upper_bound  # recorded when it was made


def test_a_bakeoff_with_no_gated_row_still_writes_its_plot(bake, fake_runner) -> None:
    bakeoff = run_bakeoff(bake.plan(["gptq"], ["bitsandbytes"]), fake_runner({"gptq-bitsandbytes": BNB_REFUSAL}), bakeoffs_dir=bake.bakeoffs)
    assert bakeoff.exit_code == EXIT_ERROR
    folder = bake.bakeoffs / bakeoff.folder.rsplit("/", 1)[1]
    assert (folder / "bakeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (folder / "recipes").exists()
