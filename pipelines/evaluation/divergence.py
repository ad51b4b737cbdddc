"""Output divergence between baseline and candidate: mean per-token KL on the eval prompts.

Method ("top-k coarse-grained KL", k = TOP_K): the baseline server greedily continues each prompt
(MAX_NEW_TOKENS tokens at most) and returns its top-k log-probabilities at every generated position;
the candidate server is then asked, with echo, for its top-k log-probabilities along exactly the same
token ids. At each position, both distributions are coarse-grained to the baseline's k most likely
tokens plus one "rest" bucket and KL(baseline || candidate) is computed on that partition.

What is averaged: per-token KL at each position of the path, then the mean over the positions of one
item (item_kl); the gate then averages items equally. An item without a measured position has no KL
(None), never 0. On multiple-choice sets the path is the same greedy continuation of the prompt, not
the choice strings: its first position is the next-token distribution the choices' first tokens are
scored from; later positions follow the baseline's own continuation.

Lower bound of the full-vocabulary KL. vLLM lists the k most likely tokens plus, when the requested
(echoed) token is not among them, that token (k + 1 entries). A token j of the baseline's top-k that
the candidate does not list has q_j <= c, the k-th largest of the candidate's top-k, and coarse_kl
uses c. Why that stays a lower bound: pair each such j with a distinct token m of the candidate's
top-k outside the baseline's top-k (there are at least as many), so q_m >= c and p_m <= p_j. Using c
moves d = c - q_j of candidate mass from the rest bucket to j, as if taken from m. Splitting m out of
the rest bucket can only raise the value (data processing), and p_j log(c / q_j) >= p_m log(q_m / (q_m - d))
(x / (x - d) decreases in x), so the value is at most the KL on the partition {baseline's top-k, each
m, the rest}, itself at most the full KL. Hence c is the k-th entry, not the smaller extra one, and
the baseline's partition is its k largest entries only (tests/unit/evaluation/test_divergence.py: 20,000 random cases).
"""

from __future__ import annotations

import asyncio
import math

import httpx
from pydantic import BaseModel

from pipelines.errors import ServeError
from pipelines.serve.serving import MAX_LOGPROBS, RunningServer

TOP_K = MAX_LOGPROBS  # the KL reads every log-probability the server lists for a token
MAX_NEW_TOKENS = 8
KL_METHOD = (
    f"top-{TOP_K} coarse-grained KL(baseline||candidate) per generated token, greedy baseline path, "
    f"{MAX_NEW_TOKENS} tokens max, mean over positions per item (lower bound of full KL)"
)
_CONCURRENCY = 8
# A pooled keep-alive connection the server closed as the request went out (uvicorn closes idle ones after 5 s): the
# request is sent again on a new one. Both endpoints are idempotent here (a tokenization; a greedy completion).
TRANSPORT_ATTEMPTS = 3


class Reference(BaseModel):
    """One prompt's baseline path: token ids and the baseline's top-k per generated position."""

    doc_id: int
    prompt_ids: list[int]
    generated_ids: list[int]
    baseline_topk: list[dict[str, float]]


def _token_id(key: str) -> int:
    return int(key.split(":", 1)[1])


async def _post(client: httpx.AsyncClient, server: RunningServer, path: str, payload: dict) -> dict:
    root = server.base_url.removesuffix("/v1")
    # The key is needed on /v1/...; vLLM does not guard /tokenize, but the header costs nothing there.
    for attempt in range(1, TRANSPORT_ATTEMPTS + 1):
        try:
            response = await client.post(f"{root}{path}", json={"model": server.served_name, **payload}, headers=server.auth_headers)
            break
        except httpx.TimeoutException:
            server.check_engine()
            raise ServeError(f"{path} did not answer within {server.request_timeout_s:g} s", file=server.log_path) from None
        except httpx.TransportError as error:  # measured: httpx.ReadError after a 20-minute scoring on a starved host
            if attempt == TRANSPORT_ATTEMPTS:
                server.check_engine()
                raise ServeError(f"{path}: the server dropped the connection {TRANSPORT_ATTEMPTS} times "
                                 f"({type(error).__name__}: {error or 'no detail'})", file=server.log_path) from None
    if response.status_code != 200:
        server.check_engine()
        raise ServeError(f"{path} returned HTTP {response.status_code}: {response.text[:200]}", file=server.log_path)
    return response.json()


