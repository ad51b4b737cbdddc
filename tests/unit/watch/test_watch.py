"""`quantize watch`: live windows of a vLLM /metrics page (a fake server over real HTTP on loopback, pages in vLLM 0.32's
format: tests/unit/metrics_pages.py), judged against a promoted version's envelope (the product's own promotion with vLLM,
lm-eval and vLLM bench serve faked: tests/unit/test_loadtest_runner.py); rollback after a sustained breach; hostile pages and
servers; the Prometheus reader's refusals; the figures' arithmetic; the recommendations.

The real thing (a vLLM CPU server under load, a real Prometheus, an induced breach) is tests/integration/test_watch_e2e.py."""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path

import pytest
from metrics_pages import State, live, page, send, serving
from test_loadtest_runner import gate, servers, tool  # noqa: F401 (fixtures)

from pipelines.cli import main
from pipelines.deploy.spec import served_spec
from pipelines.registry.evidence import EVIDENCE_DIR
from pipelines.registry.store import NewVersion, Registry
from pipelines.watch.exposition import parse_page
from pipelines.watch.figures import histogram_quantile, window_figures
from pipelines.watch.recommend import recommendations
from pipelines.watch.series import Histogram, KvCacheInfo, WindowData

MODEL = "demo-llama"
FAST = ["--window", "1s", "--sample-every", "0.25s"]


def watch(*args: str) -> int:
    return main(["watch", *args])


def busy(state: State, reads: int) -> None:
    state.serve(4, ttft=0.03, itl=0.02)
    state.running, state.kv_usage = 4.0, 0.2


def preempting(state: State, reads: int) -> None:
    state.serve(4, ttft=0.03, itl=0.02)
    state.preemptions += 3
    state.running, state.waiting, state.kv_usage, state.num_blocks = 2.0, 30.0, 0.99, 8


def promoted_versions(workspace, count: int) -> list[int]:
    """`count` promoted, signed versions of the same artifact (each gate run is new evidence), alias production on each in turn."""
    registry = Registry(workspace.registry)
    numbers: list[int] = []
    while len(numbers) < count:
        assert gate(workspace).verdict == "promoted"
        newest = registry.list(MODEL)[-1].version
        if newest not in numbers:
            numbers.append(newest)
            registry.set_alias(MODEL, "production", newest)
        else:
            time.sleep(0.3)  # gate.json's created_at has seconds: the same second is the same evidence
    return numbers


# --- live windows ------------------------------------------------------------------------------------


