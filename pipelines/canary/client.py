"""The golden prompts asked of an OpenAI-compatible server (vLLM's /v1/completions): token-id prompts, greedy and seeded,
top-k log-probabilities with tokens named by id, a bounded number of requests in flight, one deadline over them all."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from pipelines.canary.compare import Answer
from pipelines.canary.golden import GenerationSettings

_DETAIL_CHARS = 200
API_KEY_ENV = "VLLM_API_KEY"  # where `watch` reads the watched server's key (the server itself reads it there)


class ProbeFailure(Exception):
    """A request that got no usable answer (transport error, time-out, HTTP status, malformed body)."""


def api_root(base_url: str) -> str:
    """The server's root from its base URL, with or without a trailing /v1."""
    return base_url.rstrip("/").removesuffix("/v1").rstrip("/")


def server_root(url: str) -> str:
    """http(s)://HOST:PORT of any URL on a server (its /metrics page, its base URL): where its API is."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else url


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def payload(model: str, prompt_ids: Sequence[int], settings: GenerationSettings) -> dict:
    return {"model": model, "prompt": list(prompt_ids), "max_tokens": settings.max_tokens, "temperature": 0, "seed": settings.seed,
            "logprobs": settings.top_k, "return_tokens_as_token_ids": True}


def parse_answer(body: object) -> tuple[Answer, str]:
    """(answer, text) from a completions body; ProbeFailure when it is not one."""
    try:
        choice = body["choices"][0]  # type: ignore[index]
        logprobs = choice["logprobs"]
        ids = [int(str(token).split(":", 1)[1]) for token in logprobs["tokens"]]
        rows = [dict(row or {}) for row in logprobs["top_logprobs"]]
        return Answer(ids=ids, top_logprobs=rows), str(choice.get("text") or "")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        raise ProbeFailure(f"the answer is not a completion with token-id log-probabilities ({type(error).__name__}: {error})") from None


async def ask(client: httpx.AsyncClient, url: str, body: dict, auth: dict[str, str]) -> tuple[Answer, str]:
    try:
        response = await client.post(url, json=body, headers=auth)
    except httpx.TimeoutException:
        raise ProbeFailure(f"{url} did not answer in time") from None
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise ProbeFailure(f"{url} unreachable ({type(error).__name__}: {error or 'no detail'})") from None
    if response.status_code != 200:
        raise ProbeFailure(f"{url} answered HTTP {response.status_code}: {' '.join(response.text[:_DETAIL_CHARS].split())}")
    try:
        return parse_answer(response.json())
    except ValueError:
        raise ProbeFailure(f"{url} answered with a body that is not JSON") from None


async def ask_all(base_url: str, *, model: str, prompts: Sequence[Sequence[int]], settings: GenerationSettings, api_key: str | None,
                  timeout_s: float, concurrency: int, filler: int = 0) -> list[tuple[Answer, str] | ProbeFailure]:
    """Every prompt's answer (or its failure), in order, within `timeout_s` over all of them. `filler`: that many copies of
    the prompts sent alongside (answers dropped), so the measured ones share batches with other sequences."""
    url = f"{api_root(base_url)}/v1/completions"
    semaphore = asyncio.Semaphore(concurrency)
    auth = headers(api_key)

    async def one(client: httpx.AsyncClient, ids: Sequence[int]) -> tuple[Answer, str] | ProbeFailure:
        async with semaphore:
            try:
                return await ask(client, url, payload(model, ids, settings), auth)
            except ProbeFailure as failure:
                return failure

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, follow_redirects=False) as client:
        tasks = [asyncio.ensure_future(one(client, ids)) for ids in prompts]
        tasks += [asyncio.ensure_future(one(client, prompts[i % len(prompts)])) for i in range(filler)]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        late = ProbeFailure(f"no answer within the probe's {timeout_s:g} s")
        return [late if task in pending else task.result() for task in tasks[: len(prompts)]]
