"""Calibration data is the user's: --calibration per run, `calibration:` per job candidate, the recipe's as
default; `from-eval-sets` takes only prompts, only from each set's held-out calibration.jsonl, never a
scored item; calibrating another model on the demo's set says WARNING."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import make_model

from pipelines import cli
from pipelines.commands import run as run_command
from pipelines.errors import InputError
from pipelines.evaluation import evalsets
from pipelines.evaluation.evalsets import validate_eval_set
from pipelines.quantize import calibration
from pipelines.quantize.calibration import (
    calibration_inputs,
    check_calibration_source,
    draw_prompts,
    held_out_prompts,
    is_demo_model,
    warn_if_demo_calibration,
)
from pipelines.quantize.oneshot import gather_inputs
from pipelines.recipe import FROM_EVAL_SETS, Calibration
from pipelines.runs.runner import RunOutcome

ROUTING_YAML = """task: routing
dataset_path: json
dataset_kwargs:
  data_files:
    test: data.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Ticket: {{ticket}}\\nDepartment:"
doc_to_choice: [Billing, Shipping]
doc_to_target: label
"""
DATES_YAML = """task: dates
dataset_path: json
dataset_kwargs:
  data_files:
    test: data.jsonl
test_split: test
output_type: generate_until
doc_to_text: written
doc_to_target: "{{answer}}"
"""
PERPLEXITY_YAML = """task: prose
dataset_path: json
dataset_kwargs:
  data_files:
    test: data.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
