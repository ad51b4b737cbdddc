"""Reading lm-eval's output back: the set's score and each item's value, from files written as lm-eval 0.4.13 does.

The fabricated files follow lm-eval's code: results_<date_id>.json and samples_<task>_<date_id>.jsonl in a
folder per model (lm_eval/loggers/evaluation_tracker.py), one sample record per item and filter with
the metric values unsuffixed and the filter named in "filter" (lm_eval/evaluator.py), results keyed
"<metric>,<filter>" (lm_eval/evaluator_utils.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from fakes import TASK_CONFIG, write_eval_set

from pipelines.errors import EvalError
from pipelines.evaluation import evalsets
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import (
    LmEvalRun,
    load_all_prompts,
    load_prompts,
    materialize_tasks,
    read_lm_eval_run,
    read_set_score,
)
from pipelines.evaluation.metrics import make_spec
from pipelines.gate.pairing import pair_set

DATE_ID = "2026-12-01T01-57-25.202473"
GENERATIVE = {
    "output_type": "generate_until",
    "doc_to_text": "Reference {{reference}}\nCanonical:",
    "doc_to_target": "answer",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 24},
    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
}
TWO_FILTERS = [
    {"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]},
    {"name": "raw", "filter": [{"function": "take_first"}]},
]


def make_set(root: Path, name: str, items: list[dict], **config) -> EvalSet:
    """A validated set: the generative defaults above, `config` overriding them (None drops a key)."""
    merged = {key: value for key, value in {**TASK_CONFIG, "task": name, **GENERATIVE, **config}.items() if value is not None}
    return evalsets.validate_eval_set(write_eval_set(root, name, merged, items))


def doc_hash(doc: dict) -> str:
    """lm-eval's doc_hash (lm_eval/evaluator.py: hash_string of the doc dumped with indent=2)."""
    return hashlib.sha256(json.dumps(doc, indent=2, ensure_ascii=False).encode("utf-8")).hexdigest()


def sample(doc_id: int, doc: dict, values: dict, filter_name: str = "none") -> dict:
    """One record as EvaluationTracker.save_results_samples writes it."""
    target = str(doc.get("answer", ""))
    return {
        "doc_id": doc_id,
        "doc": doc,
        "target": target,
        "arguments": {"gen_args_0": {"arg_0": f"Reference {doc.get('reference')}\nCanonical:", "arg_1": {"until": ["\n"]}}},
        "resps": [[target]],
        "filtered_resps": [target],
        "filter": filter_name,
        "metrics": list(values),
        "doc_hash": doc_hash(doc),
        "prompt_hash": hashlib.sha256(b"prompt").hexdigest(),
        "target_hash": hashlib.sha256(target.encode()).hexdigest(),
        **values,
    }