def test_without_a_version_the_figures_alone_exit_0(tmp_path, capsys):
    with serving(live(State(), busy)) as server:
        assert watch("--url", server.url, *FAST, "--windows", "2", "--out", str(tmp_path / "w"), "--json") == 0
    document = json.loads(capsys.readouterr().out)
    assert document["verdict"] == "figures only" and len(document["windows"]) == 2 and document["limits"] == []
    for key in ("ttft_p95_s", "itl_p95_s", "e2e_p95_s", "kv_cache_usage", "preemptions", "error_rate", "generation_tokens_per_s",
                "prefix_cache_hit_rate", "running_mean", "waiting_p95", "batch_tokens_p50", "memory_bytes"):
        assert key in document, key
    assert 0.02 < document["ttft_p95_s"] <= 0.04, "the 40 ms bucket holds every TTFT of 30 ms"
    assert document["error_rate"] == 0 and document["preemptions"] == 0 and document["kv_cache_usage"] == pytest.approx(0.2)
    assert document["requests"] >= 8 and (tmp_path / "w" / "watch.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "w" / "watch.json").read_text())["windows"] == document["windows"]


def test_within_the_envelope_exit_0_with_a_planner_checked_recommendation(tool, servers, workspace, tmp_path, capsys):
    promoted_versions(workspace, 1)
    with serving(live(State(), busy)) as server:
        code = watch("--url", server.url, "--version", f"{MODEL}@production", *FAST, "--windows", "2", "--registry", str(workspace.registry),
                     "--out", str(tmp_path / "w"), "--json")
    document = json.loads(capsys.readouterr().out)
    assert code == 0, document["windows"]
    assert document["verdict"] == "within" and document["breached_windows"] == []
    verdicts = {v["figure"]: v for v in document["overall"]["verdicts"]}
    assert verdicts["ttft_p95_s"]["verdict"] == "within" and verdicts["ttft_p95_s"]["limit"] == pytest.approx(0.2384761, rel=1e-3)
    assert verdicts["preemptions"]["verdict"] == "within" and "load test TTFT p95" in verdicts["ttft_p95_s"]["source"]
    (found,) = document["recommendations"]
    assert found["kind"] in ("kv_headroom", "longer_max_model_len") and found["planner"]["fits"]
    assert found["evidence"]["window"] in (1, 2) and found["evidence"]["figures"]["kv_cache_usage"] == pytest.approx(0.2)


def test_a_sustained_breach_rolls_the_alias_back_to_the_previous_verified_version(tool, servers, workspace, tmp_path, capsys):
    first, second, third = promoted_versions(workspace, 3)
    bundle = workspace.registry.parent / "promoted" / MODEL / f"v{second}" / EVIDENCE_DIR / "gate.json"
    bundle.write_text(bundle.read_text().replace('"promoted"', '"promoted" ', 1))  # v2's signed evidence no longer matches
    capsys.readouterr()
    with serving(live(State(), preempting)) as server:
        code = watch("--url", server.url, "--version", f"{MODEL}@production", *FAST, "--windows", "4", "--rollback-after", "2",
                     "--registry", str(workspace.registry), "--out", str(tmp_path / "w"), "--json")
    document = json.loads(capsys.readouterr().out)
    assert code == 1 and document["verdict"] == "breach"
    assert len(document["windows"]) == 2, "the watch stops once it has rolled back"
    rollback = document["rollback"]
    assert rollback["moved"] and rollback["from_version"] == third and rollback["to_version"] == first
    why = rollback["skipped"][0]["why"]
    assert rollback["skipped"][0]["version"] == second and ("differs from what was signed" in why or "bytes were signed (tampered" in why), why
    registry = Registry(workspace.registry)
    assert registry.show(MODEL, "production").version == first
    event = registry.history(MODEL, alias="production")[-1]
    assert event.kind == "alias_rollback" and event.from_version == third and event.to_version == first
    assert [w["index"] for w in event.evidence["breached_windows"]] == [1, 2]
    assert set(event.evidence["breached_windows"][0]["breached"]) >= {"preemptions", "kv_cache_usage", "waiting_p95"}
    assert "quantize watch: 2 consecutive window(s)" in event.reason
    kinds = {item["kind"] for item in document["recommendations"]}
    assert "lower_max_num_seqs" in kinds, document["recommendations"]


def test_a_rollback_never_moves_to_an_unsigned_version(tool, servers, workspace, tmp_path, capsys):
    (signed,) = promoted_versions(workspace, 1)
    registry = Registry(workspace.registry)
    original = registry.show(MODEL, signed)
    gate_copy = tmp_path / "run" / "gate.json"
    gate_copy.parent.mkdir()
    gate_copy.write_text(Path(original.gate_path).read_text().replace('"created_at": "', '"created_at": "1', 1))
    unsigned = registry.register(NewVersion(source_model=MODEL, source_hash=original.source_hash, artifact_path=Path(original.artifact_path),
                                            recipe_name="w8a8", recipe_hash=original.recipe_hash, gate_path=gate_copy))
    # A registry written before signing existed: the row says promoted, no bundle or signature (the one door, promote_signed,
    # cannot make one now, so the old state is written as it was).
    registry._set_status(unsigned.id, "promoted", "promoted by hand before signing existed", None)
    registry.set_alias(MODEL, "production", unsigned.version)
    (newest,) = promoted_versions(workspace, 1)
    capsys.readouterr()
    with serving(live(State(), preempting)) as server:
        code = watch("--url", server.url, "--version", f"{MODEL}@production", *FAST, "--rollback-after", "1",
                     "--registry", str(workspace.registry), "--out", str(tmp_path / "w"), "--json")
    rollback = json.loads(capsys.readouterr().out)["rollback"]
    assert code == 1 and rollback["to_version"] == signed and rollback["from_version"] == newest
    assert rollback["skipped"] == [{"version": unsigned.version, "why": rollback["skipped"][0]["why"]}]
    assert "no signed promotion bundle" in rollback["skipped"][0]["why"]


def test_with_nothing_to_roll_back_to_the_alias_stays_and_says_why(tool, servers, workspace, tmp_path, capsys):
    (only,) = promoted_versions(workspace, 1)
    capsys.readouterr()
    with serving(live(State(), preempting)) as server:
        code = watch("--url", server.url, "--version", f"{MODEL}@production", *FAST, "--rollback-after", "1",
                     "--registry", str(workspace.registry), "--out", str(tmp_path / "w"), "--json")
    rollback = json.loads(capsys.readouterr().out)["rollback"]
    assert code == 1 and not rollback["moved"] and "no earlier version verifies" in rollback["reason"]
    assert Registry(workspace.registry).show(MODEL, "production").version == only


def test_a_version_without_a_load_test_is_named_and_refused_for_watching(tool, servers, workspace, tmp_path, capsys):
    assert gate(workspace, loadtest=False).verdict == "promoted"
    capsys.readouterr()
    with serving(live(State(), busy)) as server:
        assert watch("--url", server.url, "--version", MODEL, *FAST, "--registry", str(workspace.registry)) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "demo-llama v1 was promoted without a load test" in error


@pytest.mark.parametrize("args, message", [
    (["--rollback-after", "1", "--version", "demo-llama@3"], "needs --version NAME@ALIAS"),
    (["--rollback-after", "1"], "needs --version NAME@ALIAS"),
    (["--rollback-after", "3", "--version", "demo-llama@production", "--windows", "2"], "cannot breach in 2"),
    (["--window", "0"], "must be a duration"), (["--window", "inf"], "must be a duration"), (["--windows", "0"], "integer from 1"),
    (["--sample-every", "10s", "--window", "5s"], "samples every 10 s"), (["--shadow", "x.jsonl"], "needs --version"),
])
def test_options_that_cannot_work_are_refused_before_watching(args, message, capsys):
    assert watch("--url", "http://127.0.0.1:9/metrics", *args) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


# --- hostile pages and servers -----------------------------------------------------------------------


def _page_with(transform) -> callable:
    def respond(handler) -> None:
        state = State()
        state.serve(3, ttft=0.03, itl=0.02)
        body = transform(page(state))
        send(handler, body.encode() if isinstance(body, str) else body)

    return respond


def _changing(first_state, later_state) -> callable:
    reads = [0]

    def respond(handler) -> None:
        reads[0] += 1
        send(handler, page(first_state if reads[0] == 1 else later_state).encode())

    return respond


def _reset_states() -> tuple[State, State]:
    before, after = State(), State()
    before.serve(10, ttft=0.03, itl=0.02)
    after.serve(2, ttft=0.03, itl=0.02)
    return before, after


def _restarted_states() -> tuple[State, State]:
    before, after = State(), State()
    before.serve(2, ttft=0.03, itl=0.02)
    after.serve(4, ttft=0.03, itl=0.02)
    after.started += 60
    return before, after


HOSTILE = {
    "nan counter": (_page_with(lambda text: text.replace("vllm:num_preemptions_total{engine=\"0\",model_name=\"demo-llama\"} 0.0",
                                                         "vllm:num_preemptions_total{engine=\"0\",model_name=\"demo-llama\"} NaN")),
                    "vllm:num_preemptions_total{engine=\"0\",model_name=\"demo-llama\"} is nan"),
    "negative counter": (_page_with(lambda text: text + 'vllm:generation_tokens_total{engine="1"} -5\n'), "a counter cannot be negative"),
    "infinite gauge": (_page_with(lambda text: text + 'vllm:kv_cache_usage_perc{engine="1"} +Inf\n'), "is inf: not a measurement"),
    "huge label value": (_page_with(lambda text: text + 'vllm:num_requests_running{x="' + "a" * 100_000 + '"} 1\n'),
                         "characters long (at most 65536)"),
    "millions of series": (_page_with(lambda text: text + "".join(f'vllm:num_requests_waiting{{id="{i}"}} 0\n' for i in range(100_001))),
                           "more than 100000 series"),
    "not vLLM": (_page_with(lambda text: "<html><body>hello</body></html>\n"), "not a vLLM server's /metrics page"),
    "disable-log-stats page": (_page_with(lambda text: "\n".join(line for line in text.splitlines() if not line.startswith("vllm:"))),
                               "--disable-log-stats exports none"),
    "truncated line": (_page_with(lambda text: text + 'vllm:kv_cache_usage_perc{engine="0",model_name="x'), "malformed metrics exposition"),
    "not cumulative": (_page_with(lambda text: text.replace('vllm:time_to_first_token_seconds_bucket{engine="0",model_name="demo-llama",'
                                                            'le="+Inf"} 3.0', 'vllm:time_to_first_token_seconds_bucket{engine="0",'
                                                            'model_name="demo-llama",le="+Inf"} 1.0')), "are not cumulative"),
    "not utf-8": (_page_with(lambda text: text.encode() + b"vllm:x\xff 1\n"), "not UTF-8"),
    "http 500": (lambda handler: send(handler, b"boom", status=500), "answered HTTP 500"),
    "counter reset": (_changing(*_reset_states()), "went down from"),
    "restart": (_changing(*_restarted_states()), "the server restarted during window 1"),
    "slow": (lambda handler: send(handler, b"vllm:x 1\n", delay_s=4), "no answer within 1 s"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_pages_and_servers_are_one_line_exit_2(name, tmp_path, capsys):
    respond, message = HOSTILE[name]
    started = time.monotonic()
    with serving(respond) as server:  # a page of 100,000 series takes seconds to make and read on a busy machine
        code = watch("--url", server.url, *FAST, "--timeout", "1s" if name == "slow" else "15s", "--out", str(tmp_path / "w"), "--json")
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert json.loads(captured.out)["exit_code"] == 2 and time.monotonic() - started < 40
    assert not (tmp_path / "w").exists(), "nothing is written for a session that failed"


def test_a_page_that_never_ends_is_cut_off_by_size_and_a_trickle_by_time(tmp_path, capsys):
    def endless(handler) -> None:
        handler.send_response(200)
        handler.end_headers()
        chunk = b"# " + b"x" * 60_000 + b"\n"
        try:
            for _ in range(2_000):  # 120 MB
                handler.wfile.write(chunk)
        except OSError:
            pass

    def trickle(handler) -> None:
        handler.send_response(200)
        handler.end_headers()
        try:
            for _ in range(100):
                handler.wfile.write(b"# x\n")
                handler.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    for respond, timeout, message in ((endless, "60s", "larger than 32 MiB"), (trickle, "1s", "took longer than 1 s")):
        with serving(respond) as server:
            assert watch("--url", server.url, *FAST, "--timeout", timeout, "--out", str(tmp_path / "w")) == 2
        assert message in capsys.readouterr().err


def test_an_unreachable_url_is_one_line(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    assert watch("--url", f"http://127.0.0.1:{port}/metrics", *FAST) == 2
    error = capsys.readouterr().err
    assert "unreachable (ConnectError" in error and error.count("\n") == 1


# --- the Prometheus reader's refusals -------------------------------------------------------------------


def _prometheus(answer: bytes, delay_s: float = 0.0, status: int = 200):
    return lambda handler: send(handler, answer, status=status, delay_s=delay_s)


@pytest.mark.parametrize("respond, message", [
    (_prometheus(b'{"status":"success","data":{"resultType":"vector","result":[]}}'), "holds no vllm:* series with instance='127.0.0.1:8000'"),
    (_prometheus(b"not json"), "not JSON"),
    (_prometheus(b'{"status":"error","error":"parse error"}'), "parse error"),
    (_prometheus(b'{"status":"error","error":"bad"}', status=400), "answered HTTP 400"),
    (_prometheus(b"{}", delay_s=4), "no answer within 1 s"),
    (_prometheus(b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1,"NaN"]}]}}'),
     "not a finite non-negative number"),
])
def test_prometheus_that_cannot_answer_is_one_line_exit_2(respond, message, capsys):
    with serving(respond) as prometheus:
        base = prometheus.url.removesuffix("/metrics")
        assert watch("--url", "http://127.0.0.1:8000/metrics", "--prometheus", base, "--window", "1m", "--timeout", "1s") == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


