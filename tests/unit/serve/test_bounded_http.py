"""The bounded GET against real hostile servers on loopback: one that trickles its header bytes (a total deadline, not a
per-read timeout), one that sends a stacked-gzip bomb (bounded on the decompressed size, small in memory), and credentials
kept out of every line that names the URL."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from pipelines.bounds import MiB
from pipelines.console.redact import without_credentials
from pipelines.errors import InputError
from pipelines.serve.bounded_http import get_bounded


@contextmanager
def raw_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on loopback that reads one request and lets `answer` write whatever it likes, one thread per connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_handle, args=(connection, answer, stop), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    finally:
        stop.set()
        thread.join()
        listener.close()


def _handle(connection: socket.socket, answer: Callable[[socket.socket], None], stop: threading.Event) -> None:
    with connection:
        connection.recv(65536)
        try:
            answer(connection)
        except OSError:
            pass  # the client went away: what the deadline is for


def trickle(connection: socket.socket) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Slow: " + b"a" * 1000:
        connection.sendall(bytes([byte]))
        time.sleep(0.2)


def answering(body: bytes, encoding: str) -> Callable[[socket.socket], None]:
    def answer(connection: socket.socket) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: " + encoding.encode()
                           + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    return answer


def test_a_server_trickling_its_headers_is_cut_off_at_the_total_deadline():
    with raw_server(trickle) as url, httpx.Client() as client:
        began = time.monotonic()
        with pytest.raises(InputError, match="no answer within 1 s") as error:
            get_bounded(client, url, field="--url", max_bytes=MiB, timeout_s=1.0)
        assert time.monotonic() - began < 5  # a per-read timeout of 1 s never trips: a byte comes every 0.2 s for 200 s
    assert error.value.field == "--url"


def test_a_stacked_gzip_bomb_is_bounded_on_its_decompressed_size_and_memory():
    inner = gzip.compress(bytes(64 * MiB), compresslevel=9)
    bomb = gzip.compress(inner, compresslevel=9)
    assert len(bomb) < 64 * 1024  # small on the wire
    with raw_server(answering(bomb, "gzip, gzip")) as url, httpx.Client() as client:
        tracemalloc.start()
        try:
            with pytest.raises(InputError, match="inflates to more than 1 MiB"):
                get_bounded(client, url, field="--url", max_bytes=MiB, timeout_s=10.0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 8 * MiB  # httpx's own decoder inflates the whole inner layer at once: 64 MiB


@pytest.mark.parametrize(("encoding", "encode"), [
    ("gzip", gzip.compress), ("gzip, gzip", lambda data: gzip.compress(gzip.compress(data))), ("deflate", zlib.compress),
    ("deflate", lambda data: zlib.compress(data)[2:-4]), ("identity", lambda data: data),
])
def test_encoded_answers_within_the_bound_are_read(encoding, encode):
    body = b"vllm:num_requests_running 1.0\n" * 100
    with raw_server(answering(encode(body), encoding)) as url, httpx.Client() as client:
        assert get_bounded(client, url, field="--url", max_bytes=MiB, timeout_s=5.0) == body


@pytest.mark.parametrize(("encoding", "message"), [("br", "Content-Encoding 'br'"), ("gzip, " * 5 + "gzip", "encoded 6 times over")])
def test_encodings_not_read_are_one_line(encoding, message):
    with raw_server(answering(b"x", encoding)) as url, httpx.Client() as client, pytest.raises(InputError, match=message):
        get_bounded(client, url, field="--url", max_bytes=MiB, timeout_s=5.0)


def test_a_failure_names_the_url_without_its_password():
    with raw_server(trickle) as url, httpx.Client() as client:
        secret = url.replace("http://", "http://admin:hunter2@")
        with pytest.raises(InputError) as error:
            get_bounded(client, secret, field="--prometheus", max_bytes=MiB, timeout_s=0.5)
    assert "hunter2" not in str(error.value) and "admin" not in str(error.value) and "***@127.0.0.1" in str(error.value)


@pytest.mark.parametrize(("url", "shown"), [
    ("http://u:p@host:9090/x?q=1", "http://***@host:9090/x?q=1"), ("https://token@host/", "https://***@host/"),
    ("http://host:80/metrics", "http://host:80/metrics"), ("not a url", "not a url"),
    ("http://u:p@ss@host/x", "http://***@host/x"), ("postgresql:///db?password=pw&sslmode=off", "postgresql:///db?password=***&sslmode=off"),
])
def test_without_credentials(url, shown):
    assert without_credentials(url) == shown


@pytest.mark.parametrize("host", ["a..b", "xn--", "a" * 300 + ".com"])
def test_a_host_no_resolver_takes_is_one_line(host):
    with httpx.Client() as client, pytest.raises(InputError, match="not a valid URL|not a name a resolver takes"):
        get_bounded(client, f"http://{host}/metrics", field="--url", max_bytes=MiB, timeout_s=2.0)
