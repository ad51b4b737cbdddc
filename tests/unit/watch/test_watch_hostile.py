"""`quantize watch` against peers and folders that lie: figures no server can produce make a window invalid (never a breach,
never a rollback); the report's folder and files are never reached through a symbolic link; a URL's credentials are never
printed or saved; a server that trickles its headers or sends a stacked-gzip bomb is one line, exit 2."""

from __future__ import annotations

import gzip
import json
import math
import re
import time

import pytest
from metrics_pages import State, page, send, serving
from test_loadtest_runner import servers, tool  # noqa: F401 (fixtures)
from test_watch import FAST, MODEL, busy, promoted_versions, watch

from pipelines.registry.store import Registry
from pipelines.watch.prometheus import _gauges_by_window, _nearest

TTFT_BUCKET = re.compile(r'(vllm:time_to_first_token_seconds_bucket\{[^}]*le=")([0-9.e+]+)("\}) ([0-9.e+]+)')


def _latencies_of_1e299_s(text: str) -> str:
    """Every TTFT in a bucket of 1e299 s: the finite buckets hold none, a bucket le=1e299 holds them all (still cumulative)."""
    total = re.search(r'vllm:time_to_first_token_seconds_count\{[^}]*\} ([0-9.e+]+)', text).group(1)
    text = TTFT_BUCKET.sub(lambda match: f"{match.group(1)}{match.group(2)}{match.group(3)} 0.0", text)
    infinite = re.search(r'vllm:time_to_first_token_seconds_bucket\{([^}]*)le="\+Inf"\}', text)
    return text.replace(infinite.group(0), f'vllm:time_to_first_token_seconds_bucket{{{infinite.group(1)}le="1e+299"}} {total}\n'
                        + infinite.group(0))


IMPOSSIBLE = {
    "kv usage 7.5": (lambda state: setattr(state, "kv_usage", 7.5), None),
    "kv usage 1e300": (lambda state: setattr(state, "kv_usage", 1e300), None),
    "rss 1e300": (lambda state: setattr(state, "memory", 1e300), None),
    "negative gauge": (lambda state: setattr(state, "waiting", -3.0), None),
    "1e12 preemptions": (lambda state: setattr(state, "preemptions", state.preemptions + 1e12), None),
    "1e299 s latencies": (lambda state: None, _latencies_of_1e299_s),
}


def _impossible(change, transform=None):
    state, reads = State(), [0]

    def respond(handler) -> None:
        reads[0] += 1
        busy(state, reads[0])
        if reads[0] > 1:
            change(state)
        text = page(state)
        send(handler, (transform(text) if transform else text).encode())

    return respond


@pytest.mark.parametrize("name", list(IMPOSSIBLE))
def test_figures_no_server_can_produce_make_the_window_invalid_without_a_breach(name, tmp_path, capsys):
    with serving(_impossible(*IMPOSSIBLE[name])) as server:
        code = watch("--url", server.url, *FAST, "--out", str(tmp_path / "w"), "--json")
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert code == 2 and document["verdict"] == "invalid" and document["invalid_windows"] == [1], captured.err
    (window,) = document["windows"]
    assert window["invalid"] and window["breached"] == [] and "INVALID, not judged" in captured.err


def test_impossible_figures_never_roll_an_alias_back(tool, servers, workspace, tmp_path, capsys):
    _, second = promoted_versions(workspace, 2)
    capsys.readouterr()
    with serving(_impossible(*IMPOSSIBLE["kv usage 7.5"])) as server:
        code = watch("--url", server.url, "--version", f"{MODEL}@production", *FAST, "--rollback-after", "1",
                     "--registry", str(workspace.registry), "--out", str(tmp_path / "w"), "--json")
    document = json.loads(capsys.readouterr().out)
    assert code == 2 and document["rollback"] is None and document["verdict"] == "invalid"
    assert {v["verdict"] for v in document["windows"][0]["verdicts"]} == {"invalid"}
    assert Registry(workspace.registry).show(MODEL, "production").version == second