def write_run(
    output_dir: Path, results: dict[str, dict], samples: dict[str, list[dict]], date_id: str = DATE_ID, model: str = "candidate",
) -> Path:
    """results_<date_id>.json and samples_<task>_<date_id>.jsonl under output_dir/<model>/, as lm-eval lays them out."""
    folder = output_dir / model
    folder.mkdir(parents=True, exist_ok=True)
    body = {
        "results": {
            task: {"name": task, "alias": task, "sample_len": len({r.get("doc_id") for r in samples.get(task, [])}), **metrics}
            for task, metrics in results.items()
        },
        "group_subtasks": {task: [] for task in results},
        "configs": {task: {"task": task} for task in results},
        "versions": dict.fromkeys(results, 1.0),
        "n-shot": dict.fromkeys(results, 0),
        "higher_is_better": {task: {key.split(",")[0]: True for key in metrics} for task, metrics in results.items()},
        "date": 1764554245.0,
        "lm_eval_version": "0.4.13",
    }
    (folder / f"results_{date_id}.json").write_text(json.dumps(body, indent=2))
    for task, records in samples.items():
        (folder / f"samples_{task}_{date_id}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def references(count: int, offset: int = 0) -> list[dict]:
    return [{"reference": f"{offset + i:016d}", "answer": f"ref-{offset + i}"} for i in range(count)]


def test_payment_and_payment_reference_each_read_their_own_samples(tmp_path: Path) -> None:
    payment = make_set(tmp_path / "sets", "payment", references(3))
    reference = make_set(tmp_path / "sets", "payment_reference", references(5, offset=100))
    write_run(
        tmp_path / "out",
        {"payment": {"exact_match,none": 1.0}, "payment_reference": {"exact_match,none": 0.4}},
        {
            "payment": [sample(i, doc, {"exact_match": 1.0}) for i, doc in enumerate(references(3))],
            "payment_reference": [sample(i, doc, {"exact_match": float(i < 2)}) for i, doc in enumerate(references(5, offset=100))],
        },
    )
    run = read_lm_eval_run(tmp_path / "out")
    first, second = read_set_score(payment, run, 1.0), read_set_score(reference, run, 1.0)
    assert (first.n, first.score, [item.value for item in first.items]) == (3, 1.0, [1.0, 1.0, 1.0])
    assert (second.n, second.score, [item.value for item in second.items]) == (5, 0.4, [1.0, 1.0, 0.0, 0.0, 0.0])
    assert [item.doc_hash for item in first.items] == [doc_hash(doc) for doc in references(3)]


def test_a_set_never_reads_a_longer_named_task_s_samples(tmp_path: Path) -> None:
    payment = make_set(tmp_path / "sets", "payment", references(3))
    write_run(
        tmp_path / "out",
        {"payment": {"exact_match,none": 1.0}},
        {"payment_reference": [sample(i, doc, {"exact_match": 0.0}) for i, doc in enumerate(references(3))]},
    )
    with pytest.raises(EvalError, match="no per-sample file for task payment") as caught:
        read_set_score(payment, read_lm_eval_run(tmp_path / "out"), 1.0)
    assert caught.value.file.endswith(f"samples_payment_{DATE_ID}.jsonl")


def test_a_two_filter_task_is_judged_on_its_first_filter(tmp_path: Path) -> None:
    docs = references(4)
    eval_set = make_set(tmp_path / "sets", "payment", docs, filter_list=TWO_FILTERS)
    strip = [sample(i, doc, {"exact_match": 1.0}, "strip") for i, doc in enumerate(docs)]
    raw = [sample(i, doc, {"exact_match": 0.0}, "raw") for i, doc in enumerate(docs)]
    write_run(tmp_path / "out", {"payment": {"exact_match,strip": 1.0, "exact_match,raw": 0.0}}, {"payment": raw + strip})
    score = read_set_score(eval_set, read_lm_eval_run(tmp_path / "out"), 1.0)
    assert (score.score, score.n) == (1.0, 4)
    assert [item.value for item in score.items] == [1.0] * 4


def test_a_missing_results_key_names_metric_and_filter(tmp_path: Path) -> None:
    eval_set = make_set(tmp_path / "sets", "payment", references(2), filter_list=TWO_FILTERS)
    write_run(tmp_path / "out", {"payment": {"exact_match,raw": 0.0}}, {"payment": []})
    with pytest.raises(EvalError, match="no 'exact_match,strip' for task payment"):
        read_set_score(eval_set, read_lm_eval_run(tmp_path / "out"), 1.0)


def test_a_rolling_set_keeps_each_item_s_loglikelihood_and_count(tmp_path: Path) -> None:
    docs = [{"text": "hello world foo"}, {"text": "bar baz"}]
    eval_set = make_set(
        tmp_path / "sets", "notes", docs, output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
        metric_list=[{"metric": "word_perplexity"}], generation_kwargs=None,
    )
    records = [
        sample(0, docs[0], {"word_perplexity": [-0.058, 3], "byte_perplexity": [-0.058, 15], "bits_per_byte": [-0.058, 15]}),
        sample(1, docs[1], {"word_perplexity": [-0.676, 2], "byte_perplexity": [-0.676, 7], "bits_per_byte": [-0.676, 7]}),
    ]
    write_run(tmp_path / "out", {"notes": {"word_perplexity,none": 1.158, "bits_per_byte,none": 0.048}}, {"notes": records})
    score = read_set_score(eval_set, read_lm_eval_run(tmp_path / "out"), 1.0)
    assert score.metric == make_spec("word_perplexity", "weighted_perplexity", False)
    assert (score.score, [item.value for item in score.items]) == (1.158, [[-0.058, 3], [-0.676, 2]])


def test_corpus_items_keep_lm_eval_s_gold_prediction_pairs(tmp_path: Path) -> None:
    docs = [{"reference": str(i), "label": i % 2} for i in range(4)]
    eval_set = make_set(
        tmp_path / "sets", "fraud", docs, output_type="multiple_choice", doc_to_choice=["no", "yes"], doc_to_target="label",
        metric_list=[{"metric": "f1"}, {"metric": "acc"}], generation_kwargs=None,
    )
    records = [sample(i, doc, {"f1": [doc["label"], 1], "acc": float(doc["label"] == 1)}) for i, doc in enumerate(docs)]
    write_run(tmp_path / "out", {"fraud": {"f1,none": 0.667, "acc,none": 0.5}}, {"fraud": records})
    score = read_set_score(eval_set, read_lm_eval_run(tmp_path / "out"), 1.0)
    assert score.metric.kind == "corpus" and score.score == 0.667
    assert [item.value for item in score.items] == [[0, 1], [1, 1], [0, 1], [1, 1]]


def test_a_nan_loglikelihood_makes_a_multiple_choice_item_non_finite(tmp_path: Path) -> None:
    # lm-eval takes the argmax of the choices' loglikelihoods: a NaN one still yields acc 0 or 1. The logged responses
    # ("nan", "-inf" as text) make the item NaN, for the gate to reject; a generated answer reading "nan" stays text.
    docs = [{"reference": str(i), "label": i % 2} for i in range(3)]
    eval_set = make_set(
        tmp_path / "sets", "fraud", docs, output_type="multiple_choice", doc_to_choice=["no", "yes"], doc_to_target="label",
        metric_list=[{"metric": "acc"}], generation_kwargs=None,
    )
    logged = [[["-1.5", "True"], ["-3.0", "False"]], [["nan", "False"], ["nan", "False"]], [["-2.0", "False"], ["-inf", "False"]]]
    records = [sample(i, doc, {"acc": 1.0}) | {"filtered_resps": logged[i]} for i, doc in enumerate(docs)]
    write_run(tmp_path / "out", {"fraud": {"acc,none": 1.0}}, {"fraud": records})
    values = [item.value for item in read_set_score(eval_set, read_lm_eval_run(tmp_path / "out"), 1.0).items]
    assert values[0] == 1.0 and all(value != value for value in values[1:])
    generated = make_set(tmp_path / "sets", "payment", references(2))
    answers = [sample(i, doc, {"exact_match": 0.0}) | {"filtered_resps": ["nan"]} for i, doc in enumerate(references(2))]
    write_run(tmp_path / "gen", {"payment": {"exact_match,none": 0.0}}, {"payment": answers})
    assert [item.value for item in read_set_score(generated, read_lm_eval_run(tmp_path / "gen"), 1.0).items] == [0.0, 0.0]


def test_the_newest_run_and_its_own_samples_are_read(tmp_path: Path) -> None:
    eval_set = make_set(tmp_path / "sets", "payment", references(2))
    old = "2026-12-01T01-57-25"  # lm-eval's isoformat() drops the fraction when it is zero
    write_run(tmp_path / "out", {"payment": {"exact_match,none": 0.0}}, {"payment": [sample(0, references(1)[0], {"exact_match": 0.0})]}, old)
    newest = "2026-12-01T09-00-00.000001"
    records = [sample(i, doc, {"exact_match": 1.0}) for i, doc in enumerate(references(2))]
    write_run(tmp_path / "out", {"payment": {"exact_match,none": 1.0}}, {"payment": records}, newest)
    (tmp_path / "out" / "candidate" / "results_notes.json").write_text("{}")  # not lm-eval's name: ignored
    run = read_lm_eval_run(tmp_path / "out")
    assert run == LmEvalRun(results=run.results, folder=tmp_path / "out" / "candidate", date_id=newest)
    assert read_set_score(eval_set, run, 1.0).n == 2


def test_no_results_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(EvalError, match="no results file"):
        read_lm_eval_run(tmp_path / "out", tmp_path / "lm_eval.log")


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ({"exact_match": 1.0, "filter": "none", "doc_hash": "h"}, "doc_id: Input should be a valid integer"),
        ({"doc_id": 0, "doc_hash": "h", "filter": "none"}, "no value of 'exact_match'"),
        ({"doc_id": 0, "doc_hash": "h", "filter": "none", "exact_match": "[0.1 0.9]"}, "got '[0.1 0.9]'"),
    ],
)
def test_an_unreadable_sample_record_names_the_file_and_line(tmp_path: Path, record: dict, words: str) -> None:
    eval_set = make_set(tmp_path / "sets", "payment", references(2))
    good = sample(0, references(1)[0], {"exact_match": 1.0})
    write_run(tmp_path / "out", {"payment": {"exact_match,none": 1.0}}, {"payment": [good, record]})
    with pytest.raises(EvalError) as caught:
        read_set_score(eval_set, read_lm_eval_run(tmp_path / "out"), 1.0)
    assert caught.value.field == "line 2" and words in caught.value.message


