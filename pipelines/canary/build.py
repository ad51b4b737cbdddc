"""Fix a golden set at promotion, against the promoted weights' own server: draw the prompts, record the greedy answers,
then measure the tolerance from what the same weights do against themselves.

Draw: a seeded draw stratified across the run's eval sets (an equal share of `count` per set, the remainder to the
first sets by name; a set with fewer items gives what it has and the others make up the rest).

Tolerance (measured, not guessed): the prompts are asked twice more, alone (one request at a time, as they were
recorded) and under load (every prompt at once among LOAD_FILLER copies of the set, so batches hold other sequences: vLLM's
numerics depend on batch composition). Each pass is compared with the recorded answers (pipelines.canary.compare):
  kl_bound     = max(KL_FLOOR, KL_FACTOR x the largest per-prompt KL either pass showed)
  shift_bound  = max(SHIFT_FLOOR, SHIFT_FACTOR x the largest log-probability shift either pass showed)
  margin_bound = max(MARGIN_FLOOR, MARGIN_FACTOR x the largest recorded margin at which either pass diverged)
  max_disagreeing = 0: by construction neither pass disagrees under these bounds; the factors cover a tail two passes
  did not reach (docs/watch.md states the false-alarm and detection rates measured on the demo model).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timezone
from pathlib import Path

import httpx

from pipelines.canary.client import ProbeFailure, api_root, ask_all, headers
from pipelines.canary.compare import Answer, Distance, distance
from pipelines.canary.golden import GenerationSettings, GoldenPrompt, GoldenSet, SelfCheck, Tolerance
from pipelines.console.output import progress
from pipelines.errors import ServeError
from pipelines.files.atomic import write_text_atomic
from pipelines.schema import FrozenModel
from pipelines.serve.serving import LOOPBACK, RunningServer

DEFAULT_PROMPTS = 24
DEFAULT_SETTINGS = GenerationSettings(max_tokens=16, top_k=8, seed=0, concurrency=4)
LOAD_FILLER = 3
KL_FACTOR, KL_FLOOR = 4.0, 1e-3
SHIFT_FACTOR, SHIFT_FLOOR = 4.0, 0.1
MARGIN_FACTOR, MARGIN_FLOOR = 2.0, 1.0
RULE = (f"a prompt disagrees when its mean coarse top-k KL(recorded || now) over the positions up to the first divergence exceeds "
        f"kl_bound or a recorded top-k token's log-probability moved more than shift_bound, or when its greedy answer first "
        f"differs at a position whose recorded top-1 margin is at least margin_bound; kl_bound = max({KL_FLOOR:g}, {KL_FACTOR:g} x "
        f"the largest self-check KL), shift_bound = max({SHIFT_FLOOR:g}, {SHIFT_FACTOR:g} x the largest self-check shift), "
        f"margin_bound = max({MARGIN_FLOOR:g}, {MARGIN_FACTOR:g} x the largest margin a self-check diverged at)")


class DrawnPrompt(FrozenModel):
    eval_set: str
    doc_id: int
    text: str
    add_special_tokens: bool  # a chat-templated prompt carries its BOS already


class PromptSource(FrozenModel):
    """One eval set's prompts as the gate run rendered them (pipelines.evaluation.evaluate.load_all_prompts)."""

    name: str
    items: list[tuple[int, str]]
    add_special_tokens: bool


def draw(sources: Sequence[PromptSource], count: int, seed: int) -> list[DrawnPrompt]:
    """A seeded draw of `count` prompts (fewer when the sets hold fewer), stratified across the sets."""
    ordered = sorted(sources, key=lambda source: source.name)
    shuffled = {s.name: random.Random(f"{seed}:{s.name}").sample(s.items, len(s.items)) for s in ordered}
    quota = {s.name: 0 for s in ordered}
    left = count
    while left > 0 and any(quota[s.name] < len(s.items) for s in ordered):
        for source in ordered:
            if left > 0 and quota[source.name] < len(source.items):
                quota[source.name] += 1
                left -= 1
    return [DrawnPrompt(eval_set=s.name, doc_id=doc_id, text=text, add_special_tokens=s.add_special_tokens)
            for s in ordered for doc_id, text in sorted(shuffled[s.name][: quota[s.name]])]


def tokenize(client: httpx.Client, base_url: str, model: str, prompt: DrawnPrompt, api_key: str | None) -> list[int]:
    response = client.post(f"{api_root(base_url)}/tokenize", headers=headers(api_key),
                           json={"model": model, "prompt": prompt.text, "add_special_tokens": prompt.add_special_tokens})
    if response.status_code != 200:
        raise ServeError(f"/tokenize answered HTTP {response.status_code} for a golden prompt of {prompt.eval_set!r}", file=base_url)
    return [int(token) for token in response.json()["tokens"]]