def test_a_symlinked_out_folder_is_refused_before_watching(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    with serving(lambda handler: send(handler, page(State()).encode())) as server:
        assert watch("--url", server.url, *FAST, "--out", str(tmp_path / "out")) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "symbolic link" in error and "--out" in error and list(elsewhere.iterdir()) == []


def test_watch_png_and_json_replace_a_planted_symlink_instead_of_writing_through_it(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "w"
    out.mkdir()
    for name in ("watch.png", "watch.json"):
        (out / name).symlink_to(victim)
    state = State()
    with serving(lambda handler: (busy(state, 1), send(handler, page(state).encode()))) as server:
        assert watch("--url", server.url, *FAST, "--out", str(out)) == 0
    assert victim.read_text() == "precious\n"
    assert not (out / "watch.png").is_symlink() and (out / "watch.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "watch.json").is_symlink()


def test_credentials_in_the_url_are_neither_printed_nor_saved(tmp_path, capsys):
    state = State()
    with serving(lambda handler: (busy(state, 1), send(handler, page(state).encode()))) as server:
        url = server.url.replace("http://", "http://admin:hunter2@")
        assert watch("--url", url, *FAST, "--out", str(tmp_path / "w"), "--json") == 0
    captured = capsys.readouterr()
    saved = (tmp_path / "w" / "watch.json").read_text()
    for text in (captured.out, captured.err, saved):
        assert "hunter2" not in text and "admin" not in text
    assert json.loads(saved)["url"].startswith("http://***@127.0.0.1:")


def test_a_trickling_server_and_a_gzip_bomb_are_one_line_exit_2(tmp_path, capsys):
    def trickle(handler) -> None:
        try:
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    bomb = gzip.compress(gzip.compress(b"\n" * (40 * 2**20)))

    def stacked_gzip(handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Encoding", "gzip, gzip")
        handler.send_header("Content-Length", str(len(bomb)))
        handler.end_headers()
        handler.wfile.write(bomb)

    for respond, message in ((trickle, "no answer within 1 s"), (stacked_gzip, "inflates to more than 32 MiB")):
        began = time.monotonic()
        with serving(respond) as server:
            assert watch("--url", server.url, *FAST, "--timeout", "1s", "--out", str(tmp_path / "w")) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error
        assert time.monotonic() - began < 10


def _prometheus_answering(range_result: list) -> callable:
    """A Prometheus that holds the target's series and answers every range query with `range_result`."""
    def respond(handler) -> None:
        if handler.path.startswith("/api/v1/query_range"):
            result = range_result
        elif "cache_config_info" in handler.path:
            result = []
        else:
            result = [{"metric": {}, "value": [0, "12"]}]
        send(handler, json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}).encode())

    return respond


@pytest.mark.parametrize(("result", "message"), [
    ([{"metric": {}, "values": [[1, 2, 3]]}], "not [time, value] pairs"),
    ([{"metric": {}, "values": "nope"}], "not [time, value] pairs"),
    ([{"metric": {}, "values": [["soon", "1"]]}], "the time 'soon'"),
    ([{"metric": "le", "values": []}], "labels are not an object"),
])
def test_a_prometheus_answering_malformed_series_is_one_line_exit_2(result, message, capsys):
    with serving(_prometheus_answering(result)) as prometheus:
        base = prometheus.url.removesuffix("/metrics")
        assert watch("--url", "http://127.0.0.1:8000/metrics", "--prometheus", base, "--window", "1m", "--timeout", "5s") == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error


def test_points_are_matched_to_windows_by_arithmetic_one_step_a_point():
    """200,000 points against 10,000 windows (what a 16 MiB answer and --windows 10000 allow): a scan of every window per
    point was 2e9 steps; by arithmetic it is a fraction of a second. Each point lands in the window that holds it."""
    ends = [1000.0 + 60.0 * i for i in range(10_000)]
    began = time.process_time()
    matched = [_nearest(ends, 1000.0 + 3.0 * i, 60.0) for i in range(200_000)]
    assert time.process_time() - began < 5
    assert matched[:3] == [0, 0, 0] and matched[10] == 0 and matched[11] == 1 and matched[20] == 1
    assert _nearest(ends, math.nan, 60.0) is None and _nearest(ends, 1e300, 60.0) is None and _nearest(ends, -1e300, 60.0) is None
    samples = {"waiting": [(1000.0, 1.0), (1000.5, 2.0), (1060.0, 3.0), (1060.0 + 1e-9, 4.0), (940.0, 5.0), (math.inf, 6.0)]}
    by_window = _gauges_by_window(samples, [1000.0, 1060.0, 1120.0], 60.0)
    assert [window["waiting"] for window in by_window] == [[(1000.0, 1.0)], [(1000.5, 2.0), (1060.0, 3.0)], [(1060.0 + 1e-9, 4.0)]]


@pytest.mark.parametrize("option", ["--url", "--prometheus"])
def test_a_100_kb_url_is_refused_in_a_short_line(option, capsys):
    huge = "http://admin:hunter2@127.0.0.1:1/" + "a" * 100_000
    args = ["--url", huge] if option == "--url" else ["--url", "http://127.0.0.1:1/metrics", "--prometheus", huge]
    assert watch(*args, *FAST) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and len(error) < 300 and option in error and "hunter2" not in error, error


def test_a_symlinked_shadow_log_folder_is_refused_before_anything_is_served(tool, servers, workspace, tmp_path, capsys):
    promoted_versions(workspace, 1)
    sample = tmp_path / "sample.jsonl"
    sample.write_text('{"prompt": "a"}\n')
    out, elsewhere = tmp_path / "w", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "shadow").symlink_to(elsewhere)
    capsys.readouterr()
    assert watch("--url", "http://127.0.0.1:9/metrics", "--version", f"{MODEL}@production", "--registry", str(workspace.registry),
                 "--shadow", str(sample), "--out", str(out)) == 2
    error = capsys.readouterr().err
    (line,) = [line for line in error.splitlines() if not line.startswith("> ")]
    assert "symbolic link" in line and "shadow" in line and list(elsewhere.iterdir()) == [], error