# --- arithmetic ----------------------------------------------------------------------------------------


def test_histogram_quantile_interpolates_as_prometheus_does():
    histogram = Histogram(buckets=[(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (None, 40.0)], sum=0, count=40)
    assert histogram_quantile(0.25, histogram) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert histogram_quantile(0.5, histogram) == pytest.approx(0.1 + 0.4 * 10 / 20)  # rank 20, halfway through (0.1, 0.5]
    assert histogram_quantile(0.95, histogram) == pytest.approx(0.5 + 0.5 * 8 / 10)
    overflow = Histogram(buckets=[(0.1, 1.0), (None, 10.0)], sum=0, count=10)
    assert histogram_quantile(0.99, overflow) == 0.1, "a rank in +Inf reports the largest finite bound"
    assert histogram_quantile(0.5, Histogram(buckets=[(0.1, 0.0), (None, 0.0)], sum=0, count=0)) is None


def test_error_rate_is_the_larger_of_the_engines_and_the_http_layers():
    state = State()
    state.serve(90, ttft=0.03, itl=0.02)
    state.serve(10, ttft=0.03, itl=0.02, reason="abort")
    state.http["5xx"] += 2
    before = parse_page(page(State()).encode(), "x", 0.0)
    after = parse_page(page(state).encode(), "x", 10.0)
    from pipelines.watch.exposition import window_between

    figures = window_figures(window_between(1, before, after, [after], "x"))
    assert figures.aborts == 10 and figures.error_rate == pytest.approx(0.1) and figures.requests == 100
    assert figures.http_5xx == 2, "the /metrics handler's own reads are not requests"


def _figures(before: State, after: State):
    from pipelines.watch.exposition import window_between

    first, last = parse_page(page(before).encode(), "x", 0.0), parse_page(page(after).encode(), "x", 10.0)
    return window_figures(window_between(1, first, last, [last], "x"))


def test_admission_rejections_are_overload_not_errors_as_in_the_deployed_error_slo():
    state = State()
    state.serve(90, ttft=0.03, itl=0.02)
    state.reject(30)  # answered 503 by vLLM's queue limit
    figures = _figures(State(), state)
    assert figures.http_5xx == 30 and figures.admission_rejections == 30 and figures.error_rate == 0
    state.http["5xx"] += 6  # six failures beside the rejections: 6 of the 96 admitted
    assert _figures(State(), state).error_rate == pytest.approx(6 / 96)


def test_a_corrupted_request_breaches_its_window(tmp_path):
    from pipelines.deploy.limits import FigureLimit
    from pipelines.watch.verdict import judge

    before, after = State(corrupted=0.0), State(corrupted=1.0)
    after.serve(10, ttft=0.03, itl=0.02)
    held = [FigureLimit(figure="corrupted_requests", limit=0.0, source="any")]
    assert [v.verdict for v in judge(_figures(before, after), held)] == ["breach"]
    assert [v.verdict for v in judge(_figures(before, before), held)] == ["within"]
    assert _figures(State(), State()).corrupted_requests == 0, "a server without the NaN check: no series, nothing counted"


def _window(index: int, **figures) -> tuple[int, float, float, object]:
    base = {"requests": 10.0, "requests_per_s": 1.0, "generation_tokens_per_s": 10.0, "prompt_tokens_per_s": 10.0, "errors": 0.0,
            "aborts": 0.0, "http_5xx": 0.0, "preemptions": 0.0, "kv_cache_usage": 0.2, "running_max": 4.0, "waiting_p95": 0.0,
            "waiting_max": 0.0}
    from pipelines.watch.figures import Figures

    return (index, 100.0 * index, 100.0 * index + 100, Figures(**{**base, **figures}))


def test_recommendations_cite_their_window_and_the_planners_check(tool, servers, workspace):
    promoted_versions(workspace, 1)
    spec = served_spec(f"{MODEL}@production", registry=Registry(workspace.registry))
    pressed = KvCacheInfo(block_size=128, num_blocks=8, size_tokens=1024, max_concurrency=2.0)
    found, _ = recommendations(spec, [_window(1), _window(2, preemptions=7.0, kv_cache_usage=0.99, waiting_p95=12.0)], pressed)
    by_kind = {item.kind: item for item in found}
    assert by_kind["lower_max_num_seqs"].arguments == {"max_num_seqs": 2} and by_kind["lower_max_num_seqs"].evidence.window == 2
    assert by_kind["more_kv_space"].arguments == {"VLLM_CPU_KVCACHE_SPACE": 1} and by_kind["more_kv_space"].planner.fits
    assert "8 blocks of 128 tokens" in by_kind["lower_max_num_seqs"].text
    queued, _ = recommendations(spec, [_window(3, waiting_p95=5.0, running_max=16.0, kv_cache_usage=0.1)])
    assert queued[0].kind == "higher_max_num_seqs" and queued[0].arguments == {"max_num_seqs": 32} and queued[0].planner.fits
    idle, _ = recommendations(spec, [_window(4, kv_cache_usage=0.01)])
    assert idle[0].evidence.window == 4 and idle[0].planner.fits and idle[0].kind in ("kv_headroom", "longer_max_model_len")
    nothing, notes = recommendations(spec, [_window(5, requests=0.0, running_max=0.0)])
    assert nothing == [] and "no window served" in notes[0]


def test_the_merged_windows_add_counters_and_buckets():
    from pipelines.watch.series import merged

    one = WindowData(index=1, start=0, end=10, counters={"preemptions": 2.0},
                     histograms={"ttft": Histogram(buckets=[(0.1, 1.0), (None, 2.0)], sum=1.0, count=2.0)}, gauges={"waiting": [(5, 1.0)]})
    two = WindowData(index=2, start=10, end=20, counters={"preemptions": 3.0},
                     histograms={"ttft": Histogram(buckets=[(0.1, 0.0), (None, 1.0)], sum=2.0, count=1.0)}, gauges={"waiting": [(15, 3.0)]})
    both = merged([one, two])
    assert both.counters == {"preemptions": 5.0} and both.histograms["ttft"].buckets == [(0.1, 1.0), (None, 3.0)]
    assert both.start == 0 and both.end == 20 and both.gauges["waiting"] == [(5, 1.0), (15, 3.0)]
    assert not math.isnan(window_figures(both).waiting_mean or math.nan)


# --- the shadow replay's reading and statistics ------------------------------------------------------------


@pytest.mark.parametrize("line, message", [
    ('{"expected": "x"}', "line 1: prompt: Field required"), ('{"prompt": ""}', "line 1: prompt"),
    ('{"prompt": "a", "expected": 3}', "line 1: expected"), ('{"prompt": "a", "stop": ["", "b"]}', "line 1: stop.0"),
    ('{"prompt": "a", "colour": "red"}', "line 1: colour: unknown key"), ("[1, 2]", "expected a JSON object"),
])
def test_a_bad_shadow_sample_is_refused_before_watching(line, message, tmp_path, capsys):
    sample = tmp_path / "sample.jsonl"
    sample.write_text(line + "\n")
    assert watch("--url", "http://127.0.0.1:9/metrics", "--version", "demo-llama@production", "--shadow", str(sample)) == 2
    error = capsys.readouterr().err
    assert message in error and "sample.jsonl" in error and error.count("\n") == 1


def test_shadow_statistics_speak_the_gates_language(tool, servers, workspace, tmp_path):
    from pipelines.watch.shadow import paired_statistics

    assert gate(workspace).verdict == "promoted"
    report = Registry(workspace.registry).list(MODEL)[-1].gate
    n = 250
    prompts = [f"q{i}" for i in range(n)]
    expected = ["right"] * n
    baseline = ["right"] * n
    deployed = ["right"] * (n - 5) + ["wrong"] * 5
    result = paired_statistics(report, prompts, expected, baseline, deployed, [0.01] * n, tmp_path / "s.jsonl")
    assert result["disagreements"] == 5 and result["flips_right_to_wrong"] == 5 and result["flips_wrong_to_right"] == 0
    assert 0.02 < result["disagreement_upper_bound"] < 0.05 and result["worsening_bound_points"] > 2.0
    assert result["non_inferiority_shown"] is True and result["kl_mean"] == pytest.approx(0.01)
    assert "at 95% confidence the deployed version changes at most" in result["lines"][0]
    assert "(95% one-sided bound): within ni_margin 5.5 (non-inferiority shown)" in result["lines"][1]
    unlabelled = paired_statistics(report, prompts[:10], [None] * 10, baseline[:10], baseline[:10], [None] * 10, tmp_path / "s.jsonl")
    assert unlabelled["agreement"] == 1.0 and "labelled" not in unlabelled and unlabelled["kl_mean"] is None


def test_a_server_of_another_model_is_not_held_to_this_versions_envelope(tool, servers, workspace, tmp_path, capsys):
    promoted_versions(workspace, 1)
    capsys.readouterr()
    with serving(live(State(), busy)) as server:
        code = watch("--url", server.url, "--version", f"{MODEL}@production", "--served-name", "other", *FAST,
                     "--registry", str(workspace.registry), "--out", str(tmp_path / "w"))
    error = capsys.readouterr().err
    errors = [line for line in error.splitlines() if line.startswith("quantize: error")]
    assert code == 2 and len(errors) == 1 and "the server serves 'demo-llama', not 'other'" in errors[0]
