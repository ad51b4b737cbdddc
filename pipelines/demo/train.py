"""Train the demo model from scratch and write models/demo-llama/ and the data of eval_sets/.

    python -m pipelines.demo.train      # 800 steps on 1 thread: ~10 min on an idle core, 15-35 on a busy one

Fixed seeds throughout: the eval items, the training stream and the calibration lines come from three
different seeds, and the training stream skips any item whose key is in an eval set or the calibration
set (asserted again at the end). After training, `outliers.add_outlier_channels` rescales the weights
without changing the function, so that per-channel int4 fails as it does on large LLMs (the trained
model alone survives even int3). Scores are measured through transformers; the fake-quant table in
TRAINING.md shows what each round-to-nearest scheme costs, which is what the demo's negative control
relies on.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from pipelines.demo import workload
from pipelines.demo.fakequant import SCHEMES, fake_quantized
from pipelines.demo.outliers import CHANNELS, FACTOR, add_outlier_channels, column_scale_ratio
from pipelines.demo.scoring import exact_match, multiple_choice_accuracy
from pipelines.demo.tokenizer import train_tokenizer
from pipelines.evaluation.evalsets import render_template
from pipelines.files.atomic import atomic_dir, write_text_atomic
from pipelines.paths import DEMO_EVAL_SETS, DEMO_MODEL_DIR, EVAL_SETS_DIR

EVAL_SEED, TRAIN_SEED, CALIBRATION_SEED, TORCH_SEED = 2002, 1001, 3003, 0
EVAL_ITEMS = 250
CALIBRATION_LINES = 512
VOCAB_SIZE = 1024
SHIPPED_TASKS = DEMO_EVAL_SETS
# The `datasets` JSON loader reads ISO dates as timestamps ("2020-09-24" -> "2020-09-24 00:00:00"):
# such targets are taken back as text.
TARGET_TEMPLATES = {"date_normalisation": "{{ (answer | string)[:10] }}"}


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 800
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    task_weights: tuple[tuple[str, float], ...] = (
        ("ticket_routing", 0.15),
        ("payment_reference", 0.25),
        ("date_normalisation", 0.6),
    )


def model_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,  # type: ignore[call-arg]  # transformers 5 folds it into rope_parameters
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )


# ---------------------------------------------------------------- data


def eval_items(task: workload.Task, count: int, seed: int) -> list[dict]:
    """`count` items with distinct keys, drawn from `seed`."""
    rng = random.Random(f"{seed}:{task.name}")
    items: dict[tuple, dict] = {}
    while len(items) < count:
        item = task.make_item(rng)
        items.setdefault(workload.item_key(task, item), item)
    return [{"id": f"{task.name}-{i:04d}", **item} for i, item in enumerate(items.values())]


def prompt_of(task: workload.Task, item: dict) -> str:
    return render_template(task.prompt, item)


def training_examples(
    weights: dict[str, float], count: int, seed: int, held_out: set[tuple]
) -> list[tuple[str, str]]:
    """(prompt, answer) pairs; items whose key is held out (eval or calibration) are redrawn."""
    rng = random.Random(seed)
    names = list(weights)
    examples: list[tuple[str, str]] = []
    while len(examples) < count:
        task = workload.TASKS[rng.choices(names, weights=[weights[n] for n in names])[0]]
        item = task.make_item(rng)
        if workload.item_key(task, item) in held_out:
            continue
        examples.append((prompt_of(task, item), item["answer"]))
    return examples


def calibration_items(tasks: list[workload.Task], count: int, seed: int, held_out: set[tuple]) -> list[tuple]:
    """(task, item) pairs for the calibration set: prompts of every task, none in an eval set."""
    rng = random.Random(seed)
    chosen: dict[tuple, tuple] = {}
    while len(chosen) < count:
        task = tasks[len(chosen) % len(tasks)]
        item = task.make_item(rng)
        key = workload.item_key(task, item)
        if key not in held_out:
            chosen.setdefault(key, (task, item))
    return list(chosen.items())


# ---------------------------------------------------------------- training


def encode(tokenizer: PreTrainedTokenizerBase, examples: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Token ids of prompt + " " + answer + newline + EOS, with the prompt's length (no loss there)."""
    prompts = tokenizer([p for p, _ in examples], add_special_tokens=False).input_ids
    wholes = tokenizer([f"{p} {a}\n" for p, a in examples], add_special_tokens=False).input_ids
    encoded = []
    for context, whole in zip(prompts, wholes, strict=True):
        assert whole[: len(context)] == context, "prompt and prompt+answer tokenize inconsistently"
        encoded.append(([*whole, tokenizer.eos_token_id], len(context)))
    return encoded


