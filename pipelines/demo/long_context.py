"""A long-context variant of a generative eval set: each item's prompt is preceded by worked items of the same set
until it is near the serving context, where a KV cache's precision matters (every cached key and value is read back
at each step, and there are max_model_len of them).

    python -m pipelines.demo.long_context payment_reference OUT_DIR [--model models/demo-llama] [--max-model-len 512]

writes OUT_DIR/payment_reference_long/ (task YAML + data.jsonl, byte-identical on a rerun): the same items and answers,
the prompt `{{context}}` + the set's own prompt, where `context` is the set's other items rendered with their answers
("<prompt> <answer>\\n" each, in the set's order after the item) until the prompt, counted with the model's tokenizer,
would pass max_model_len - max_gen_toks - 8. Score it like any set: `QUANTGATE_EVAL_SETS=OUT_DIR quantize --recipe
kv-fp8 --eval-sets payment_reference_long` (where an FP8 KV cache serves; docs/formats.md). Generative sets whose target is one
field of the item (`doc_to_target: answer`) only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipelines.errors import InputError
from pipelines.evaluation.evalsets import EvalSet, select_eval_sets
from pipelines.files.atomic import write_text_atomic
from pipelines.files.jsonl import iter_jsonl
from pipelines.files.yamlio import dump_yaml
from pipelines.paths import DEMO_MODEL_DIR

SUFFIX = "_long"
MARGIN_TOKENS = 8  # BOS and the tokenizer's joins: the prompt stays this far under the budget


def long_items(eval_set: EvalSet, tokenizer: Any, budget: int) -> list[dict]:
    """Every item of the set with `context`: the other items' prompts and answers, in order after it, up to `budget` tokens."""
    from jinja2 import Template

    config = eval_set.config
    target = config.get("doc_to_target")
    if config.get("output_type") != "generate_until" or not isinstance(target, str) or "{" in target:
        raise InputError("a long-context variant needs a generative set whose doc_to_target names one field", file=eval_set.task_yaml,
                         field="doc_to_target")
    prompt = Template(str(config["doc_to_text"]))
    items = [item for _, item in iter_jsonl(eval_set.data)]
    worked = [f"{prompt.render(**item)} {item[target]}\n" for item in items]
    out = []
    for index, item in enumerate(items):
        own, context = len(tokenizer(prompt.render(**item))["input_ids"]), ""
        for step in range(1, len(items)):
            candidate = context + worked[(index + step) % len(items)]
            if own + len(tokenizer(candidate)["input_ids"]) > budget:
                break
            context = candidate
        out.append({**item, "context": context})
    return out


def write_long_set(eval_set: EvalSet, out_dir: Path, model_dir: Path, max_model_len: int) -> Path:
    from transformers import AutoTokenizer

    config = eval_set.config
    max_gen = int(config.get("generation_kwargs", {}).get("max_gen_toks", 32))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    items = long_items(eval_set, tokenizer, max_model_len - max_gen - MARGIN_TOKENS)
    name = f"{eval_set.name}{SUFFIX}"
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    task = {key: value for key, value in config.items() if key != "custom_dataset"}
    task.update(task=name, doc_to_text="{{context}}" + str(config["doc_to_text"]),
                metadata={**config.get("metadata", {}), "about": f"{eval_set.name} with its prompts filled near {max_model_len} tokens "
                                                                   "(python -m pipelines.demo.long_context)"})
    task["custom_dataset"] = config["custom_dataset"]
    write_text_atomic(folder / f"{name}.yaml", dump_yaml(task))
    write_text_atomic(folder / "data.jsonl", "".join(json.dumps(item) + "\n" for item in items))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eval_set", help="a generative set under eval_sets/ (payment_reference)")
    parser.add_argument("out_dir", type=Path, help="where <set>_long/ is written (a folder for QUANTGATE_EVAL_SETS)")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="whose tokenizer counts the tokens (default: the demo model)")
    parser.add_argument("--max-model-len", type=int, default=512, help="the serving context the prompts are filled to (default 512)")
    args = parser.parse_args(argv)
    (eval_set,) = select_eval_sets([args.eval_set])
    folder = write_long_set(eval_set, args.out_dir, args.model, args.max_model_len)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
