"""One bounded HTTP GET: a total deadline over the whole exchange, a size limit on the decompressed body, and every failure
as one InputError naming the URL (without credentials) and the option it came from. Used for vLLM's /metrics pages
(`quantize watch`, the fleet's proxy) and Prometheus' HTTP API.

The deadline covers resolving the host name, connecting, the headers and the body together: httpx's timeouts are per read, so a server that sends
one header byte a second never trips them. A watchdog timer shuts the connection's socket down when the deadline passes
(the socket is learned from httpcore's documented `trace` extension; each request asks `Connection: close`, so every
request opens its own connection and the socket is always known), which ends the blocked read at once.

The body is read raw (as it came on the wire, at most `max_bytes`) and decoded here, one Content-Encoding layer at a time
(gzip or deflate, at most MAX_ENCODINGS layers), each layer's output bounded by `max_bytes` too: a small answer that
inflates to gigabytes (a bomb, or `Content-Encoding: gzip, gzip`) stops at the bound instead of exhausting memory.
"""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from pipelines.bounds import MiB
from pipelines.console.redact import without_credentials
from pipelines.console.urls import checked_url
from pipelines.errors import InputError

_DETAIL_CHARS = 160
_RESOLVE_GRACE_S = 0.5  # past the deadline, for the watchdog's shut socket to end the exchange's read
MAX_ENCODINGS = 4
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
REQUEST_HEADERS = {"Accept-Encoding": "gzip, deflate", "Connection": "close"}


