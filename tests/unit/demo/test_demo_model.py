"""The committed demo model loads with transformers, has the shape vLLM's CPU kernels need, and still
scores on the shipped multiple-choice eval set."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipelines.demo.scoring import multiple_choice_accuracy  # noqa: E402
from pipelines.evaluation import evalsets  # noqa: E402
from pipelines.paths import DEMO_EVAL_SETS, DEMO_MODEL_DIR, EVAL_SETS_DIR  # noqa: E402


def demo_sets() -> list[evalsets.EvalSet]:
    return [s for s in evalsets.discover_eval_sets(EVAL_SETS_DIR) if s.name in DEMO_EVAL_SETS]

MAX_BYTES = 20 * 2**20


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def test_files_and_dimensions() -> None:
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert (config["hidden_size"], config["head_dim"], config["num_hidden_layers"]) == (256, 64, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["intermediate_size"] % 128 == 0 and config["vocab_size"] % 64 == 0
    assert config["tie_word_embeddings"] is False
    assert sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir() if p.is_file()) <= MAX_BYTES
    from safetensors import safe_open

    with safe_open(DEMO_MODEL_DIR / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}  # noqa: SIM118 (safe_open is no dict)
        assert "lm_head.weight" in weights.keys()  # noqa: SIM118


def test_tokenizer_adds_nothing_and_splits_answers_consistently(tokenizer) -> None:
    for found in demo_sets():
        config = evalsets.load_task_config(found.task_yaml)
        for number, item in list(evalsets.iter_jsonl(found.data))[:50]:
            prompt = evalsets.render_template(config["doc_to_text"], item)
            answers = config["doc_to_choice"] if isinstance(config.get("doc_to_choice"), list) else [item["answer"]]
            context = tokenizer(prompt).input_ids
            assert tokenizer.decode(context) == prompt
            for answer in answers:
                whole = tokenizer(f"{prompt} {answer}").input_ids
                assert whole[: len(context)] == context, (found.name, number, answer)
                assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in whole


@pytest.mark.slow
def test_scores_on_the_multiple_choice_set(model, tokenizer) -> None:
    (found,) = [s for s in demo_sets() if s.output_type == "multiple_choice"]
    config = evalsets.load_task_config(found.task_yaml)
    items = [item for _, item in evalsets.iter_jsonl(found.data)]
    prompts = [evalsets.render_template(config["doc_to_text"], item) for item in items]
    labels = [item[config["doc_to_target"]] for item in items]
    correct = multiple_choice_accuracy(model, tokenizer, prompts, [config["doc_to_choice"]] * len(items), labels)
    assert sum(correct) / len(correct) >= 0.95


def test_shipped_eval_data_is_what_the_training_script_generates_and_never_trained_on() -> None:
    from pipelines.demo import train, workload

    settings = train.TrainSettings()
    eval_prompts = set()
    for name in train.SHIPPED_TASKS:
        task = workload.TASKS[name]
        shipped = [item for _, item in evalsets.iter_jsonl(EVAL_SETS_DIR / name / "data.jsonl")]
        assert shipped == train.eval_items(task, train.EVAL_ITEMS, train.EVAL_SEED)
        assert train.task_yaml_text(task) == (EVAL_SETS_DIR / name / f"{name}.yaml").read_text()
        eval_prompts |= {train.prompt_of(task, item) for item in shipped}
    calibration = [item["text"] for _, item in evalsets.iter_jsonl(EVAL_SETS_DIR / "calibration" / "data.jsonl")]
    held_out = {workload.item_key(workload.TASKS[n], item) for n in train.SHIPPED_TASKS
                for item in train.eval_items(workload.TASKS[n], train.EVAL_ITEMS, train.EVAL_SEED)}
    stream = train.training_examples(dict(settings.task_weights), 2000, train.TRAIN_SEED, held_out)
    assert not {prompt for prompt, _ in stream} & eval_prompts
    assert not {text.split("\n")[0] for text in calibration} & {p.split("\n")[0] for p in eval_prompts}


def test_fake_quantization_grid() -> None:
    from pipelines.demo.fakequant import RtnScheme, quantize_dequantize

    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    errors = {}
    for scheme in (RtnScheme("c4", 4), RtnScheme("g4", 4, 128), RtnScheme("c8", 8)):
        restored = quantize_dequantize(weight, scheme.bits, scheme.group_size)
        errors[scheme.name] = float((restored - weight).pow(2).mean())
        if scheme.group_size is None:  # one scale per row: at most 2^bits levels in it
            assert max(len(row.unique()) for row in restored) <= 2**scheme.bits
    assert errors["c8"] < errors["g4"] <= errors["c4"]


def test_outlier_rescaling_keeps_the_function_and_moves_the_scales() -> None:
    from pipelines.demo.outliers import add_outlier_channels, column_scale_ratio

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
        ratio_before = column_scale_ratio(model)
        add_outlier_channels(model, 16.0)
        after = model(ids).logits
    assert torch.allclose(before, after, atol=1e-5)
    assert column_scale_ratio(model) == pytest.approx(16.0 * ratio_before, rel=1e-4)


def test_shipped_model_has_the_outlier_channels(model) -> None:
    from pipelines.demo.outliers import column_scale_ratio

    # The small columns sit in one group of 128: int4 group-128 keeps them, one scale per row does not.
    assert column_scale_ratio(model) > 8