def build_golden(base_url: str, *, model: str, api_key: str | None, drawn: Sequence[DrawnPrompt], seed: int, timeout_s: float,
                 settings: GenerationSettings = DEFAULT_SETTINGS) -> GoldenSet:
    """The golden set of the weights `base_url` serves as `model`; a ServeError when the server does not answer."""
    started = time.monotonic()
    if not drawn:
        raise ServeError("no golden prompt could be drawn: the eval sets hold no items", file=base_url)
    try:
        with httpx.Client(timeout=timeout_s) as client:
            prompt_ids = [tokenize(client, base_url, model, prompt, api_key) for prompt in drawn]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as error:
        raise ServeError(f"tokenizing the golden prompts failed ({type(error).__name__}: {error})", file=base_url) from None
    recorded, _ = _pass(base_url, model, api_key, prompt_ids, settings, timeout_s, concurrency=1)
    prompts = [
        GoldenPrompt(id=f"p{index:02d}", eval_set=p.eval_set, doc_id=p.doc_id, text=p.text, prompt_ids=ids, answer_ids=answer.ids,
                     answer_text=text, top_logprobs=answer.top_logprobs)
        for index, (p, ids, (answer, text)) in enumerate(zip(drawn, prompt_ids, recorded, strict=True))
    ]
    checks = [
        _self_check("alone", 1, prompts, base_url, model, api_key, settings, timeout_s),
        _self_check("load", len(prompts) * (1 + LOAD_FILLER), prompts, base_url, model, api_key, settings, timeout_s),
    ]
    return GoldenSet(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), seed=seed,
        eval_sets=sorted({p.eval_set for p in drawn}), settings=settings, prompts=prompts, tolerance=tolerance_from(checks),
        build_s=round(time.monotonic() - started, 2),
    )


def _pass(base_url: str, model: str, api_key: str | None, prompt_ids: Sequence[Sequence[int]], settings: GenerationSettings,
          timeout_s: float, *, concurrency: int, filler: int = 0) -> tuple[list[tuple[Answer, str]], float]:
    started = time.monotonic()
    answers = asyncio.run(ask_all(base_url, model=model, prompts=prompt_ids, settings=settings, api_key=api_key,
                                  timeout_s=timeout_s, concurrency=concurrency, filler=filler))
    failed = next((answer for answer in answers if isinstance(answer, ProbeFailure)), None)
    if failed is not None:
        raise ServeError(f"the golden prompts could not be asked: {failed}", file=base_url)
    empty = [index for index, answer in enumerate(answers) if not isinstance(answer, ProbeFailure) and not answer[0].ids]
    if empty:
        raise ServeError(f"the server gave an empty answer to golden prompt {empty[0]}", file=base_url)
    return [answer for answer in answers if not isinstance(answer, ProbeFailure)], time.monotonic() - started


def _self_check(name: str, concurrency: int, prompts: Sequence[GoldenPrompt], base_url: str, model: str, api_key: str | None,
                settings: GenerationSettings, timeout_s: float) -> SelfCheck:
    filler = len(prompts) * LOAD_FILLER if concurrency > 1 else 0
    answers, wall_s = _pass(base_url, model, api_key, [p.prompt_ids for p in prompts], settings, timeout_s, concurrency=concurrency,
                            filler=filler)
    found = [distance(prompt, answer, settings.top_k) for prompt, (answer, _) in zip(prompts, answers, strict=True)]
    return summarize(name, concurrency, found, wall_s)


def summarize(name: str, concurrency: int, found: Sequence[Distance], wall_s: float) -> SelfCheck:
    diverged = [d for d in found if d.diverged_at is not None]
    return SelfCheck(name=name, concurrency=concurrency, max_kl=max((d.kl or 0.0 for d in found), default=0.0),
                     max_shift=max((d.shift or 0.0 for d in found), default=0.0), diverged=len(diverged),
                     max_divergence_margin=max((d.margin or 0.0 for d in diverged), default=0.0), wall_s=round(wall_s, 3))


def tolerance_from(checks: Sequence[SelfCheck]) -> Tolerance:
    kl = max(check.max_kl for check in checks)
    shift = max(check.max_shift for check in checks)
    margin = max(check.max_divergence_margin for check in checks)
    return Tolerance(kl_bound=max(KL_FLOOR, KL_FACTOR * kl), shift_bound=max(SHIFT_FLOOR, SHIFT_FACTOR * shift),
                     margin_bound=max(MARGIN_FLOOR, MARGIN_FACTOR * margin), max_disagreeing=0,
                     rule=RULE, self_checks=list(checks))


def sources_of(prompts: Mapping[str, Sequence[object]], chat: Mapping[str, bool]) -> list[PromptSource]:
    """PromptSources from the run's prompts (objects with doc_id and text) and each set's chat flag."""
    return [PromptSource(name=name, items=[(p.doc_id, p.text) for p in items], add_special_tokens=not chat.get(name, False))  # type: ignore[attr-defined]
            for name, items in prompts.items()]


def golden_from_server(server: RunningServer, sources: Sequence[PromptSource], *, count: int = DEFAULT_PROMPTS, seed: int = 0) -> GoldenSet:
    """The golden set of a server the product started (pipelines.serve.serving): its URL, served name, key and time-out."""
    progress(f"canary: fixing {count} golden prompts on {server.served_name} (greedy answers, then two self-checks)")
    return build_golden(f"http://{LOOPBACK}:{server.port}", model=server.served_name, api_key=server.api_key,
                        drawn=draw(sources, count, seed), seed=seed, timeout_s=server.request_timeout_s)


def write_golden(golden: GoldenSet, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, golden.model_dump_json(indent=1) + "\n")


def fix_golden(serve: Callable[[], AbstractContextManager[RunningServer]], sources: Sequence[PromptSource], path: Path) -> GoldenSet:
    """At promotion (pipelines.runs.runner): the golden set of the server `serve` gives, written to `path` (the run's
    evidence/canary.json, which the promotion bundle copies and signs)."""
    with serve() as server:
        golden = golden_from_server(server, sources)
    write_golden(golden, path)
    return golden