"""


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_set(root: Path, name: str, yaml_text: str, scored: list[dict], held_out: list[dict] | None):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / f"{name}.yaml").write_text(yaml_text)
    jsonl(folder / "data.jsonl", scored)
    if held_out is not None:
        jsonl(folder / "calibration.jsonl", held_out)
    return validate_eval_set(folder)


@pytest.fixture
def sets(tmp_path: Path):
    routing = make_set(
        tmp_path / "eval_sets", "routing", ROUTING_YAML,
        # 60 scored items: enough for the default policy's tolerance (fewer are refused before any work)
        [{"ticket": f"scored ticket {i}", "label": i % 2, "answer": ["Billing", "Shipping"][i % 2]} for i in range(60)],
        [{"ticket": f"held-out ticket {i}", "label": 0, "answer": "Billing"} for i in range(5)],
    )
    dates = make_set(
        tmp_path / "eval_sets", "dates", DATES_YAML,
        [{"written": f"Date: {i % 28 + 1} May {2000 + i}\nISO date:", "answer": f"{2000 + i}-05-{i % 28 + 1:02d}"} for i in range(60)],
        [{"written": f"Date: {i} June 2021\nISO date:"} for i in range(1, 4)],  # answers may be left out altogether
    )
    return routing, dates


# --- from-eval-sets: prompts only, held-out items only --------------------------------------------------------


def test_held_out_prompts_are_rendered_prompts_without_answers(sets) -> None:
    routing, dates = sets
    prompts = held_out_prompts(routing)
    assert prompts == [f"Ticket: held-out ticket {i}\nDepartment:" for i in range(5)]
    assert not any("Billing" in p or "Shipping" in p for p in prompts)  # neither the answer nor the choices
    assert held_out_prompts(dates) == [f"Date: {i} June 2021\nISO date:" for i in range(1, 4)]  # a field name is a lookup


def test_from_eval_sets_never_draws_a_scored_item_or_an_answer(sets) -> None:
    texts, record = calibration_inputs(Calibration(num_samples=100, seed=3), source=FROM_EVAL_SETS, eval_sets=list(sets))
    scored_prompts = {f"Ticket: scored ticket {i}\nDepartment:" for i in range(6)} | {f"Date: {i} May 2020\nISO date:" for i in range(1, 7)}
    assert len(texts) == 8 and not set(texts) & scored_prompts
    answers = {"Billing", "Shipping"} | {f"2020-05-{i:02d}" for i in range(1, 7)}
    assert not any(answer in text for text in texts for answer in answers)
    assert record.dataset == "from-eval-sets: routing, dates" and record.num_samples == 8


def test_a_held_out_item_that_is_a_scored_item_is_refused_naming_both_lines(tmp_path: Path) -> None:
    scored = [{"ticket": f"t{i}", "label": 0} for i in range(3)]
    leaky = make_set(tmp_path, "routing", ROUTING_YAML, scored, [{"ticket": "fresh", "label": 1}, {"ticket": "t2", "label": 1}])
    with pytest.raises(InputError) as raised:
        held_out_prompts(leaky)
    error = raised.value
    assert error.field == "line 2" and str(error.file).endswith("routing/calibration.jsonl")
    assert "same prompt as data.jsonl line 3, an item the gate scores" in error.message and "\n" not in error.one_line()


def test_a_set_without_held_out_prompts_is_refused_with_the_fix(tmp_path: Path) -> None:
    bare = make_set(tmp_path, "routing", ROUTING_YAML, [{"ticket": "t", "label": 0}], None)
    with pytest.raises(InputError) as raised:
        calibration_inputs(Calibration(), source=FROM_EVAL_SETS, eval_sets=[bare])
    line = raised.value.one_line()
    assert "\n" not in line and "add calibration.jsonl to its folder" in line and "none of them scored" in line
    with pytest.raises(InputError, match="needs the eval sets the run scores"):
        calibration_inputs(Calibration(), source=FROM_EVAL_SETS, eval_sets=[])


def test_the_scored_file_cannot_double_as_the_held_out_file(tmp_path: Path) -> None:
    text = ROUTING_YAML.replace("test: data.jsonl", "test: calibration.jsonl")
    odd = make_set(tmp_path, "routing", text, [{"ticket": "t", "label": 0}], [{"ticket": "t", "label": 0}])
    with pytest.raises(InputError, match="is the data the gate scores"):
        held_out_prompts(odd)


def test_an_item_the_template_cannot_render_is_named(tmp_path: Path) -> None:
    broken = make_set(tmp_path, "routing", ROUTING_YAML, [{"ticket": "t", "label": 0}], [{"ticket": "ok"}, {"subject": "no ticket"}])
    with pytest.raises(InputError) as raised:
        held_out_prompts(broken)
    assert raised.value.field == "line 2" and "cannot render doc_to_text" in raised.value.message


def test_a_rolling_set_gives_its_held_out_documents(tmp_path: Path) -> None:
    prose = make_set(tmp_path, "prose", PERPLEXITY_YAML, [{"text": "scored prose"}], [{"text": "held-out prose"}])
    assert held_out_prompts(prose) == ["held-out prose"]


def test_draw_prompts_takes_each_set_in_turn_in_a_seeded_order() -> None:
    per_set = {"big": [f"b{i}" for i in range(10)], "small": ["s0", "s1"]}
    drawn = draw_prompts(per_set, 6, seed=0)
    assert len(drawn) == 6 and sum(p.startswith("s") for p in drawn) == 2  # the small set is not crowded out
    assert drawn == draw_prompts(per_set, 6, seed=0) and drawn != draw_prompts(per_set, 6, seed=1)
    assert len(draw_prompts(per_set, 100, seed=0)) == 12


def test_fewer_held_out_prompts_than_asked_uses_them_all_and_says_so(sets, capsys) -> None:
    texts, _ = calibration_inputs(Calibration(num_samples=64), source=FROM_EVAL_SETS, eval_sets=list(sets))
    assert len(texts) == 8
    assert "calibrating on all 8 held-out prompts of routing, dates (the recipe asks for 64)" in capsys.readouterr().err


# --- a path per run: part of the record, hence of the artifact's input key ---------------------------------------


def test_a_calibration_path_replaces_the_recipes_dataset_and_changes_the_record(tmp_path: Path) -> None:
    mine = jsonl(tmp_path / "mine.jsonl", [{"text": f"my traffic {i}"} for i in range(10)])
    folder = tmp_path / "theirs"
    folder.mkdir()
    jsonl(folder / "data.jsonl", [{"text": f"their traffic {i}"} for i in range(10)])
    recipe_calibration = Calibration(dataset=str(folder), num_samples=4, seed=1, max_seq_length=99)
    default_texts, default_record = calibration_inputs(recipe_calibration)
    texts, record = calibration_inputs(recipe_calibration, source=str(mine))
    assert all(t.startswith("their") for t in default_texts) and all(t.startswith("my") for t in texts)
    assert (record.dataset, record.num_samples, record.seed, record.max_seq_length) == (str(mine), 4, 1, 99)
    assert record.sha256 != default_record.sha256
    assert calibration_inputs(None, source=str(mine)) == ([], None)  # a recipe that calibrates nothing


def test_check_calibration_source_refuses_before_any_work(tmp_path: Path, sets) -> None:
    with pytest.raises(InputError, match="calibration data not found"):
        check_calibration_source(str(tmp_path / "absent.jsonl"), [])
    with pytest.raises(InputError, match="string field 'text'"):
        check_calibration_source(str(jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}])), [])
    good = jsonl(tmp_path / "good.jsonl", [{"text": "x"}])
    assert check_calibration_source(str(good), []) != check_calibration_source(str(jsonl(tmp_path / "other.jsonl", [{"text": "y"}])), [])
    assert len(check_calibration_source(FROM_EVAL_SETS, list(sets))) == 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "other-llama")


def test_the_input_key_and_the_record_follow_the_calibration(tmp_path: Path, model: Path, monkeypatch) -> None:
    monkeypatch.setattr(calibration, "DEMO_CALIBRATION_DIR", tmp_path / "no-demo-set")
    mine = jsonl(tmp_path / "mine.jsonl", [{"text": f"my traffic {i}"} for i in range(64)])
    default = gather_inputs("w8a8", model)
    own = gather_inputs("w8a8", model, calibration=str(mine))
    assert default.calibration.dataset == "calibration" and own.calibration.dataset == str(mine)
    assert own.key != default.key and own.texts != default.texts
    rtn = gather_inputs("w4a16", model, calibration=str(mine))  # RTN calibrates nothing: the same artifact as without
    assert rtn.calibration is None and rtn.key == gather_inputs("w4a16", model).key


# --- the demo's calibration set on another model: WARNING ----------------------------------------------------------


@pytest.fixture
def demo(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    demo_model = make_model(tmp_path / "demo-llama")
    demo_set = tmp_path / "eval_sets" / "calibration"
    demo_set.mkdir(parents=True)
    jsonl(demo_set / "data.jsonl", [{"text": f"Ticket: demo {i}\nDepartment: Billing"} for i in range(8)])
    monkeypatch.setattr(calibration, "DEMO_MODEL_DIR", demo_model)
    monkeypatch.setattr(calibration, "DEMO_CALIBRATION_DIR", demo_set)
    return demo_model, demo_set / "data.jsonl"


def warnings(err: str) -> list[str]:
    return [line.removeprefix("> ") for line in err.splitlines() if "WARNING" in line]


def test_another_model_on_the_demo_set_gets_a_loud_warning(demo, tmp_path: Path, capsys) -> None:
    _, demo_data = demo
    other = make_model(tmp_path / "smollm2-135m")
    (other / "config.json").write_text((other / "config.json").read_text().replace("256", "576"))
    assert warn_if_demo_calibration(demo_data, other)
    (line,) = warnings(capsys.readouterr().err)
    assert line.startswith("WARNING: calibrating smollm2-135m on the demo model's calibration set")
    assert "--calibration" in line and "from-eval-sets" in line
    copy = jsonl(tmp_path / "copy.jsonl", [json.loads(row) for row in demo_data.read_text().splitlines()])
    assert warn_if_demo_calibration(copy, other)  # the same data elsewhere is still the demo's set


def test_the_demo_model_or_other_data_gets_no_warning(demo, tmp_path: Path, capsys) -> None:
    demo_model, demo_data = demo
    assert not warn_if_demo_calibration(demo_data, demo_model)
    clone = tmp_path / "clone"
    clone.mkdir()
    for path in demo_model.iterdir():
        (clone / path.name).write_bytes(path.read_bytes())
    assert is_demo_model(clone) and not warn_if_demo_calibration(demo_data, clone)  # a copy of the demo model
    other = make_model(tmp_path / "other")
    (other / "config.json").write_text("{}")
    assert not is_demo_model(other)
    assert not warn_if_demo_calibration(jsonl(tmp_path / "mine.jsonl", [{"text": "mine"}]), other)
    assert warnings(capsys.readouterr().err) == []


def test_a_quantize_of_another_model_on_the_recipes_default_warns(demo, model: Path, capsys, monkeypatch) -> None:
    _, demo_data = demo
    monkeypatch.setattr(calibration, "load_calibration_texts", lambda *a: ["x"] * 64)
    monkeypatch.setattr(calibration, "resolve_calibration_data", lambda name: demo_data)
    gather_inputs("gptq", model)
    assert warnings(capsys.readouterr().err)[0].startswith("WARNING: calibrating other-llama")
    gather_inputs("w4a16", model)  # round-to-nearest calibrates nothing: nothing to warn about
    assert warnings(capsys.readouterr().err) == []


# --- the command line ---------------------------------------------------------------------------------------------


@pytest.fixture
def cli_world(monkeypatch, tmp_path: Path, sets):
    monkeypatch.setattr(evalsets, "discover_eval_sets", lambda: list(sets))
    calls: list = []

    def fake(recipe, model_dir, settings, *, force=False, **kwargs):
        calls.append(kwargs)
        return RunOutcome(verdict="promoted", exit_code=0, run_dir=tmp_path, gate_json=tmp_path / "gate.json",
                          report_md=tmp_path / "report.md", artifact_dir=tmp_path, reasons=[], stages={})

    monkeypatch.setattr(run_command, "quantize_and_gate", fake)
    return calls


@pytest.mark.parametrize("value", [FROM_EVAL_SETS, "FILE"])
def test_cli_passes_calibration_to_the_run(cli_world, tmp_path: Path, capsys, value: str) -> None:
    if value == "FILE":
        value = str(jsonl(tmp_path / "mine.jsonl", [{"text": "x"}]))
    assert cli.main(["--recipe", "gptq", "--calibration", value, "--no-registry", "--json"]) == 0
    assert cli_world == [{"calibration": value}]


def test_cli_without_calibration_calls_the_run_as_before(cli_world, capsys) -> None:
    assert cli.main(["--recipe", "gptq", "--no-registry", "--json"]) == 0
    assert cli_world == [{}]


def test_cli_bad_calibration_is_exit_2_before_quantizing(cli_world, tmp_path: Path, capsys) -> None:
    assert cli.main(["--recipe", "gptq", "--calibration", str(tmp_path / "absent.jsonl"), "--no-registry"]) == 2
    err = capsys.readouterr().err.strip()
    assert cli_world == [] and err.startswith("quantize: error:") and "calibration data not found" in err and "\n" not in err


def test_cli_from_eval_sets_uses_the_selected_sets_only(cli_world, tmp_path: Path, capsys) -> None:
    (tmp_path / "eval_sets" / "dates" / "calibration.jsonl").unlink()
    assert cli.main(["--recipe", "gptq", "--calibration", FROM_EVAL_SETS, "--eval-sets", "routing", "--no-registry", "--json"]) == 0
    assert cli.main(["--recipe", "gptq", "--calibration", FROM_EVAL_SETS, "--no-registry"]) == 2  # dates has no held-out file
    assert "eval set dates: add calibration.jsonl" in capsys.readouterr().err


# ------------------------------------------------------------------------------- bounded reading (issue 27)


def test_calibration_data_is_read_with_the_data_file_bounds(tmp_path: Path) -> None:
    """A 2 GiB file with no newline is refused by its size before a byte is read; a line past 1 MiB at that line."""
    from pipelines.quantize.calibration import check_calibration_source, load_calibration_texts

    huge = tmp_path / "huge.jsonl"
    with huge.open("wb") as handle:
        handle.truncate(2 * 1024**3)
    for read in (lambda: check_calibration_source(str(huge), None), lambda: load_calibration_texts(str(huge), 1, 0)):
        with pytest.raises(InputError, match="limited to 67108864 bytes") as caught:
            read()
        assert caught.value.file.endswith("huge.jsonl")
    long_line = tmp_path / "long.jsonl"
    long_line.write_bytes(b'{"text": "a"}\n{"text": "' + b"x" * (2 * 1024 * 1024) + b'"}\n')
    with pytest.raises(InputError, match="line longer than 1048576 bytes") as caught:
        load_calibration_texts(str(long_line), 1, 0)
    assert caught.value.field == "line 2"
