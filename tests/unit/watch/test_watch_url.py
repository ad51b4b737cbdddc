"""`quantize watch --url`: a server's base URL, its OpenAI base URL or its /metrics page (with or without a trailing slash) all
read the metrics page; anything else that is not a metrics page is one line, exit 2. Against a real HTTP server on loopback
that routes as vLLM 0.32 does (/metrics and /metrics/ serve the page: vllm/entrypoints/serve/instrumentator/metrics.py;
every other path answers 404)."""

from __future__ import annotations

import json
import socket

import pytest
from metrics_pages import State, page, send, serving
from test_watch import FAST, busy, watch

from pipelines.errors import InputError
from pipelines.watch.exposition import metrics_url


def vllm_routes(state: State, seen: list[str]):
    def respond(handler) -> None:
        seen.append(handler.path)
        if handler.path in ("/metrics", "/metrics/"):
            busy(state, len(seen))
            send(handler, page(state).encode())
        elif handler.path == "/health":
            send(handler, b"")
        else:
            send(handler, b'{"detail":"Not Found"}', status=404)

    return respond


@pytest.mark.parametrize("suffix", ["", *(pytest.param(suffix, marks=pytest.mark.slow) for suffix in ("/", "/v1/", "/metrics/"))])
def test_the_base_url_and_the_metrics_page_are_both_watched(tmp_path, capsys, suffix):
    seen: list[str] = []
    with serving(vllm_routes(State(), seen)) as server:
        root = server.url.removesuffix("/metrics")
        assert watch("--url", root + suffix, *FAST, "--json", "--out", str(tmp_path / "w")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["url"] == f"{root}/metrics" and set(seen) == {"/metrics"}
    assert report["windows"][0]["figures"]["requests"] > 0


@pytest.mark.parametrize(("suffix", "message"), [
    ("/health", "not a vLLM server's /metrics page"),  # an empty page: no vllm:* series
    ("/v1/models", "answered HTTP 404"),
])
def test_another_page_of_the_server_is_one_line_exit_2(tmp_path, capsys, suffix, message):
    with serving(vllm_routes(State(), [])) as server:
        url = server.url.removesuffix("/metrics") + suffix
        assert watch("--url", url, *FAST, "--out", str(tmp_path / "w")) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and url in error and "--url" in error and message in error


def test_a_page_that_is_not_metrics_is_one_line_exit_2(tmp_path, capsys):
    with serving(lambda handler: send(handler, b"<html><body>hello</body></html>")) as server:
        assert watch("--url", server.url.removesuffix("/metrics"), *FAST, "--out", str(tmp_path / "w")) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--url" in error


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://127.0.0.1:8000/metrics", "http://127.0.0.1:99999", "http:///metrics", "metrics",
                                 "http://[::1/metrics"])
def test_what_is_not_an_http_url_is_refused_before_any_read(tmp_path, capsys, url):
    assert watch("--url", url, *FAST, "--out", str(tmp_path / "w")) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not an http(s) URL" in error and not (tmp_path / "w").exists()


def test_an_unreachable_base_url_names_its_metrics_page(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert watch("--url", f"http://127.0.0.1:{port}", *FAST) == 2
    error = capsys.readouterr().err
    assert f"http://127.0.0.1:{port}/metrics" in error and "unreachable" in error and error.count("\n") == 1


@pytest.mark.parametrize(("given", "read"), [
    ("http://h:8000", "http://h:8000/metrics"), ("https://h/", "https://h/metrics"), ("http://h:8000/v1/", "http://h:8000/metrics"),
    ("http://h:8000/metrics/", "http://h:8000/metrics"), ("http://h:8000/vllm/metrics", "http://h:8000/vllm/metrics"),
    ("http://h:8000/other/", "http://h:8000/other/"), ("http://[::1]:8000?x=1", "http://[::1]:8000/metrics?x=1"),
])
def test_metrics_url(given, read):
    assert metrics_url(given) == read


def test_metrics_url_refusal_names_the_option():
    with pytest.raises(InputError) as raised:
        metrics_url("localhost:8000", field="--url")
    assert raised.value.field == "--url"
