"""The eval-set validator, materialisation, calibration loading and the `quantize eval-sets` command."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from fakes import TASK_CONFIG, write_eval_set

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.evaluation import evalsets
from pipelines.evaluation.metrics import make_spec
from pipelines.paths import EVAL_SETS_DIR
from pipelines.quantize.calibration import load_calibration_texts

GOOD_YAML = {**TASK_CONFIG, "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8}, "metric_list": [{"metric": "exact_match"}]}
GOOD_ITEMS = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)]


def write_set(
    root: Path, name: str = "refunds", config: dict | None = None, lines: list[str] | None = None, drop: tuple[str, ...] = (),
) -> Path:
    config = {key: value for key, value in {**GOOD_YAML, "task": name, **(config or {})}.items() if key not in drop}
    return write_eval_set(root, name, config, GOOD_ITEMS if lines is None else lines)


def test_a_good_set_validates(tmp_path: Path) -> None:
    found = evalsets.validate_eval_set(write_set(tmp_path))
    assert (found.name, found.task_name, found.output_type, found.num_items) == ("refunds", "refunds", "generate_until", 5)
    assert found.data == tmp_path / "refunds" / "data.jsonl"
    assert found.config == {**GOOD_YAML, "task": "refunds"}
    assert found.metric == make_spec("exact_match", "mean", True) and found.metric.kind == "binary"
    assert found.filter_name == "none"
    assert len(found.sha256) == 64


def invalid(tmp_path: Path, config: dict | None = None, lines: list[str] | None = None) -> InputError:
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(write_set(tmp_path, config=config, lines=lines))
    assert caught.value.file.endswith("refunds.yaml")
    return caught.value


MC_CONFIG = {"output_type": "multiple_choice", "doc_to_choice": ["yes", "no"], "doc_to_target": "label"}
MC_ITEMS = [json.dumps({"question": f"q{i}", "label": i % 2}) for i in range(4)]
ROLLING_CONFIG = {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{question}}"}


def test_a_lower_is_better_metric_is_read_from_the_yaml(tmp_path: Path) -> None:
    metric = [{"metric": "ter", "aggregation": "ter", "higher_is_better": False}]
    found = evalsets.validate_eval_set(write_set(tmp_path, config={"metric_list": metric}))
    assert found.metric == make_spec("ter", "ter", False)
    assert (found.metric.kind, found.metric.higher_is_better) == ("corpus", False)


def test_what_the_metric_entry_leaves_out_comes_from_lm_eval(tmp_path: Path) -> None:
    found = evalsets.validate_eval_set(write_set(tmp_path, config={"metric_list": [{"metric": "ter"}, {"metric": "exact_match"}]}))
    assert found.metric == make_spec("ter", "ter", False)  # lm_eval/api/metrics.py registers ter so


def test_a_set_without_metric_list_gets_lm_eval_s_default(tmp_path: Path) -> None:
    found = evalsets.validate_eval_set(write_set(tmp_path, drop=("metric_list",)))
    assert found.metric == make_spec("exact_match", "mean", True)


@pytest.mark.parametrize(
    ("metric", "spec"),
    [
        ({"metric": "f1", "aggregation": "f1", "higher_is_better": True}, make_spec("f1", "f1", True)),
        ({"metric": "mcc"}, make_spec("mcc", "matthews_corrcoef", True)),
        ({"metric": "acc_norm"}, make_spec("acc_norm", "mean", True)),
    ],
)
def test_multiple_choice_metrics_with_their_aggregation(tmp_path: Path, metric: dict, spec) -> None:
    found = evalsets.validate_eval_set(write_set(tmp_path, config={**MC_CONFIG, "metric_list": [metric]}, lines=MC_ITEMS))
    assert found.metric == spec
    assert found.metric.kind == ("corpus" if spec.name in ("f1", "mcc") else "binary")


@pytest.mark.parametrize(
    ("entry", "field", "words"),
    [
        ({"metric": "exact_match", "aggregation": "median"}, "metric_list[0].aggregation", "cannot judge aggregation 'median'"),
        ({"metric": "exact_match", "aggregation": "bleu"}, "metric_list[0].aggregation", "cannot aggregate 'exact_match'"),
        ({"metric": "bleu", "aggregation": "mean"}, "metric_list[0].aggregation", "lm-eval's own aggregation for it is 'bleu'"),
        ({"metric": "exact_match", "higher_is_better": "yes"}, "metric_list[0].higher_is_better", "true or false (got 'yes')"),
        ({"metric": "acc"}, "metric_list[0].metric", "no per-item 'acc' for generate_until"),
        ({"metric": "word_perplexity"}, "metric_list[0].metric", "no per-item 'word_perplexity'"),
        ({"aggregation": "mean"}, "metric_list[0].metric", "needs a metric name"),
    ],
)
def test_a_metric_the_gate_cannot_judge_is_refused(tmp_path: Path, entry: dict, field: str, words: str) -> None:
    error = invalid(tmp_path, config={"metric_list": [entry]})
    assert error.field == field
    assert words in error.message
    assert error.one_line().startswith(f"{error.file}: {field}: ")


def with_process_results(folder: Path, metric_entry: str) -> Path:
    """Swap the set's metric_list for a `!function` process_results and one metric entry (YAML text)."""
    config = yaml.safe_load((folder / "refunds.yaml").read_text())
    del config["metric_list"]
    text = yaml.safe_dump(config, sort_keys=False) + "process_results: !function helpers.score\nmetric_list:\n" + metric_entry
    (folder / "refunds.yaml").write_text(text)
    return folder