def _batch(rows: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (tokens, context_len) in enumerate(rows):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, context_len : len(tokens)] = torch.tensor(tokens[context_len:])
        mask[row, : len(tokens)] = 1
    return ids, labels, mask


def _learning_rate(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.learning_rate * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model: LlamaForCausalLM,
    encoded: list[tuple[list[int], int]],
    pad_id: int,
    settings: TrainSettings,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.98), weight_decay=settings.weight_decay
    )
    model.train()
    started = time.time()
    for step in range(settings.steps):
        rows = encoded[step * settings.batch_size : (step + 1) * settings.batch_size]
        ids, labels, mask = _batch(rows, pad_id)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, settings)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == settings.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.time() - started:6.0f} s", file=sys.stderr, flush=True)
        if on_progress is not None:
            on_progress(step)
    model.eval()


# ---------------------------------------------------------------- scoring


def score(model, tokenizer, task: workload.Task, items: list[dict]) -> float:
    prompts = [prompt_of(task, item) for item in items]
    if task.output_type == "multiple_choice":
        correct = multiple_choice_accuracy(
            model, tokenizer, prompts, [list(task.choices)] * len(items), [item["label"] for item in items]
        )
    else:
        correct = exact_match(model, tokenizer, prompts, [item["answer"] for item in items], task.max_gen_toks)
    return 100.0 * sum(correct) / len(correct)


def score_all(model, tokenizer, eval_data: dict[str, list[dict]]) -> dict[str, float]:
    return {name: score(model, tokenizer, workload.TASKS[name], items) for name, items in eval_data.items()}


