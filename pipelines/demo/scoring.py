"""Score a causal LM through transformers the way lm-eval scores it through the server.

Multiple choice: the choice with the highest summed log-probability of its tokens after the prompt
(lm-eval's `acc`; the continuation is " " + choice). Generation: greedy until a newline, compared after
stripping whitespace (exact match).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

_BATCH = 64


def _continuation_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, continuation: str) -> tuple[list[int], int]:
    whole = tokenizer(prompt + continuation, add_special_tokens=False).input_ids
    context = tokenizer(prompt, add_special_tokens=False).input_ids
    if whole[: len(context)] != context:
        raise ValueError(f"prompt and prompt+answer tokenize inconsistently: {prompt!r} + {continuation!r}")
    return whole, len(context)


@torch.no_grad()
def _sequence_logprobs(model: PreTrainedModel, rows: list[tuple[list[int], int]], pad_id: int) -> list[float]:
    scores: list[float] = []
    for start in range(0, len(rows), _BATCH):
        chunk = rows[start : start + _BATCH]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (tokens, _) in enumerate(chunk):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        for row, (tokens, context_len) in enumerate(chunk):
            targets = torch.tensor(tokens[context_len:])
            picked = logprobs[row, context_len - 1 : len(tokens) - 1].gather(1, targets[:, None])
            scores.append(float(picked.sum()))
    return scores


def multiple_choice_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    choices: list[list[str]],
    labels: list[int],
) -> list[bool]:
    rows = [_continuation_ids(tokenizer, p, " " + c) for p, options in zip(prompts, choices, strict=True) for c in options]
    scores = iter(_sequence_logprobs(model, rows, tokenizer.pad_token_id))
    correct = []
    for options, label in zip(choices, labels, strict=True):
        option_scores = [next(scores) for _ in options]
        correct.append(max(range(len(options)), key=option_scores.__getitem__) == label)
    return correct


@torch.no_grad()
def greedy_generations(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int
) -> list[str]:
    newline = tokenizer("\n", add_special_tokens=False).input_ids
    stop_ids = [tokenizer.eos_token_id, *newline[-1:]]
    outputs: list[str] = []
    for start in range(0, len(prompts), _BATCH):
        batch = tokenizer(
            prompts[start : start + _BATCH], add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt"
        )
        generated = model.generate(  # type: ignore[operator]  # GenerationMixin's, which mypy resolves through nn.Module.__getattr__
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop_ids,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = generated[:, batch["input_ids"].shape[1] :]
        for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True):
            outputs.append(text.split("\n", 1)[0])
    return outputs


def exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    answers: list[str],
    max_new_tokens: int,
) -> list[bool]:
    generations = greedy_generations(model, tokenizer, prompts, max_new_tokens)
    return [out.strip() == answer.strip() for out, answer in zip(generations, answers, strict=True)]