def test_a_custom_process_results_may_log_any_metric(tmp_path: Path) -> None:
    folder = with_process_results(write_set(tmp_path), "- metric: refund_ok\n  aggregation: mean\n  higher_is_better: true\n")
    found = evalsets.validate_eval_set(folder)
    assert found.metric == make_spec("refund_ok", "mean", True) and found.metric.kind == "continuous"
    assert isinstance(found.config["process_results"], evalsets.FunctionRef)


def test_a_custom_metric_must_say_how_it_is_aggregated_and_which_way_is_better(tmp_path: Path) -> None:
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(with_process_results(write_set(tmp_path / "a"), "- metric: refund_ok\n"))
    assert caught.value.field == "metric_list[0].aggregation" and "no default aggregation for 'refund_ok'" in caught.value.message
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(with_process_results(write_set(tmp_path / "b"), "- metric: refund_ok\n  aggregation: mean\n"))
    assert caught.value.field == "metric_list[0].higher_is_better" and "no default for 'refund_ok'" in caught.value.message


def test_a_rolling_set_is_accepted_with_an_empty_doc_to_text(tmp_path: Path) -> None:
    config = {**ROLLING_CONFIG, "metric_list": [{"metric": "bits_per_byte"}]}
    found = evalsets.validate_eval_set(write_set(tmp_path, config=config, drop=("generation_kwargs",)))
    assert found.output_type == "loglikelihood_rolling" and found.config["doc_to_text"] == ""
    assert found.metric == make_spec("bits_per_byte", "bits_per_byte", False)
    assert (found.metric.kind, found.metric.higher_is_better) == ("corpus", False)


def test_a_rolling_set_without_metric_list_is_judged_by_word_perplexity(tmp_path: Path) -> None:
    found = evalsets.validate_eval_set(write_set(tmp_path, config=ROLLING_CONFIG, drop=("metric_list", "generation_kwargs")))
    assert found.metric == make_spec("word_perplexity", "weighted_perplexity", False)


def test_doc_to_text_empty_is_only_for_rolling_sets(tmp_path: Path) -> None:
    error = invalid(tmp_path, config={"doc_to_text": ""})
    assert error.field == "doc_to_text" and "only a loglikelihood_rolling set" in error.message


def test_a_rolling_set_still_needs_the_doc_to_text_key(tmp_path: Path) -> None:
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(write_set(tmp_path, config=ROLLING_CONFIG, drop=("doc_to_text", "metric_list")))
    assert caught.value.field == "doc_to_text" and 'doc_to_text: ""' in caught.value.message


def test_an_unknown_output_type_is_reported_before_a_missing_doc_to_text(tmp_path: Path) -> None:
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(write_set(tmp_path, config={"output_type": "ranking"}, drop=("doc_to_text",)))
    assert caught.value.field == "output_type" and "'ranking'" in caught.value.message


