"""One bounded HTTP GET: a deadline over the whole read (a server that trickles bytes is cut off), a size limit, and every
failure as one InputError naming the URL and the option it came from. Used for vLLM's /metrics pages (`quantize watch`,
the fleet's proxy) and Prometheus' HTTP API."""

from __future__ import annotations

import time

import httpx

from pipelines.bounds import MiB
from pipelines.errors import InputError

_DETAIL_CHARS = 160


def short(text: str, limit: int = _DETAIL_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def get_bounded(client: httpx.Client, url: str, *, field: str, max_bytes: int, timeout_s: float, params: dict[str, str] | None = None,
                what: str = "page") -> bytes:
    """The body of GET `url` (200 only), read within `timeout_s` and `max_bytes`."""
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    try:
        with client.stream("GET", url, params=params, timeout=httpx.Timeout(min(timeout_s, 5.0))) as response:
            if response.status_code != 200:
                body = response.read()[:_DETAIL_CHARS].decode(errors="replace") if response.status_code < 500 else ""
                raise InputError(f"answered HTTP {response.status_code}{': ' + short(body) if body else ''}", file=url, field=field)
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise InputError(f"the {what} is larger than {max_bytes / MiB:g} MiB", file=url, field=field)
                if time.monotonic() > deadline:
                    raise InputError(f"the {what} took longer than {timeout_s:g} s to read", file=url, field=field)
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise InputError(f"no answer within {timeout_s:g} s", file=url, field=field) from None
    except httpx.HTTPError as error:
        raise InputError(f"unreachable ({type(error).__name__}: {short(str(error)) or 'no detail'})", file=url, field=field) from None
    return b"".join(chunks)