def quantization_table(model, tokenizer, eval_data: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Scores per scheme; "bf16" is the model as shipped."""
    table = {"bf16": score_all(model, tokenizer, eval_data)}
    for scheme in SCHEMES:
        table[scheme.name] = score_all(fake_quantized(model, scheme), tokenizer, eval_data)
        print(f"{scheme.name}: {table[scheme.name]}", file=sys.stderr, flush=True)
    return table


# ---------------------------------------------------------------- outputs


def task_yaml(task: workload.Task) -> dict:
    config: dict = {
        "task": task.name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": "data.jsonl"}},
        "test_split": "test",
        "output_type": task.output_type,
        "doc_to_text": task.prompt,
    }
    if task.output_type == "multiple_choice":
        config |= {
            "doc_to_choice": list(task.choices),
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        }
    else:
        config |= {
            "doc_to_target": TARGET_TEMPLATES.get(task.name, "answer"),
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": task.max_gen_toks, "do_sample": False, "temperature": 0.0},
            "filter_list": [
                {"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}
            ],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        }
    config["metadata"] = {"version": 1.0, "about": task.description}
    return config


class _YamlDumper(yaml.SafeDumper):
    """Strings with a newline or a Jinja expression in double quotes ("Ticket: {{ticket}}\\nDepartment:")."""


_YamlDumper.add_representer(
    str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style='"' if "\n" in text or "{{" in text else None)
)


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


_TARGET_NOTE = (
    "# The `datasets` JSON loader reads ISO dates as timestamps (\"2020-09-24\" -> \"2020-09-24 00:00:00\"):\n"
    "# take the date part back as text.\n"
)


def task_yaml_text(task: workload.Task) -> str:
    body = yaml.dump(task_yaml(task), Dumper=_YamlDumper, sort_keys=False, width=1000)
    if task.name in TARGET_TEMPLATES:
        body = body.replace("doc_to_target:", _TARGET_NOTE + "doc_to_target:", 1)
    body = body.replace(
        "test_split:",
        "# data_files relative to this folder wherever lm-eval runs (lm-eval 0.4.13 reads them from the working directory)\n"
        "custom_dataset: !function pipelines.evaluation.evalsets.set_data\ntest_split:",
        1,
    )
    return f"# Generated by python -m pipelines.demo.train\n{body}"


def write_eval_sets(root: Path, eval_data: dict[str, list[dict]], calibration: list[str]) -> None:
    for name, items in eval_data.items():
        with atomic_dir(root / name) as folder:
            (folder / "data.jsonl").write_text(_jsonl(items))
            (folder / f"{name}.yaml").write_text(task_yaml_text(workload.TASKS[name]))
    with atomic_dir(root / "calibration") as folder:
        (folder / "data.jsonl").write_text(_jsonl([{"text": text} for text in calibration]))
        (folder / "set.yaml").write_text(
            "# Calibration data: no task YAML, one {\"text\": ...} per line. Generated by python -m pipelines.demo.train\n"
            "kind: calibration\n"
            "description: Customer-service prompts of every demo task, none of them in an eval set.\n"
        )


def _model_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def training_report(
    model: LlamaForCausalLM,
    seconds: float,
    settings: TrainSettings,
    table: dict[str, dict[str, float]],
    size: int,
    as_trained: dict[str, float],
    outlier_factor: float,
) -> str:
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    names = list(table["bf16"])
    lines = [
        "# demo-llama: how it was made",
        "",
        "Generated by `python -m pipelines.demo.train` (do not edit by hand).",
        "",
        "A LlamaForCausalLM trained from scratch on the synthetic customer-service workload of",
        "`pipelines/demo/workload.py`. Seeds: eval items "
        f"{EVAL_SEED}, training stream {TRAIN_SEED}, calibration {CALIBRATION_SEED}, torch {TORCH_SEED}.",
        "",
        "| what | value |",
        "| --- | --- |",
        f"| layers / hidden / intermediate | {config.num_hidden_layers} / {config.hidden_size} / {config.intermediate_size} |",
        f"| attention heads / KV heads / head_dim | {config.num_attention_heads} / {config.num_key_value_heads} / {config.head_dim} |",
        f"| vocabulary (byte-level BPE) | {config.vocab_size} |",
        f"| parameters | {params:,} |",
        f"| files on disk (bf16 safetensors + tokenizer + config) | {size / 2**20:.1f} MiB |",
        f"| training | {settings.steps} steps x {settings.batch_size} examples, AdamW lr {settings.learning_rate}, "
        f"task mix {dict(settings.task_weights)} |",
        f"| training time | {seconds:.0f} s on {torch.get_num_threads()} CPU threads |",
        f"| outlier channels | input channels {CHANNELS.start}-{CHANNELS.stop - 1} of q/k/v/gate/up, x{outlier_factor:g} in the "
        f"RMSNorm gain and /{outlier_factor:g} in the weights (max-weight ratio of the other columns to these: "
        f"{column_scale_ratio(model):.1f}) |",
        "",
        "The rescaling (`pipelines/demo/outliers.py`) leaves the function unchanged; it gives the weights the",
        "structure of a large LLM's, where per-output-channel int4 rounds the small columns away and",
        "group-128 scales keep them. 16-bit scores as trained, before it: "
        + ", ".join(f"{name} {score:.1f}" for name, score in as_trained.items())
        + ".",
        "",
        f"## Scores through transformers ({EVAL_ITEMS} items per set), and round-to-nearest fake quantization",
        "",
        "Decoder-layer Linear weights quantize-dequantized (symmetric RTN, as compressed-tensors computes it);",
        "embeddings and lm_head untouched. Points lost against bf16 in parentheses.",
        "",
        "| scheme | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for scheme, scores in table.items():
        cells = [
            f"{scores[n]:.1f}" if scheme == "bf16" else f"{scores[n]:.1f} ({scores[n] - table['bf16'][n]:+.1f})"
            for n in names
        ]
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def save_model(model: LlamaForCausalLM, tokenizer, folder: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)  # type: ignore[arg-type]  # transformers' typed `to` wrapper
    model.float()
    tokenizer.save_pretrained(folder)


# ---------------------------------------------------------------- main


def _progress_scorer(model, tokenizer, eval_data: dict[str, list[dict]], every: int) -> Callable[[int], None] | None:
    """Scores 64 items per set every `every` steps, to watch a run learn (costs time; off by default)."""
    if not every:
        return None

    def report(step: int) -> None:
        if step % every == every - 1:
            model.eval()
            scores = score_all(model, tokenizer, {name: items[:64] for name, items in eval_data.items()})
            model.train()
            print(f"step {step + 1}: {scores}", file=sys.stderr, flush=True)

    return report


def build(
    settings: TrainSettings,
    tasks: tuple[str, ...],
    model_dir: Path,
    eval_root: Path | None,
    eval_every: int = 0,
    outlier_factor: float = FACTOR,
) -> dict:
    torch.manual_seed(TORCH_SEED)
    eval_data = {name: eval_items(workload.TASKS[name], EVAL_ITEMS, EVAL_SEED) for name in tasks}
    eval_keys = {workload.item_key(workload.TASKS[n], item) for n, items in eval_data.items() for item in items}
    calibration = calibration_items([workload.TASKS[n] for n in tasks], CALIBRATION_LINES, CALIBRATION_SEED, eval_keys)
    held_out = eval_keys | {key for key, _ in calibration}
    weights = {name: weight for name, weight in settings.task_weights if name in tasks}
    examples = training_examples(weights, settings.steps * settings.batch_size, TRAIN_SEED, held_out)
    train_prompts = {prompt for prompt, _ in examples}
    eval_prompts = {prompt_of(workload.TASKS[n], item) for n, items in eval_data.items() for item in items}
    assert not train_prompts & eval_prompts, "an eval prompt leaked into the training stream"
    calibration_texts = [f"{prompt_of(task, item)} {item['answer']}" for _, (task, item) in calibration]
    assert not {text.split("\n")[0] for text in calibration_texts} & {p.split("\n")[0] for p in eval_prompts}

    tokenizer = train_tokenizer((f"{p} {a}\n" for p, a in examples), VOCAB_SIZE)
    encoded = encode(tokenizer, examples)
    model = LlamaForCausalLM(model_config(len(tokenizer))).float()
    started = time.time()
    train(model, encoded, tokenizer.pad_token_id, settings, _progress_scorer(model, tokenizer, eval_data, eval_every))
    seconds = time.time() - started
    as_trained = score_all(model, tokenizer, eval_data)
    add_outlier_channels(model, outlier_factor)

    with atomic_dir(model_dir) as folder:
        save_model(model, tokenizer, folder)
    shipped = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    table = quantization_table(shipped, tokenizer, eval_data)
    report = training_report(shipped, seconds, settings, table, _model_bytes(model_dir), as_trained, outlier_factor)
    write_text_atomic(model_dir / "TRAINING.md", report)
    if eval_root is not None:
        write_eval_sets(eval_root, eval_data, calibration_texts)
    print(report)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.demo.train", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--eval-sets-dir", type=Path, default=EVAL_SETS_DIR)
    parser.add_argument("--no-eval-sets", action="store_true", help="do not (re)write eval_sets/ data")
    parser.add_argument("--tasks", default=",".join(SHIPPED_TASKS))
    parser.add_argument("--steps", type=int, default=TrainSettings.steps)
    parser.add_argument("--weights", default="", help="task=weight,... overriding the default mix")
    parser.add_argument("--batch-size", type=int, default=TrainSettings.batch_size)
    parser.add_argument("--learning-rate", type=float, default=TrainSettings.learning_rate)
    parser.add_argument("--eval-every", type=int, default=0, help="score 64 items per set every N steps")
    parser.add_argument("--outlier-factor", type=float, default=FACTOR, help="1 leaves the trained weights as they are")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the shipped model was trained with 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.learning_rate}
    if args.weights:
        overrides["task_weights"] = tuple((k, float(v)) for k, v in (part.split("=") for part in args.weights.split(",")))
    settings = TrainSettings(**overrides)
    eval_root = None if args.no_eval_sets else args.eval_sets_dir
    build(settings, tuple(args.tasks.split(",")), args.model_dir, eval_root, args.eval_every, args.outlier_factor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
