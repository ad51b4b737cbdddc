"""The product's one URL check: what urllib, http.client or httpx would refuse deep in a request is one InputError naming the
option, the URL shown without credentials; a host name that never resolves is inside the request's time bound."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from pipelines.console.urls import MAX_URL_CHARS, checked_store_uri, checked_url
from pipelines.errors import InputError
from pipelines.serve.bounded_http import get_bounded

BAD = {
    "http://127.0.0.1:99999/metrics": "Port out of range",
    "http://[::1/metrics": "Invalid IPv6 URL",
    "http://user:secret@host:port/": "could not be cast",
    "http://host/\nmetrics": "control character (U+000A)",
    "http://host /": "space or control character",
    "ftp://host/": "the scheme is 'ftp'",
    "http:///metrics": "no host",
    "http://host:0/": "port 0",
    "http://" + "a" * 70 + ".example/": "IDNA",
    "http://host/" + "x" * MAX_URL_CHARS: "characters (at most 2048)",
}


@pytest.mark.parametrize("url", list(BAD))
def test_a_url_no_request_could_use_is_one_input_error_naming_the_option(url: str) -> None:
    with pytest.raises(InputError, match="not an http\\(s\\) URL") as caught:
        checked_url(url, "--url")
    assert BAD[url] in caught.value.message and caught.value.field == "--url"
    assert "secret" not in caught.value.one_line() and len(caught.value.one_line()) < 400


def test_a_good_url_is_taken_apart() -> None:
    parts = checked_url("https://user:pw@[::1]:9090/api", "--prometheus")
    assert (parts.hostname, parts.port, parts.path) == ("::1", 9090, "/api")
    assert checked_url("postgresql://db.example/registry", "registry", ("postgresql", "postgres")).hostname == "db.example"


def test_a_resolver_that_hangs_does_not_hang_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = socket.getaddrinfo

    def hanging(host, *args, **kwargs):
        if host == "hangs.example":
            release.wait(30)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    started = time.monotonic()
    try:
        with httpx.Client() as client, pytest.raises(InputError, match="no answer within 1 s") as caught:
            get_bounded(client, "http://user:secret@hangs.example:8000/metrics", field="--url", max_bytes=1024, timeout_s=1.0)
    finally:
        release.set()
    assert time.monotonic() - started < 5 and "secret" not in caught.value.one_line()


@pytest.mark.parametrize("uri", ["http://mlflow:99999", "http://[::1", "sqlite:///a b.db", ""])
def test_an_mlflow_tracking_uri_no_client_could_use_is_refused(uri: str) -> None:
    with pytest.raises(InputError, match="not an http\\(s\\) URL|not a usable URI"):
        checked_store_uri(uri, "--mlflow")
    assert checked_store_uri("sqlite:///artifacts/mlflow.db", "--mlflow") == "sqlite:///artifacts/mlflow.db"


def test_a_postgres_registry_url_urllib_cannot_split_is_one_line_without_its_password() -> None:
    from pipelines.registry.store import Registry

    with pytest.raises(InputError, match="not a PostgreSQL URL") as caught:
        Registry("postgresql://quant:hunter2@[::1/registry").list()
    assert "hunter2" not in caught.value.one_line()
