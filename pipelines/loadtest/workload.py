"""The load's requests: the business eval sets' own prompts, with output lengths from the baseline's answers.

Prompts are the text lm-eval sends per item (pipelines.evaluation.evaluate.load_prompts: few-shot context, chat template
where the set asks), drawn round-robin from every set in a seeded order, so that a run mixes the sets' real
lengths. Each prompt's output length is, with `output_tokens: baseline`, the length in tokens of the baseline's
own greedy answer, asked from the baseline server with the set's stop sequences and length limit (a multiple
choice set's limit is its longest choice); or a fixed count. Every request then generates exactly that many
tokens on both models (--ignore-eos), so the two do the same work. Rolling (perplexity) sets have no prompt to
answer and are left out.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from pydantic import Field

from pipelines.errors import LoadTestError
from pipelines.evaluation.evalsets import ROLLING, EvalSet
from pipelines.evaluation.evaluate import Prompt, load_tokenizer
from pipelines.schema import FrozenModel, StrictModel
from pipelines.serve.serving import RunningServer

SEED = 0
MULTIPLE_CHOICE = "multiple_choice"
GENERATE = "generate_until"
LM_EVAL_DEFAULT_UNTIL = ["\n\n"]  # lm-eval's generate_until default: the few-shot delimiter
LM_EVAL_DEFAULT_MAX_GEN_TOKS = 256
OTHER_ANSWER_TOKENS = 16  # an answer limit for a log-likelihood set whose choices vary per item
ANSWER_CONCURRENCY = 8


class WorkloadItem(FrozenModel):
    eval_set: str
    doc_id: int
    prompt: str
    prompt_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)


class AnswerLimit(FrozenModel):
    max_tokens: int = Field(ge=1)
    stop: list[str]


class Workload(StrictModel):
    items: list[WorkloadItem] = Field(min_length=1)
    output_tokens: str = Field(description="`baseline answers` or `fixed N`")
    left_out: list[str] = Field(default_factory=list, description="sets without a prompt to answer (rolling)")

    def first(self, count: int) -> list[WorkloadItem]:
        """`count` items: the first ones, cycled when the sets hold fewer."""
        return [self.items[index % len(self.items)] for index in range(count)]

    def summary(self) -> dict:
        def spread(values: list[int]) -> dict[str, float]:
            ordered = sorted(values)
            return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}

        sets: dict[str, int] = {}
        for item in self.items:
            sets[item.eval_set] = sets.get(item.eval_set, 0) + 1
        return {
            "prompts": len(self.items), "eval_sets": sets, "output_tokens_from": self.output_tokens,
            "prompt_tokens": spread([i.prompt_tokens for i in self.items]),
            "output_tokens": spread([i.output_tokens for i in self.items]), "left_out": self.left_out,
        }


def select_prompts(prompts: dict[str, list[Prompt]], count: int, seed: int = SEED) -> list[tuple[str, Prompt]]:
    """Up to `count` prompts, taken in turn from each set (sorted by name) in a seeded order per set."""
    queues = {}
    for name in sorted(prompts):
        order = list(prompts[name])
        random.Random(f"{seed}:{name}").shuffle(order)
        if order:
            queues[name] = order
    chosen: list[tuple[str, Prompt]] = []
    while len(chosen) < count and any(queues.values()):
        for name, queue in queues.items():
            if queue and len(chosen) < count:
                chosen.append((name, queue.pop(0)))
    return chosen


def answer_limit(eval_set: EvalSet, tokenizer) -> AnswerLimit:
    """How the set's answers end: generate_until's `until` and `max_gen_toks`; a multiple choice set's longest
    choice (lm-eval's target delimiter, a space, in front); another log-likelihood set's OTHER_ANSWER_TOKENS."""
    config = eval_set.config
    if eval_set.output_type == GENERATE:
        kwargs = config.get("generation_kwargs") or {}
        until = kwargs.get("until", LM_EVAL_DEFAULT_UNTIL)
        stop = [until] if isinstance(until, str) else [str(s) for s in until]
        return AnswerLimit(max_tokens=int(kwargs.get("max_gen_toks", LM_EVAL_DEFAULT_MAX_GEN_TOKS)), stop=stop)
    choices = config.get("doc_to_choice")
    if eval_set.output_type == MULTIPLE_CHOICE and isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        longest = max(len(tokenizer(" " + choice, add_special_tokens=False)["input_ids"]) for choice in choices)
        return AnswerLimit(max_tokens=max(1, longest), stop=["\n"])
    return AnswerLimit(max_tokens=OTHER_ANSWER_TOKENS, stop=["\n"])


def build_workload(
    eval_sets: list[EvalSet], prompts: dict[str, list[Prompt]], count: int, output_tokens: str | int,
    tokenizer_dir: Path, max_model_len: int, baseline: RunningServer | None,
) -> Workload:
    """`count` items with their output lengths; `baseline` (a running server) is asked when output_tokens is `baseline`."""
    usable = {s.name: prompts[s.name] for s in eval_sets if s.output_type != ROLLING and prompts.get(s.name)}
    left_out = sorted(s.name for s in eval_sets if s.name not in usable)
    chosen = select_prompts(usable, count)
    if not chosen:
        raise LoadTestError("no eval set has prompts to answer (rolling sets are left out of the load test)", field="eval_sets")
    tokenizer = load_tokenizer(tokenizer_dir)
    lengths = [len(tokenizer(prompt.text)["input_ids"]) for _, prompt in chosen]
    by_name = {s.name: s for s in eval_sets}
    limits = [_fit(answer_limit(by_name[name], tokenizer), length, max_model_len) for (name, _), length in zip(chosen, lengths, strict=True)]
    if output_tokens == "baseline":
        if baseline is None:
            raise LoadTestError("output_tokens: baseline needs the baseline server", field="performance.load.output_tokens")
        answers, source = answer_lengths(baseline, [prompt.text for _, prompt in chosen], limits), "baseline answers"
    else:
        answers, source = [min(int(output_tokens), limit.max_tokens) for limit in limits], f"fixed {output_tokens}"
    items = [
        WorkloadItem(eval_set=name, doc_id=prompt.doc_id, prompt=prompt.text, prompt_tokens=max(1, length), output_tokens=max(1, answer))
        for (name, prompt), length, answer in zip(chosen, lengths, answers, strict=True)
    ]
    return Workload(items=items, output_tokens=source, left_out=left_out)


def _fit(limit: AnswerLimit, prompt_tokens: int, max_model_len: int) -> AnswerLimit:
    room = max(1, max_model_len - prompt_tokens)
    return limit if limit.max_tokens <= room else limit.model_copy(update={"max_tokens": room})


def answer_lengths(server: RunningServer, texts: list[str], limits: list[AnswerLimit]) -> list[int]:
    """Tokens of the server's greedy answer to each prompt (the usage vLLM reports), a few requests at a time."""
    with httpx.Client(timeout=server.request_timeout_s) as client:
        def ask(job: tuple[str, AnswerLimit]) -> int:
            text, limit = job
            body = {"model": server.served_name, "prompt": text, "max_tokens": limit.max_tokens, "temperature": 0, "stop": limit.stop}
            try:
                response = client.post(f"{server.base_url}/completions", json=body, headers=server.auth_headers)
                if response.status_code != 200:
                    raise LoadTestError(f"the baseline server answered HTTP {response.status_code} to a workload prompt: {response.text[:200]}",
                                        file=server.log_path)
                return int(response.json()["usage"]["completion_tokens"])
            except (httpx.HTTPError, KeyError, TypeError, ValueError) as error:
                server.check_alive()
                raise LoadTestError(f"could not measure the baseline's answer lengths ({type(error).__name__}: {error})",
                                    file=server.log_path) from None

        with ThreadPoolExecutor(max_workers=ANSWER_CONCURRENCY) as pool:
            return list(pool.map(ask, zip(texts, limits, strict=True)))


def write_dataset(items: list[WorkloadItem], path: Path) -> Path:
    """The JSONL vLLM bench serve's custom dataset reads: {"prompt", "output_tokens"} per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": i.prompt, "output_tokens": i.output_tokens}) + "\n" for i in items))
    return path