async def _reference_one(client, server, doc_id: int, prompt: str, add_special_tokens: bool) -> Reference:
    # A chat-templated prompt already carries its BOS: the tokenizer must not add another.
    prompt_ids = (await _post(client, server, "/tokenize", {"prompt": prompt, "add_special_tokens": add_special_tokens}))["tokens"]
    body = await _post(
        client, server, "/v1/completions",
        {"prompt": prompt_ids, "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "logprobs": TOP_K,
         "return_tokens_as_token_ids": True},
    )
    logprobs = body["choices"][0]["logprobs"]
    return Reference(
        doc_id=doc_id, prompt_ids=prompt_ids,
        generated_ids=[_token_id(token) for token in logprobs["tokens"]],
        baseline_topk=logprobs["top_logprobs"],
    )


async def _candidate_one(client, server, reference: Reference) -> list[dict[str, float]]:
    body = await _post(
        client, server, "/v1/completions",
        {"prompt": reference.prompt_ids + reference.generated_ids, "max_tokens": 1, "temperature": 0,
         "logprobs": TOP_K, "echo": True, "return_tokens_as_token_ids": True},
    )
    top = body["choices"][0]["logprobs"]["top_logprobs"]
    start = len(reference.prompt_ids)
    return top[start : start + len(reference.generated_ids)]


async def _gather(coroutines, timeout_s: float):
    semaphore = asyncio.Semaphore(_CONCURRENCY)

    async def limited(coroutine):
        async with semaphore:
            return await coroutine

    return await asyncio.gather(*(limited(c) for c in coroutines))


def baseline_references(server: RunningServer, prompts: list[tuple[int, str]], *, add_special_tokens: bool = True) -> list[Reference]:
    async def run():
        async with httpx.AsyncClient(timeout=server.request_timeout_s) as client:
            return await _gather(
                [_reference_one(client, server, i, text, add_special_tokens) for i, text in prompts], server.request_timeout_s
            )

    return asyncio.run(run())


def candidate_topk(server: RunningServer, references: list[Reference]) -> list[list[dict[str, float]]]:
    async def run():
        async with httpx.AsyncClient(timeout=server.request_timeout_s) as client:
            return await _gather([_candidate_one(client, server, r) for r in references], server.request_timeout_s)

    return asyncio.run(run())


def _top(logprobs: dict[str, float], k: int) -> dict[str, float]:
    """The k largest entries: vLLM's extra (k+1-th) entry for the requested token is not part of the top-k."""
    return dict(sorted(logprobs.items(), key=lambda entry: entry[1], reverse=True)[:k])


def coarse_kl(baseline: dict[str, float], candidate: dict[str, float], k: int = TOP_K) -> float:
    """KL on the partition {baseline's top-k tokens} + {rest}, a lower bound of the full KL (module docstring).

    Both arguments map tokens to log-probabilities as vLLM lists them (k or k + 1 entries).
    """
    p = {token: math.exp(lp) for token, lp in _top(baseline, k).items()}
    floor = min(_top(candidate, k).values())  # the k-th largest: bounds every unlisted token
    q = {token: math.exp(candidate.get(token, floor)) for token in p}
    p_rest = max(0.0, 1.0 - sum(p.values()))
    q_rest = max(1e-12, 1.0 - sum(q.values()))
    kl = sum(pv * (math.log(pv) - math.log(max(q[token], 1e-12))) for token, pv in p.items() if pv > 0)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)


def item_kl(reference: Reference, candidate: list[dict[str, float]]) -> float | None:
    """Mean over the path's positions of the per-token coarse KL; None when no position was measured. A position where
    the candidate lists a NaN or infinite log-probability is not a measurement (coarse_kl would read it as 0): skipped."""
    pairs = [(b, c) for b, c in zip(reference.baseline_topk, candidate, strict=False) if b and c and _finite_values(c)]
    return sum(coarse_kl(b, c) for b, c in pairs) / len(pairs) if pairs else None


def _finite_values(logprobs: dict[str, float]) -> bool:
    return all(math.isfinite(value) for value in logprobs.values())