def test_identical_docs_pair_by_position(tmp_path: Path) -> None:
    docs = references(3)
    docs.append(dict(docs[1]))  # two identical JSONL lines: the same doc_hash
    eval_set = make_set(tmp_path / "sets", "payment", docs)
    runs = {}
    for model, values in (("baseline", [1.0, 1.0, 0.0, 0.0]), ("candidate", [1.0, 0.0, 0.0, 1.0])):
        records = [sample(i, doc, {"exact_match": value}) for i, (doc, value) in enumerate(zip(docs, values, strict=True))]
        write_run(tmp_path / model, {"payment": {"exact_match,none": sum(values) / 4}}, {"payment": records}, model=model)
        runs[model] = read_set_score(eval_set, read_lm_eval_run(tmp_path / model), 1.0)
    comparison = pair_set(eval_set, runs["baseline"], runs["candidate"], {}, None)
    assert doc_hash(docs[1]) == doc_hash(docs[3])
    assert [item.item_id for item in comparison.items] == [f"{i}:{doc_hash(doc)}" for i, doc in enumerate(docs)]
    assert [(item.baseline, item.candidate) for item in comparison.items] == [(1.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.0, 1.0)]


def test_a_rolling_set_s_prompt_is_the_text_it_scores(tmp_path: Path) -> None:
    docs = [{"text": f"note {i}: refund approved"} for i in range(3)]
    eval_set = make_set(
        tmp_path / "sets", "notes", docs, output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
        metric_list=None, generation_kwargs=None,
    )
    prompts = load_prompts(eval_set, materialize_tasks([eval_set], tmp_path / "tasks"))
    assert [(p.doc_id, p.text) for p in prompts] == [(i, doc["text"]) for i, doc in enumerate(docs)]