def short(text: str, limit: int = _DETAIL_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class _Watchdog:
    """Shuts down the request's socket when `timeout_s` has passed: a total deadline whatever the peer does."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.fired = False
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True

    def trace(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith(("connect_tcp.complete", "start_tls.complete")) and info.get("return_value") is not None:
            with self._lock:
                self._socket = info["return_value"].get_extra_info("socket")
                if self.fired:
                    self._shut()

    def expired(self) -> bool:
        return self.fired or time.monotonic() > self.deadline

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            self._shut()

    def _shut(self) -> None:
        if self._socket is not None:
            try:
                self._socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @contextmanager
    def running(self) -> Iterator[_Watchdog]:
        self._timer.start()
        try:
            yield self
        finally:
            self._timer.cancel()


def get_bounded(client: httpx.Client, url: str, *, field: str, max_bytes: int, timeout_s: float, params: dict[str, str] | None = None,
                what: str = "page") -> bytes:
    """The decoded body of GET `url` (200 only), read within `timeout_s` in all and `max_bytes` (on the wire and decoded).

    The exchange runs in a daemon thread the caller waits for at most `timeout_s` (and a moment): the host name's resolution
    (getaddrinfo, which no socket timeout reaches) is inside the same bound, and a resolver that hangs leaves that thread
    behind, never the command."""
    checked_url(url, field)
    shown = without_credentials(url)

    def failure(message: str) -> InputError:
        return InputError(message, file=shown, field=field)

    outcome: list[tuple[bytes, str] | BaseException] = []
    watchdog = _Watchdog(timeout_s)

    def exchange() -> None:
        try:
            outcome.append(_exchange(client, url, params, watchdog, failure, max_bytes, timeout_s, what))
        except BaseException as error:  # handed to the waiting caller, raised there
            outcome.append(error)

    worker = threading.Thread(target=exchange, name="bounded-get", daemon=True)
    with watchdog.running():
        worker.start()
        worker.join(timeout_s + _RESOLVE_GRACE_S)
    if not outcome:
        raise failure(f"no answer within {timeout_s:g} s (the host name did not resolve in time)")
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    raw, encoding = result
    return decoded(raw, encoding, max_bytes, failure, what)


def _exchange(client: httpx.Client, url: str, params: dict[str, str] | None, watchdog: _Watchdog, failure, max_bytes: int,
              timeout_s: float, what: str) -> tuple[bytes, str]:
    """The raw body and its Content-Encoding, within the watchdog's deadline; every failure one InputError."""
    too_slow = failure(f"the {what} took longer than {timeout_s:g} s to read")
    answered = False
    try:
        try:
            with client.stream("GET", url, params=params, headers=REQUEST_HEADERS, timeout=httpx.Timeout(min(timeout_s, 5.0)),
                               extensions={"trace": watchdog.trace}) as response:
                answered = True
                if response.status_code != 200:
                    raise failure(f"answered HTTP {response.status_code}{_detail(response)}")
                raw = _read_raw(response, max_bytes, watchdog, failure, what)
                encoding = response.headers.get("content-encoding", "")
        except httpx.HTTPError:
            if watchdog.expired():
                raise (too_slow if answered else failure(f"no answer within {timeout_s:g} s")) from None
            raise
        if watchdog.expired():
            raise too_slow
    except httpx.TimeoutException:
        raise failure(f"no answer within {timeout_s:g} s") from None
    except (httpx.InvalidURL, ValueError) as error:  # a host no resolver takes (IDNA: a UnicodeError), a malformed URL
        raise failure(f"not a valid URL ({type(error).__name__}: {short(str(error)) or 'no detail'})") from None
    except httpx.HTTPError as error:
        raise failure(f"unreachable ({type(error).__name__}: {short(str(error)) or 'no detail'})") from None
    return raw, encoding


def _read_raw(response: httpx.Response, max_bytes: int, watchdog: _Watchdog, failure, what: str) -> bytes:
    chunks, size = [], 0
    for chunk in response.iter_raw():
        size += len(chunk)
        if size > max_bytes:
            raise failure(f"the {what} is larger than {max_bytes / MiB:g} MiB")
        if watchdog.expired():
            raise httpx.ReadTimeout("deadline")
        chunks.append(chunk)
    return b"".join(chunks)


def _detail(response: httpx.Response) -> str:
    """A short excerpt of an error answer (below 500, unencoded only), read within the same bounds."""
    if response.status_code >= 500 or response.headers.get("content-encoding", "identity").strip().lower() != "identity":
        return ""
    body = b""
    for chunk in response.iter_raw():
        body += chunk
        if len(body) >= _DETAIL_CHARS:
            break
    text = body[:_DETAIL_CHARS].decode(errors="replace")
    return f": {short(text)}" if text.strip() else ""


def decoded(data: bytes, content_encoding: str, max_bytes: int, failure, what: str) -> bytes:
    """`data` with its Content-Encoding layers undone (the last listed first), each layer's output at most `max_bytes`."""
    codings = [coding.strip().lower() for coding in content_encoding.split(",") if coding.strip().lower() not in ("", "identity")]
    if len(codings) > MAX_ENCODINGS:
        raise failure(f"the {what} is encoded {len(codings)} times over (Content-Encoding {short(content_encoding, 60)!r}; at most "
                      f"{MAX_ENCODINGS})")
    for coding in reversed(codings):
        if coding not in _WBITS:
            raise failure(f"the {what} has Content-Encoding {short(coding, 40)!r} (read: gzip, deflate)")
        data = _inflated(data, coding, max_bytes, failure, what)
    return data


def _inflated(data: bytes, coding: str, max_bytes: int, failure, what: str) -> bytes:
    out = bytearray()
    wbits = _WBITS[coding]
    while data:  # gzip allows several members one after the other
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(data, max_bytes + 1 - len(out))
        except zlib.error:
            if coding != "deflate" or out or wbits < 0:
                raise failure(f"the {what} is not valid {coding} data") from None
            wbits = -zlib.MAX_WBITS  # a raw deflate stream, as some servers send for `deflate`
            continue
        if len(out) > max_bytes:
            raise failure(f"the {what} inflates to more than {max_bytes / MiB:g} MiB ({coding})")
        if not inflater.eof:
            raise failure(f"the {what} is truncated {coding} data")
        data = inflater.unused_data if coding != "deflate" else b""
    return bytes(out)