TWO_FILTERS = [
    {"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]},
    {"name": "raw", "filter": [{"function": "take_first"}]},
]


def test_the_first_filter_is_the_judged_one(tmp_path: Path) -> None:
    assert evalsets.validate_eval_set(write_set(tmp_path, config={"filter_list": TWO_FILTERS})).filter_name == "strip"


def test_a_filter_without_a_name_of_its_own_is_refused(tmp_path: Path) -> None:
    error = invalid(tmp_path, config={"filter_list": [TWO_FILTERS[0], {**TWO_FILTERS[1], "name": "strip"}]})
    assert error.field == "filter_list[1].name"


def test_the_hash_follows_the_data(tmp_path: Path) -> None:
    folder = write_set(tmp_path)
    before = evalsets.validate_eval_set(folder).sha256
    with (folder / "data.jsonl").open("a") as handle:
        handle.write(json.dumps({"question": "q9", "answer": "a9"}) + "\n")
    assert evalsets.validate_eval_set(folder).sha256 != before


def test_missing_data_file_names_the_yaml_and_field(tmp_path: Path) -> None:
    folder = write_set(tmp_path)
    (folder / "data.jsonl").unlink()
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.file.endswith("refunds.yaml")
    assert caught.value.field == "dataset_kwargs.data_files"
    assert "data.jsonl" in caught.value.message


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    lines = [json.dumps(item) for item in GOOD_ITEMS]
    lines.insert(2, '{"question": "q", "answer": ')
    folder = write_set(tmp_path, lines=lines)
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.file.endswith("data.jsonl")
    assert caught.value.field == "line 3"
    assert "invalid JSON" in caught.value.one_line()


def test_unknown_yaml_key_names_the_key(tmp_path: Path) -> None:
    folder = write_set(tmp_path, config={"doc_to_txt": "{{question}}"})
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.file.endswith("refunds.yaml")
    assert caught.value.field == "doc_to_txt"


def test_every_task_config_field_is_accepted() -> None:
    from lm_eval.api.task import TaskConfig

    assert evalsets.task_config_keys() == {f.name for f in dataclasses.fields(TaskConfig)}


def test_missing_required_key(tmp_path: Path) -> None:
    config = {k: v for k, v in GOOD_YAML.items() if k != "doc_to_target"}
    folder = tmp_path / "refunds"
    folder.mkdir()
    (folder / "refunds.yaml").write_text(yaml.safe_dump(config))
    (folder / "data.jsonl").write_text(json.dumps(GOOD_ITEMS[0]) + "\n")
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.field == "doc_to_target"


def test_item_missing_a_template_field_names_the_line(tmp_path: Path) -> None:
    lines = [json.dumps(item) for item in GOOD_ITEMS] + [json.dumps({"answer": "x"})]
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(write_set(tmp_path, lines=lines))
    assert caught.value.field == "line 6"
    assert "'question'" in caught.value.message and "doc_to_text" in caught.value.message


def test_item_missing_the_target_field(tmp_path: Path) -> None:
    lines = [json.dumps({"question": "q"})]
    with pytest.raises(InputError, match=r"'answer'.*doc_to_target"):
        evalsets.validate_eval_set(write_set(tmp_path, lines=lines))


def test_multiple_choice_label_out_of_range(tmp_path: Path) -> None:
    config = {
        "output_type": "multiple_choice",
        "doc_to_choice": ["yes", "no"],
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc"}],
    }
    lines = [json.dumps({"question": "q", "label": 1}), json.dumps({"question": "q", "label": 2})]
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(write_set(tmp_path, config=config, lines=lines))
    assert caught.value.field == "line 2"


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    folder = write_set(tmp_path)
    (folder / "refunds.yaml").write_text("task: refunds\ndoc_to_text: [unclosed\n  more: x\n")
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.file.endswith("refunds.yaml")
    assert caught.value.field.startswith("line ")


def test_task_name_must_match_the_folder(tmp_path: Path) -> None:
    folder = write_set(tmp_path)
    config = {**GOOD_YAML, "task": "other"}
    (folder / "refunds.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.field == "task"


def test_folder_without_task_yaml(tmp_path: Path) -> None:
    (tmp_path / "loose").mkdir()
    with pytest.raises(InputError, match=r"no task YAML loose\.yaml"):
        evalsets.validate_eval_set(tmp_path / "loose")


def test_discovery_keeps_going_past_a_broken_set_and_names_it(tmp_path: Path) -> None:
    write_set(tmp_path, "refunds")
    write_set(tmp_path, "warranty", lines=['{"question": "q", "answer": "a"}', "not json"])
    (tmp_path / "loose").mkdir()
    found = evalsets.discover_eval_sets(tmp_path)
    assert [s.name for s in found] == ["refunds"]
    assert sorted(found.broken) == ["loose", "warranty"]
    assert "line 2: invalid JSON" in found.broken["warranty"].one_line()


def test_discovery_skips_calibration_and_hidden_folders(tmp_path: Path) -> None:
    write_set(tmp_path, "refunds")
    write_set(tmp_path, "warranty")
    (tmp_path / ".cache").mkdir()
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    (calibration / "set.yaml").write_text("kind: calibration\n")
    (calibration / "data.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    assert [s.name for s in evalsets.discover_eval_sets(tmp_path)] == ["refunds", "warranty"]


def test_materialized_task_points_at_the_absolute_data(tmp_path: Path) -> None:
    found = evalsets.validate_eval_set(write_set(tmp_path / "sets"))
    include = evalsets.materialize_task(found, tmp_path / "run")
    written = yaml.safe_load((include / "refunds.yaml").read_text())
    data_path = Path(written["dataset_kwargs"]["data_files"]["test"])
    assert data_path.is_absolute() and data_path == found.data.resolve()
    assert {k: v for k, v in written.items() if k != "dataset_kwargs"} == {
        k: v for k, v in GOOD_YAML.items() if k != "dataset_kwargs"
    }


def test_materialize_keeps_function_tags(tmp_path: Path) -> None:
    folder = write_set(tmp_path / "sets")
    text = (folder / "refunds.yaml").read_text() + "process_results: !function helpers.score\n"
    (folder / "refunds.yaml").write_text(text)
    (folder / "helpers.py").write_text("def score(doc, results):\n    return {}\n")
    include = evalsets.materialize_task(evalsets.validate_eval_set(folder), tmp_path / "run")
    written = evalsets.load_task_config(include / "refunds.yaml")
    assert isinstance(written["process_results"], evalsets.FunctionRef)
    assert written["process_results"] == "helpers.score"
    assert (include / "helpers.py").is_file()


def test_calibration_texts_are_sampled_reproducibly(tmp_path: Path) -> None:
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(50)))
    first = load_calibration_texts(str(data), 10, seed=3)
    assert first == load_calibration_texts(str(data), 10, seed=3)
    assert first != load_calibration_texts(str(data), 10, seed=4)
    assert len(set(first)) == 10 and all(text.startswith("line ") for text in first)
    with pytest.raises(InputError, match="asks for 51"):
        load_calibration_texts(str(data), 51, seed=3)


def test_calibration_line_without_text(tmp_path: Path) -> None:
    data = tmp_path / "calib.jsonl"
    data.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(InputError) as caught:
        load_calibration_texts(str(data), 1, seed=0)
    assert caught.value.field == "line 2"


def test_shipped_sets_validate() -> None:
    shipped = evalsets.discover_eval_sets(EVAL_SETS_DIR)
    assert len(shipped) >= 3
    assert {s.output_type for s in shipped} == {"generate_until", "multiple_choice"}
    assert all(s.num_items >= 200 for s in shipped)
    calibration = evalsets.validate_calibration_set(EVAL_SETS_DIR / "calibration")
    assert calibration.num_items >= 256


def test_shipped_calibration_is_disjoint_from_eval_items() -> None:
    calibration = {json.loads(line)["text"] for line in (EVAL_SETS_DIR / "calibration" / "data.jsonl").read_text().splitlines()}
    for found in evalsets.discover_eval_sets(EVAL_SETS_DIR):
        for _, item in evalsets.iter_jsonl(found.data):
            prompt = evalsets.render_template(found.config["doc_to_text"], item)
            assert not any(text.startswith(prompt + " ") for text in calibration), prompt


def test_cli_validate_reports_the_broken_set(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_set(tmp_path, "refunds")
    write_set(tmp_path, "warranty", lines=['{"question": "q", "answer": "a"}', "not json"])
    assert main(["eval-sets", "validate", "--root", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # one JSON document: the error, with every set's row
    assert document["exit_code"] == 2 and document["kind"] == "input" and document["field"] == "line 2"
    assert document["file"].endswith("warranty/data.jsonl") and document["error"].startswith("invalid JSON")
    rows = document["sets"]
    assert [(r["name"], r["status"]) for r in rows] == [("refunds", "ok"), ("warranty", "error")]
    error_lines = captured.err.strip().splitlines()
    assert len(error_lines) == 1
    assert error_lines[0].startswith("quantize: error: ") and "data.jsonl: line 2: invalid JSON" in error_lines[0]


def test_cli_list_and_validate_succeed_on_good_sets(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_set(tmp_path, "refunds")
    assert main(["eval-sets", "validate", "--root", str(tmp_path)]) == 0
    assert "refunds" in capsys.readouterr().out
    assert main(["eval-sets", "list", "--root", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["items"] == len(GOOD_ITEMS)


def test_identical_lines_are_two_items(tmp_path: Path) -> None:
    line = json.dumps(GOOD_ITEMS[0])
    assert evalsets.validate_eval_set(write_set(tmp_path, lines=[line, line])).num_items == 2


# --- eval sets are code: templates rendered in a sandbox, data only from the set's folder --------------------


@pytest.mark.parametrize(("template", "words"), [
    ("{{ self.__init__.__globals__ }}", "refused by the template sandbox"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "refused by the template sandbox"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused by the template sandbox"),
    ("{% set seen = [] %}{{ seen.append(question) }}", "refused by the template sandbox"),
    ("{{ 'x' * 10**10 }}", "refused by the template sandbox"),
    ("{{ 9 ** 99999999 }}", "refused by the template sandbox"),
    ("{{ question.missing.deeper }}", "undefined in the template"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for i in range(10**9) %}x{% endfor %}", "MAX_RANGE"),
])
def test_a_template_the_sandbox_refuses_names_the_key_and_the_item(tmp_path: Path, template: str, words: str) -> None:
    error = invalid(tmp_path, config={"doc_to_text": template})
    assert error.field == "doc_to_text" and words in error.message
    assert "data.jsonl line 1)" in error.message  # the first item it was rendered for


def test_a_jinja_syntax_error_names_the_key(tmp_path: Path) -> None:
    error = invalid(tmp_path, config={"doc_to_target": "{% if %}"})
    assert error.field == "doc_to_target" and error.message.startswith("Jinja syntax error: ")


def test_an_item_specific_failure_names_its_line(tmp_path: Path) -> None:
    lines = [json.dumps({"question": 2, "answer": "a"}), json.dumps({"question": 0, "answer": "a"})]
    error = invalid(tmp_path, config={"doc_to_text": "{{ 10 / question }}"}, lines=lines)
    assert error.field == "doc_to_text" and "ZeroDivisionError" in error.message and "data.jsonl line 2)" in error.message


def test_safe_templates_render_as_lm_eval_renders_them(tmp_path: Path) -> None:
    config = {"doc_to_text": "Q: {{ question | upper | regex_replace('Q', 'K') }}", "doc_to_target": "{{ (answer | string)[:1] }}"}
    found = evalsets.validate_eval_set(write_set(tmp_path, config=config))
    assert evalsets.render_template(found.config["doc_to_text"], GOOD_ITEMS[0]) == "Q: K0"


def test_a_rendered_doc_to_choice_must_be_a_list(tmp_path: Path) -> None:
    config = {**MC_CONFIG, "doc_to_choice": "{{ question }}", "metric_list": [{"metric": "acc"}]}
    error = invalid(tmp_path, config=config, lines=MC_ITEMS)
    assert error.field == "doc_to_choice" and "list literal" in error.message
    found = evalsets.validate_eval_set(write_set(tmp_path / "ok", config={**config, "doc_to_choice": "{{ ['yes', 'no'] }}"}, lines=MC_ITEMS))
    assert found.num_items == len(MC_ITEMS)


@pytest.mark.parametrize(("data_files", "field", "words"), [
    ({"test": "/etc/passwd"}, "dataset_kwargs.data_files.test", "relative to the set's folder"),
    ({"test": "../other/data.jsonl"}, "dataset_kwargs.data_files.test", "no '..'"),
    ({"test": "sub/../../x.jsonl"}, "dataset_kwargs.data_files.test", "no '..'"),
    ({"test": "~/data.jsonl"}, "dataset_kwargs.data_files.test", "relative to the set's folder"),
    ({"test": "https://evil.example/d.jsonl"}, "dataset_kwargs.data_files.test", "no URL"),
    ({"test": "*.jsonl"}, "dataset_kwargs.data_files.test", "no glob"),
    ({"test": "data.jsonl", "train": "/etc/shadow"}, "dataset_kwargs.data_files.train", "relative to the set's folder"),
])
def test_data_files_must_stay_inside_the_set_folder(tmp_path: Path, data_files: dict, field: str, words: str) -> None:
    error = invalid(tmp_path, config={"dataset_kwargs": {"data_files": data_files}})
    assert error.field == field and words in error.message


def test_a_symlink_out_of_the_set_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(json.dumps(GOOD_ITEMS[0]) + "\n")
    folder = write_set(tmp_path / "sets", config={"dataset_kwargs": {"data_files": {"test": "linked.jsonl"}}})
    (folder / "linked.jsonl").symlink_to(outside)
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.field == "dataset_kwargs.data_files.test" and "leads outside the set's folder" in caught.value.message
    (folder / "inside.jsonl").symlink_to(folder / "data.jsonl")  # a link that stays inside is fine
    (folder / "refunds.yaml").write_text((folder / "refunds.yaml").read_text().replace("linked.jsonl", "inside.jsonl"))
    assert evalsets.validate_eval_set(folder).num_items == len(GOOD_ITEMS)


def test_dataset_kwargs_other_than_data_files_are_refused(tmp_path: Path) -> None:
    error = invalid(tmp_path, config={"dataset_kwargs": {"data_files": {"test": "data.jsonl"}, "data_dir": "/etc"}})
    assert error.field == "dataset_kwargs.data_dir"


def test_function_helpers_are_kept_as_data_and_never_imported(tmp_path: Path) -> None:
    folder = write_set(tmp_path / "sets")
    marker = tmp_path / "imported"
    (folder / "helpers.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef score(doc, results):\n    return {{}}\n")
    (folder / "refunds.yaml").write_text((folder / "refunds.yaml").read_text() + "process_results: !function helpers.score\n")
    found = evalsets.validate_eval_set(folder)
    assert isinstance(found.config["process_results"], evalsets.FunctionRef) and not marker.exists()


@pytest.mark.parametrize(("text", "field", "words"), [
    (b"task: refunds\xff\n", "line 1", "not UTF-8"),
    (b"l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + b"".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n".encode() for i in range(1, 9)),
     "line 5", "more than 10000 values"),
    (b"a: " + b"[" * 3000 + b"]" * 3000 + b"\n", "line 1", "nested deeper than 64"),
    (b"# " + b"x" * (2 * 1024 * 1024) + b"\n", None, "larger than 1 MiB"),
    (b"max_gen_toks: .inf\n", "max_gen_toks", "finite number"),
])
def test_hostile_task_yaml_is_refused(tmp_path: Path, text: bytes, field, words: str) -> None:
    folder = write_set(tmp_path)
    (folder / "refunds.yaml").write_bytes(text)
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.file.endswith("refunds.yaml") and words in caught.value.message
    if field:
        assert caught.value.field == field


def test_a_byte_order_mark_is_accepted_in_yaml_and_data(tmp_path: Path) -> None:
    folder = write_set(tmp_path)
    for name in ("refunds.yaml", "data.jsonl"):
        (folder / name).write_bytes(b"\xef\xbb\xbf" + (folder / name).read_bytes())
    assert evalsets.validate_eval_set(folder).num_items == len(GOOD_ITEMS)


@pytest.mark.parametrize(("line", "words"), [
    (b'{"question": "q\xff", "answer": "a"}', "not UTF-8"),
    (b'{"question": "q", "answer": NaN}', "NaN is not a number JSON allows"),
    (b'{"question": "q", "answer": -Infinity}', "-Infinity is not a number JSON allows"),
    (b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b', "answer": "a"}', "nested too deep"),
])
def test_hostile_data_lines_name_the_file_and_line(tmp_path: Path, line: bytes, words: str) -> None:
    folder = write_set(tmp_path)
    (folder / "data.jsonl").write_bytes(json.dumps(GOOD_ITEMS[0]).encode() + b"\n" + line + b"\n")
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.file.endswith("data.jsonl") and caught.value.field == "line 2" and words in caught.value.message


# ---------------------------------------------------------------- data_files beside the YAML, from any working directory

LOADER = {"custom_dataset": evalsets.FunctionRef(evalsets.SET_DATA_LOADER)}


def write_yaml_set(root: Path, name: str = "refunds", extra: str = "") -> Path:
    """A set whose YAML is written as text (a `!function` tag cannot come from yaml.safe_dump)."""
    folder = write_set(root, name)
    (folder / f"{name}.yaml").write_text((folder / f"{name}.yaml").read_text() + extra)
    return folder


def test_the_product_s_data_loader_is_accepted_and_others_are_refused(tmp_path: Path) -> None:
    found = evalsets.validate_eval_set(write_yaml_set(tmp_path / "a", extra=f"custom_dataset: !function {evalsets.SET_DATA_LOADER}\n"))
    assert found.config["custom_dataset"] == evalsets.SET_DATA_LOADER
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(write_yaml_set(tmp_path / "b", extra="custom_dataset: !function helpers.load\n"))
    assert caught.value.field == "custom_dataset" and evalsets.SET_DATA_LOADER in caught.value.message


def test_set_data_reads_the_files_beside_the_yaml_whatever_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    folder = write_set(tmp_path / "sets")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    dataset = evalsets.set_data(config_source=str(folder / "refunds.yaml"), data_files={"test": "data.jsonl"}, version=1.0)
    assert [row["question"] for row in dataset["test"]] == [item["question"] for item in GOOD_ITEMS]


@pytest.mark.parametrize("relative", ["../other.jsonl", "/etc/passwd", "*.jsonl"])
def test_set_data_keeps_to_the_folder(tmp_path: Path, relative: str) -> None:
    folder = write_set(tmp_path / "sets")
    with pytest.raises(InputError):
        evalsets.set_data(config_source=str(folder / "refunds.yaml"), data_files={"test": relative})


def test_plain_lm_eval_loads_a_shipped_set_from_another_working_directory(tmp_path: Path, monkeypatch) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)
    manager = TaskManager(include_path=str(EVAL_SETS_DIR / "payment_reference"), include_defaults=False)
    task = manager.load("payment_reference")["tasks"]["payment_reference"]
    shipped = [item for _, item in evalsets.iter_jsonl(EVAL_SETS_DIR / "payment_reference" / "data.jsonl")]
    assert [dict(doc) for doc in task.eval_docs] == shipped


def test_materialize_drops_the_loader_for_the_absolute_path(tmp_path: Path) -> None:
    folder = write_yaml_set(tmp_path / "sets", extra=f"custom_dataset: !function {evalsets.SET_DATA_LOADER}\n")
    include = evalsets.materialize_task(evalsets.validate_eval_set(folder), tmp_path / "run")
    written = evalsets.load_task_config(include / "refunds.yaml")
    assert "custom_dataset" not in written
    assert written["dataset_kwargs"]["data_files"]["test"] == str((folder / "data.jsonl").resolve())


def test_every_shipped_set_names_the_loader_and_none_is_broken() -> None:
    shipped = evalsets.discover_eval_sets(EVAL_SETS_DIR)
    assert shipped.broken == {}
    assert all(s.config.get("custom_dataset") == evalsets.SET_DATA_LOADER for s in shipped)


# ---------------------------------------------------------------- chat template and system instruction (metadata)


def test_chat_options_live_in_metadata(tmp_path: Path) -> None:
    metadata = {"version": 1.0, "chat_template": True, "system_instruction": "You route tickets."}
    found = evalsets.validate_eval_set(write_set(tmp_path, config={"metadata": metadata}))
    assert (found.chat_template, found.system_instruction) == (True, "You route tickets.")
    assert found.lm_eval_options == (True, "You route tickets.")
    plain = evalsets.validate_eval_set(write_set(tmp_path / "plain"))
    assert plain.lm_eval_options == (False, None)


@pytest.mark.parametrize(("config", "field", "words"), [
    ({"metadata": {"chat_template": "yes"}}, "metadata.chat_template", "true or false"),
    ({"metadata": {"system_instruction": ""}}, "metadata.system_instruction", "non-empty string"),
    ({"metadata": ["chat"]}, "metadata", "a mapping"),
    ({**ROLLING_CONFIG, "metric_list": None, "generation_kwargs": None, "metadata": {"chat_template": True}},
     "metadata.chat_template", "does not apply"),
])
def test_bad_chat_options_are_refused_in_one_line(tmp_path: Path, config: dict, field: str, words: str) -> None:
    config = dict(config)
    folder = write_set(tmp_path, config=config)
    text = yaml.safe_load((folder / "refunds.yaml").read_text())
    (folder / "refunds.yaml").write_text(yaml.safe_dump({k: v for k, v in text.items() if v is not None}, sort_keys=False))
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.field == field and words in caught.value.message


def test_a_multiple_choice_set_may_use_the_chat_template(tmp_path: Path) -> None:
    found = evalsets.validate_eval_set(write_set(tmp_path, config={**MC_CONFIG, "metadata": {"chat_template": True}}, lines=MC_ITEMS))
    assert found.chat_template and found.output_type == "multiple_choice"


# ---------------------------------------------------------------- requests lm-eval sends (the scoring progress' total)


def test_requests_are_counted_per_item_and_choice(tmp_path: Path) -> None:
    assert evalsets.validate_eval_set(write_set(tmp_path / "g")).num_requests == len(GOOD_ITEMS)
    mc = evalsets.validate_eval_set(write_set(tmp_path / "mc", config=MC_CONFIG, lines=MC_ITEMS))
    assert mc.num_requests == 4 * 2
    per_item = [json.dumps({"question": "q", "options": ["a", "b", "c"][: i + 1], "label": 0}) for i in range(3)]
    mc_field = evalsets.validate_eval_set(write_set(tmp_path / "mcf", config={**MC_CONFIG, "doc_to_choice": "options"}, lines=per_item))
    assert mc_field.num_requests == 1 + 2 + 3
    mutual_info = {**MC_CONFIG, "metric_list": [{"metric": "acc_mutual_info"}]}
    mutual = evalsets.validate_eval_set(write_set(tmp_path / "mi", config=mutual_info, lines=MC_ITEMS))
    assert mutual.num_requests == 2 * 4 * 2
    rolling = {**ROLLING_CONFIG, "metric_list": [{"metric": "word_perplexity"}]}
    folder = write_set(tmp_path / "r", config=rolling)
    text = yaml.safe_load((folder / "refunds.yaml").read_text())
    text.pop("generation_kwargs")
    (folder / "refunds.yaml").write_text(yaml.safe_dump(text, sort_keys=False))
    assert evalsets.validate_eval_set(folder).num_requests is None


# ---------------------------------------------------------------- a broken set blocks only the runs that select it


def test_a_run_skips_a_broken_set_it_does_not_select_with_one_warning(tmp_path: Path, monkeypatch, capsys) -> None:

    write_set(tmp_path, "refunds")
    write_set(tmp_path, "warranty")
    write_set(tmp_path, "broken", lines=['{"question": "q", "answer": "a"}', "not json"])
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(tmp_path))
    assert [s.name for s in evalsets.select_eval_sets(None)] == ["refunds", "warranty"]
    assert [s.name for s in evalsets.select_eval_sets(["warranty"])] == ["warranty"]  # never reads the broken set: no warning
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("> eval set broken skipped: ") and "line 2: invalid JSON" in lines[0]


def test_a_run_of_named_sets_validates_only_those(tmp_path: Path, monkeypatch) -> None:
    write_set(tmp_path, "refunds")
    write_set(tmp_path, "hanging", config={"doc_to_text": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"})
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(tmp_path))
    validated: list[str] = []
    real = evalsets.validate_eval_set
    monkeypatch.setattr(evalsets, "validate_eval_set", lambda folder: validated.append(Path(folder).name) or real(folder))
    assert [s.name for s in evalsets.select_eval_sets(["refunds"])] == ["refunds"]
    with pytest.raises(InputError, match=r"unknown eval set\(s\) \['nope'\]; available: \['hanging', 'refunds'\]"):
        evalsets.select_eval_sets(["nope"])
    assert validated == ["refunds"]
    found = evalsets.discover_eval_sets(tmp_path)
    assert found.names == ["hanging", "refunds"] and [s.name for s in found] == ["refunds"]  # iterating validates every set
    assert "rendering one item took more than 2 s" in found.broken["hanging"].message


def test_a_run_that_selects_a_broken_set_fails_naming_it(tmp_path: Path, monkeypatch) -> None:

    write_set(tmp_path, "refunds")
    write_set(tmp_path, "broken", lines=["not json"])
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(tmp_path))
    with pytest.raises(InputError) as caught:
        evalsets.select_eval_sets(["refunds", "broken"])
    assert "broken" in caught.value.one_line() and "invalid JSON" in caught.value.message


def test_the_cli_exits_2_naming_a_selected_broken_set(tmp_path: Path, monkeypatch, capsys) -> None:

    write_set(tmp_path, "broken", lines=["not json"])
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(tmp_path))
    assert main(["--recipe", "w8a8", "--eval-sets", "broken", "--no-registry"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("quantize: error: ") and "broken/data.jsonl: line 1: invalid JSON" in line


# ---------------------------------------------------------------- parsed once


def counted_task_yaml_parses(monkeypatch, names: tuple[str, ...]) -> Counter:
    """Counts, from now on, the parses of the named sets' task YAMLs: by the product's YAML loader and by lm-eval's."""
    import lm_eval.tasks._factory as lm_factory
    import lm_eval.tasks._index as lm_index

    from pipelines.files import yamlio

    counts: Counter = Counter()

    def counting(real, who: str, path_at: int):
        def parse(*args, **kwargs):
            path = Path(str(args[path_at]))
            if path.suffix == ".yaml" and path.stem in names:
                counts[who] += 1
            return real(*args, **kwargs)

        return parse

    monkeypatch.setattr(yamlio, "load_yaml_text", counting(yamlio.load_yaml_text, "product", 1))
    for module in (lm_index, lm_factory):  # lm-eval 0.4.13: the task index, then the task itself
        monkeypatch.setattr(module, "load_yaml", counting(module.load_yaml, "lm-eval", 0))
    return counts


def test_a_gate_run_parses_each_task_yaml_once(stack, workspace, monkeypatch) -> None:
    from fakes import gate_settings, make_eval_set

    from pipelines.evaluation import evaluate
    from pipelines.runs import runner

    names = ("alpha", "beta", "gamma")
    for name in names:
        make_eval_set(workspace.root / "sets", name)
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(workspace.root / "sets"))
    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, prompts=evaluate.load_all_prompts))  # lm-eval builds the prompts, as in a real run
    counts = counted_task_yaml_parses(monkeypatch, names)
    settings = gate_settings(workspace).model_copy(update={"eval_sets": evalsets.select_eval_sets(None)})
    runner.run_gate(runner.GateJob(artifact_dir=workspace.artifact, baseline_dir=workspace.baseline, recipe_name="w8a8", settings=settings))
    # The product parses each YAML once (validation); lm-eval reads its copy twice (index, task) for the prompts of
    # all sets together, not once per set per set loaded. (Each lm-eval subprocess that scores reads it too.)
    assert counts == {"product": 3, "lm-eval": 6}


def test_a_job_discovers_the_eval_sets_once_for_all_its_candidates(tmp_path: Path, monkeypatch) -> None:
    from fakes import make_model

    from pipelines.jobs import job

    names = ("alpha", "beta")
    for name in names:  # 60 items: enough for the default policy's tolerance (fewer are refused at planning)
        write_set(tmp_path / "sets", name, lines=[GOOD_ITEMS[i % len(GOOD_ITEMS)] for i in range(60)])
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(tmp_path / "sets"))
    monkeypatch.setattr(job, "_model_layout", lambda model, field: None)  # no recipe is compiled here
    for model in ("m1", "m2", "m3"):
        make_model(tmp_path / model)
    path = tmp_path / "job.yaml"
    path.write_text("name: nightly\ncandidates:\n" + "".join(f"  - model: {m}\n    recipes: [w8a8]\n" for m in ("m1", "m2", "m3")))
    counts = counted_task_yaml_parses(monkeypatch, names)
    candidates = job.plan_candidates(job.load_job(path), path)
    assert len(candidates) == 3 and all(len(c.settings.eval_sets) == 2 for c in candidates)
    assert counts == {"product": 2}


# ---------------------------------------------------------------- templates under a time and an output budget

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BUDGETED_TEMPLATES = {
    "nested-range-loops": (NESTED_LOOPS, "rendering one item took more than 2 s"),
    "nested-loops-over-a-string": ("{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "took more than 2 s"),
    "exponential-macro": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% else %}x{% endif %}{% endmacro %}{{ f(60) }}", "more than"),
    "center-2e9": ("{{ question|center(2000000000) }}", "center: the argument 2000000000 is larger than 1000000"),
    "ljust-2e9": ("{{ question.ljust(2000000000) }}", "ljust: the argument 2000000000"),
    "percent-width": ("{{ '%2000000000s' % question }}", "a format width or precision of 2000000000"),
    "format-filter-width": ("{{ '%2000000000s'|format(question) }}", "a format width or precision of 2000000000"),
    "str-format-nested-width": ("{{ '{:{w}}'.format(question, w=2000000000) }}", "format: the argument 2000000000"),
    "join-of-copies": ("{{ (['x' * 10000] * 500)|join }}", "join would produce about 5001002 characters"),
    "replace-growth": ("{{ ('x' * 100000)|replace('x', 'x' * 1000) }}", "replace would produce about 100000000 characters"),
    "concat-doubling": ("{% set s = 'x' * 1000000 %}{% set s = s ~ s %}{{ s }}", "~ produced 2000000 characters"),
    "shared-sublists": ("{% set a = [1] * 100000 %}{% set b = [a,a,a,a,a,a,a,a,a,a] %}{% set c = [b,b,b,b,b,b,b,b,b,b] %}{{ c }}",
                        "a value would become more than 10000000 characters"),
    "tojson-indent": ("{{ range(1000)|list|tojson(indent=1000000) }}", "tojson: an indent of 1000000"),
    "lipsum": ("{{ lipsum(1000000) }}", "lipsum would produce about"),
    "output-stream": ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
                      "renders more than 1000000 characters"),
    "regex-backtracking": ("{{ ('a' * 5000 ~ '!')|regex_replace('(a|aa)+$', '') }}", "regex_replace took more than 2 s"),
}


@pytest.mark.parametrize(("template", "words"), BUDGETED_TEMPLATES.values(), ids=BUDGETED_TEMPLATES.keys())
def test_a_template_is_stopped_while_rendering_naming_set_field_and_item(tmp_path: Path, template: str, words: str) -> None:
    import resource
    import time

    folder = write_set(tmp_path, config={"doc_to_text": template})
    started = time.monotonic()
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert time.monotonic() - started < 15
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 1024 * 1024  # KiB: no gigabyte ever allocated
    error = caught.value
    assert error.file == "refunds/refunds.yaml" or error.file.endswith("refunds/refunds.yaml")
    assert error.field == "doc_to_text" and words in error.message
    assert "refunds/data.jsonl line 1" in error.message


def test_the_set_budget_spans_its_items() -> None:
    from pipelines.evaluation.templates import RenderBudget, TemplateBudgetError, compile_template

    budget = RenderBudget(seconds=0.3)
    with pytest.raises(TemplateBudgetError, match=r"the set's templates took more than 0.3 s \+ 1 ms a rendering \(0.3 s for 1\) to render in all"):
        budget.render(compile_template(NESTED_LOOPS), {})
    written = RenderBudget(chars=10, chars_per_render=0)
    assert written.render(compile_template("{{ question }}"), {"question": "abcdef"}) == "abcdef"
    with pytest.raises(TemplateBudgetError, match="render more than 10 characters in all"):
        written.render(compile_template("{{ question }}"), {"question": "abcdef"})


def test_ordinary_templates_render_as_lm_eval_renders_them() -> None:
    template = ("Q: {{ question|upper }} {% for c in choices %}{{ loop.index }}.{{ c }} {% endfor %}{{ '%5s'|format(question) }}"
                "{{ ','.join(choices) }} {{ choices|join('/') }} {{ question ~ '!' }} {{ {'a': 1} }} {{ 12345678|default(0) }}"
                "{{ question|regex_replace('o', '0') }}")
    rendered = evalsets.render_template(template, {"question": "foo", "choices": ["a", "b"]})
    assert rendered == "Q: FOO 1.a 2.b   fooa,b a/b foo! {'a': 1} 12345678f00"


# ---------------------------------------------------------------- data files read line by line, bounded


def test_a_data_file_is_refused_before_it_is_read_when_too_large(tmp_path: Path) -> None:
    from pipelines.files import jsonl

    huge = tmp_path / "data.jsonl"
    with huge.open("wb") as handle:
        handle.truncate(2 * 1024**3)  # 2 GiB with no newline, sparse: nothing is written
    with pytest.raises(InputError, match=r"2147483648 bytes: data files are limited to 67108864 bytes"):
        next(jsonl.iter_jsonl(huge))
    long_line = tmp_path / "long.jsonl"
    long_line.write_bytes(b'{"question": "q", "answer": "a"}\n' + b"x" * (3 * jsonl.MiB))
    with pytest.raises(InputError, match=r"line longer than 1048576 bytes") as caught:
        list(jsonl.iter_jsonl(long_line))
    assert caught.value.field == "line 2"
    exact = tmp_path / "exact.jsonl"
    exact.write_bytes(b'{"a": "' + b"x" * (jsonl.MiB - 10) + b'"}\n')  # a line of exactly the limit, newline included
    assert len(list(jsonl.iter_jsonl(exact))) == 1


def test_a_data_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    from pipelines.files import jsonl

    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        next(jsonl.iter_jsonl(fifo))
    with pytest.raises(InputError, match="not a regular file"):
        next(jsonl.iter_jsonl(tmp_path))
    with pytest.raises(InputError, match="data file not found"):
        next(jsonl.iter_jsonl(tmp_path / "missing.jsonl"))


def test_an_eval_set_with_a_2_gib_data_file_is_refused_naming_it(tmp_path: Path) -> None:
    folder = write_set(tmp_path)
    with (folder / "data.jsonl").open("wb") as handle:
        handle.truncate(2 * 1024**3)
    with pytest.raises(InputError) as caught:
        evalsets.validate_eval_set(folder)
    assert caught.value.file.endswith("refunds/data.jsonl") and "limited to 67108864 bytes" in caught.value.message