# ---------------------------------------------------------------- chat template, system instruction, lm-eval runs

from pipelines.evaluation import evaluate  # noqa: E402
from pipelines.paths import DEMO_MODEL_DIR  # noqa: E402
from pipelines.serve.serving import RunningServer  # noqa: E402

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(folder: Path) -> Path:
    """The demo model's tokenizer with a chat template added."""
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((DEMO_MODEL_DIR / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def a_server() -> RunningServer:
    return RunningServer.model_construct(
        model_dir=Path("m"), served_name="baseline", port=8000, log_path=Path("log"), process=None, startup_s=0.0, request_timeout_s=60.0,
    )


def test_a_plain_run_sends_text_and_a_chat_run_tokens_with_the_template(tmp_path: Path) -> None:
    plain = evaluate.lm_eval_command(a_server(), tmp_path, ["t"], tmp_path, tmp_path)
    assert "tokenized_requests=False" in plain[plain.index("--model_args") + 1]
    assert "--apply_chat_template" not in plain and "--system_instruction" not in plain
    chat = evaluate.lm_eval_command(a_server(), tmp_path, ["t"], tmp_path, tmp_path, chat_template=True, system_instruction="Be brief.")
    assert "tokenized_requests=True" in chat[chat.index("--model_args") + 1]
    assert "--apply_chat_template" in chat and chat[chat.index("--system_instruction") + 1] == "Be brief."


def test_sets_are_scored_in_one_lm_eval_run_per_chat_option(tmp_path: Path) -> None:
    docs = [{"reference": "1", "answer": "1"}]
    plain_a = make_set(tmp_path / "sets", "a", docs)
    chat_b = make_set(tmp_path / "sets", "b", docs, metadata={"chat_template": True})
    plain_c = make_set(tmp_path / "sets", "c", docs)
    system_d = make_set(tmp_path / "sets", "d", docs, metadata={"chat_template": True, "system_instruction": "Be brief."})
    groups = evaluate.lm_eval_groups([plain_a, chat_b, plain_c, system_d])
    assert [(name, [s.name for s in members]) for name, members in groups] == [
        ("lm_eval", ["a", "c"]), ("lm_eval-chat", ["b"]), ("lm_eval-chat-system", ["d"]),
    ]


def test_score_eval_sets_starts_each_run_with_its_options(tmp_path: Path, monkeypatch) -> None:
    docs = [{"reference": "1", "answer": "1"}]
    plain = make_set(tmp_path / "sets", "plain", docs)
    chat = make_set(tmp_path / "sets", "chatty", docs, metadata={"chat_template": True})
    commands = []

    def fake_run(command, server, log_path, bar=None, deadline=None):
        commands.append(command)
        task = command[command.index("--tasks") + 1]
        output = Path(command[command.index("--output_path") + 1])
        write_run(output, {task: {"exact_match,none": 1.0}}, {task: [sample(0, docs[0], {"exact_match": 1.0})]})

    monkeypatch.setattr(evaluate, "_run_watching_server", fake_run)
    scores = evaluate.score_eval_sets(a_server(), tmp_path, [chat, plain], tmp_path / "tasks", tmp_path / "work")
    assert list(scores) == ["chatty", "plain"] and all(score.n == 1 for score in scores.values())
    assert [("--apply_chat_template" in c, c[c.index("--tasks") + 1]) for c in commands] == [(True, "chatty"), (False, "plain")]


def test_the_request_count_is_read_from_lm_eval_s_progress_bars() -> None:
    counter = evaluate.RequestCounter()
    assert counter.feed("INFO building\n\rRequesting API:   0%|          | 0/10 [00:00<?, ?it/s]") == 0
    assert counter.feed("\rRequesting API:  50%|█████     | 5/10 [00:01<00:01,  5it/s]\r") == 5
    assert counter.feed("Requesting API: 100%|██████████| 10/10 [00:02<00:00,  5it/s]\n") == 10
    # the generation batch: a new bar
    assert counter.feed("\rRequesting API:   0%|          | 0/4 [00:00<?, ?it/s]\rRequesting API:  75%|███▌| 3/4 [00:01<00:00, 3it/s]\r") == 13
    assert counter.feed("\rRequesting API: 100%|██████████| 4/4 [00:01<00:00, 3it/s]\n") == 14
    assert counter.feed("INFO done\n") == 14


def test_a_chat_set_s_prompts_are_what_lm_eval_sends(tmp_path: Path) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    docs = [{"reference": f"{i}234", "answer": f"{i}-234"} for i in range(3)]
    eval_set = make_set(tmp_path / "sets", "chatty", docs, description="Rewrite references.",
                        metadata={"chat_template": True, "system_instruction": "You are terse."})
    include = materialize_tasks([eval_set], tmp_path / "tasks")
    tokenizer = chat_tokenizer(tmp_path / "tokenizer")
    prompts = load_prompts(eval_set, include, tokenizer)
    # lm-eval's own request building, as `lm_eval run --apply_chat_template --system_instruction ...` does it
    task = TaskManager(include_path=str(include), include_defaults=False).load("chatty")["tasks"]["chatty"]
    lm = LocalCompletionsAPI(base_url="http://127.0.0.1:1/v1/completions", tokenizer=str(tokenizer), tokenizer_backend="huggingface",
                             tokenized_requests=True)
    task.build_all_requests(system_instruction="You are terse.", apply_chat_template=True, fewshot_as_multiturn=True,
                            chat_template=lm.apply_chat_template)
    assert [p.text for p in prompts] == [instance.args[0] for instance in task.instances]
    assert prompts[0].text == (
        "<s><|im_start|>system\nYou are terse.\n\nRewrite references.<|im_end|>\n"
        "<|im_start|>user\nReference 0234\nCanonical:<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_chat_set_without_a_tokenizer_falls_back_to_the_raw_prompt_with_a_warning(tmp_path: Path, capsys) -> None:
    docs = [{"reference": "1", "answer": "1"}]
    eval_set = make_set(tmp_path / "sets", "chatty", docs, metadata={"chat_template": True})
    prompts = load_prompts(eval_set, materialize_tasks([eval_set], tmp_path / "tasks"))
    assert prompts[0].text == "Reference 1\nCanonical:"
    assert "KL is measured on the raw prompt" in capsys.readouterr().err


def test_a_plain_set_s_prompt_is_its_doc_to_text(tmp_path: Path) -> None:
    docs = [{"reference": "77", "answer": "7-7"}]
    eval_set = make_set(tmp_path / "sets", "plain", docs)
    prompts = load_prompts(eval_set, materialize_tasks([eval_set], tmp_path / "tasks"), tmp_path / "unused")
    assert [p.text for p in prompts] == ["Reference 77\nCanonical:"]


def test_the_prompts_of_several_sets_are_loaded_together_as_each_alone(tmp_path: Path) -> None:
    plain = make_set(tmp_path / "sets", "plain", [{"reference": "77", "answer": "7-7"}])
    notes = make_set(
        tmp_path / "sets", "notes", [{"text": "note 1"}, {"text": "note 2"}], output_type="loglikelihood_rolling", doc_to_text="",
        doc_to_target="{{text}}", metric_list=None, generation_kwargs=None,
    )
    include = materialize_tasks([plain, notes], tmp_path / "tasks")
    together = load_all_prompts([plain, notes], include)
    assert list(together) == ["plain", "notes"]
    assert together == {s.name: load_prompts(s, include) for s in (plain, notes)}
    assert [p.text for p in together["notes"]] == ["note 1", "note 2"] and load_all_prompts([], include) == {}


def test_a_chat_set_for_a_model_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    from pipelines.errors import InputError

    docs = [{"reference": "1", "answer": "1"}]
    eval_set = make_set(tmp_path / "sets", "chatty", docs, metadata={"chat_template": True})
    with pytest.raises(InputError) as caught:
        load_prompts(eval_set, materialize_tasks([eval_set], tmp_path / "tasks"), DEMO_MODEL_DIR)
    assert caught.value.field == "chat_template" and "chatty" in caught.value.message


def test_lm_eval_s_nan_and_infinity_literals_reach_the_gate_as_a_rejection_naming_the_items(tmp_path: Path) -> None:
    # lm-eval 0.4.13 writes the per-sample file with json.dumps: a model's NaN score is the bare literal NaN, a -inf
    # loglikelihood -Infinity. The reader takes them there (only there) and the gate rejects the candidate naming the
    # items, instead of a tooling error (exit 2).
    from pipelines.gate.policy import DEFAULT_POLICY, load_policy
    from pipelines.gate.verdict import decide

    docs = references(120)
    eval_set = make_set(tmp_path / "sets", "payment", docs)
    baseline = [sample(i, doc, {"exact_match": 1.0}) for i, doc in enumerate(docs)]
    candidate = [sample(i, doc, {"exact_match": float("nan") if i in (4, 9) else 1.0}) for i, doc in enumerate(docs)]
    write_run(tmp_path / "base", {"payment": {"exact_match,none": 1.0}}, {"payment": baseline})
    folder = write_run(tmp_path / "cand", {"payment": {"exact_match,none": float("nan")}}, {"payment": candidate})
    assert b"NaN" in (folder / f"samples_payment_{DATE_ID}.jsonl").read_bytes()
    base_score = read_set_score(eval_set, read_lm_eval_run(tmp_path / "base"), 1.0)
    cand_score = read_set_score(eval_set, read_lm_eval_run(tmp_path / "cand"), 1.0)
    assert [i for i, item in enumerate(cand_score.items) if item.value != item.value] == [4, 9]
    verdict = decide([pair_set(eval_set, base_score, cand_score, {}, None)], load_policy(DEFAULT_POLICY), "w8a8").sets[0]
    assert not verdict.passed
    assert "exact_match is not finite (NaN or infinite) on 2 of 120 items: 4:" in verdict.reasons[0]
    assert ", 9:" in verdict.reasons[0]


def test_a_negative_infinity_loglikelihood_is_read_from_a_rolling_set(tmp_path: Path) -> None:
    docs = [{"text": "hello world foo"}, {"text": "bar baz"}]
    eval_set = make_set(
        tmp_path / "sets", "notes", docs, output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
        metric_list=[{"metric": "word_perplexity"}], generation_kwargs=None,
    )
    records = [sample(0, docs[0], {"word_perplexity": [float("-inf"), 3]}), sample(1, docs[1], {"word_perplexity": [-0.676, 2]})]
    write_run(tmp_path / "out", {"notes": {"word_perplexity,none": float("inf")}}, {"notes": records})
    score = read_set_score(eval_set, read_lm_eval_run(tmp_path / "out"), 1.0)
    assert score.items[0].value == [float("-inf"), 3]
