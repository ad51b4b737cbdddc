"""The product's one health probe of a vLLM server: what healthy means and how long an answer may take.

Healthy is HTTP 200 from the server's /health within HEALTH_TIMEOUT_S. /health needs no key, so a foreign process on
the port could pass it: where a caller must know the server is ours (serving's start-up), `key_problem` asks
/v1/models with our key and checks the served name is listed. Used by serving.py's start-up wait, the fleet's
supervisor (a hung route) and `quantize serve status`.
"""

from __future__ import annotations

from typing import Literal

import httpx

LOOPBACK = "127.0.0.1"
HEALTH_TIMEOUT_S = 2.0  # one policy: a server that takes longer to say it is alive is not answering (hung or starved)
Health = Literal["ok", "refused", "no answer", "error", "not running"]


def health_url(port: int, host: str = LOOPBACK) -> str:
    return f"http://{host}:{port}/health"


def probe_health(port: int | None, *, client: httpx.Client | None = None) -> Health:
    """The server on loopback `port` in one word: ok (200 from /health), refused, no answer (timed out), error (any other
    answer or failure), not running (no port)."""
    if port is None:
        return "not running"
    try:
        if client is not None:
            answer = client.get(health_url(port), timeout=HEALTH_TIMEOUT_S)
        else:
            answer = httpx.get(health_url(port), timeout=HEALTH_TIMEOUT_S)
    except httpx.ConnectError:
        return "refused"
    except httpx.TimeoutException:
        return "no answer"
    except httpx.HTTPError:
        return "error"
    return "ok" if answer.status_code == 200 else "error"


def healthy(port: int | None, *, client: httpx.Client | None = None) -> bool:
    return probe_health(port, client=client) == "ok"


def key_problem(client: httpx.Client, port: int, *, served_name: str, api_key: str) -> str:
    """Why the server on `port` is not the one started with `api_key` serving `served_name`, or "" when it is: it lists
    `served_name` on /v1/models when asked with the key (a vLLM started with another key answers 401)."""
    try:
        response = client.get(f"http://{LOOPBACK}:{port}/v1/models", headers={"Authorization": f"Bearer {api_key}"},
                              timeout=HEALTH_TIMEOUT_S)
        if response.status_code != 200:
            return f"GET /v1/models with our key answered HTTP {response.status_code}"
        names = [model.get("id") for model in response.json().get("data", [])]
    except (httpx.HTTPError, ValueError, AttributeError) as error:
        return f"GET /v1/models failed ({type(error).__name__}: {error})"
    return "" if served_name in names else f"GET /v1/models lists {names}, not {served_name!r}"
