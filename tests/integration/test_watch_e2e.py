"""Watch what you deployed, with real parts: the session's promoted w8a8 version (w8a8_run: signed, with a load-test envelope),
`quantize deploy` files checked by promtool and loaded by a real Prometheus (Debian's, started here on loopback, scraping
the server every second and evaluating the generated alert rules), a real vLLM CPU server started by the product's own
vllm_server with the deployed arguments and statistics on, a bounded load from `vllm bench serve` (the load test's driver),
and an induced breach: the same server's KV cache cut to NUM_BLOCKS blocks (--num-gpu-blocks-override), so long answers at
concurrency preempt. `quantize watch` reports a light window within the envelope, then the breach, and rolls the alias back
to the previous version that verifies; Prometheus' own alert fires; the same windows read back from Prometheus' HTTP API.

The second registry version is the first one's artifact registered again with a re-dated copy of its gate evidence and
promoted (signed) by the product's promotion code: a stand-in for a second gate run, which would cost minutes."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from helpers import QUANTIZE, CommandRun, Workspace

from pipelines.canary.client import API_KEY_ENV
from pipelines.deploy.spec import served_spec
from pipelines.loadtest.bench import BenchDriver, PlannedRun, bench_argv
from pipelines.loadtest.workload import WorkloadItem, write_dataset
from pipelines.paths import REPO_ROOT
from pipelines.registry.promotion import promote_signed
from pipelines.registry.store import EvalSetRef, NewVersion, Registry
from pipelines.serve.serving import free_port, start_process_group, stop_process_group, vllm_server

pytestmark = pytest.mark.integration
MODEL = "demo-llama"
NUM_BLOCKS = 5  # 128-token blocks, one kept by vLLM (its null block): 512 tokens, one max-length request; two 300-token answers preempt
WINDOW = "8s"
SHADOW_ITEMS = 60  # with no flip, 60 items bound the drop at 4.3 points: within the default 5.5 (47 is the least that can)
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def prompts(count: int, output_tokens: int) -> list[WorkloadItem]:
    rows = [json.loads(line) for line in (REPO_ROOT / "eval_sets" / "date_normalisation" / "data.jsonl").read_text().splitlines()[:count]]
    return [WorkloadItem(eval_set="date_normalisation", doc_id=i, prompt=f"Date: {row['written']}\nISO date:", prompt_tokens=12,
                         output_tokens=output_tokens) for i, row in enumerate(rows)]


def answers(count: int) -> list[str]:
    rows = (REPO_ROOT / "eval_sets" / "date_normalisation" / "data.jsonl").read_text().splitlines()[:count]
    return [json.loads(line)["answer"] for line in rows]


def second_version(workspace: Workspace, first) -> int:
    """The first version's artifact registered again with a re-dated copy of its run's evidence, promoted and signed."""
    registry = Registry(workspace.registry_path)
    run_dir = Path(first.gate_path).parent
    copy = run_dir.with_name(run_dir.name + "-regated")
    shutil.copytree(run_dir, copy)
    gate = json.loads((copy / "gate.json").read_text())
    gate["created_at"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    (copy / "gate.json").write_text(json.dumps(gate, indent=2))
    entry = NewVersion(source_model=MODEL, source_hash=first.source_hash, artifact_path=Path(first.artifact_path), recipe_name=first.recipe_name,
                       recipe_hash=first.recipe_hash, eval_sets=[EvalSetRef(name=r.name, hash=r.hash) for r in first.eval_sets],
                       gate_path=copy / "gate.json", reason="re-gated (test stand-in)")
    version = registry.register(entry)
    promote_signed(registry, version, "re-gated", run_dir=copy)
    return version.version


class Load:
    """`vllm bench serve` against the server, in a thread, through the load test's own driver; stopped with the block."""

    def __init__(self, folder: Path, server, items: list[WorkloadItem], concurrency: int, requests: int):
        self.folder, self.server = folder, server
        self.run = PlannedRun(role="candidate", concurrency=concurrency, repeat=0, requests=requests)
        folder.mkdir(parents=True, exist_ok=True)
        self.dataset = write_dataset(items, folder / "dataset.jsonl")
        self.driver = BenchDriver(folder)
        self.error: BaseException | None = None

    def __enter__(self) -> Load:
        self.driver.__enter__()
        argv = bench_argv(self.run, self.server, Path(self.server.model_dir), self.dataset, self.folder, [])

        def drive() -> None:
            try:
                self.driver.run([(self.run, argv)], {"candidate": self.server}, timeout_s=600)
            except BaseException as error:  # stopped on purpose, or a real failure: the test reads it
                self.error = error

        self.thread = threading.Thread(target=drive, daemon=True)
        self.thread.start()
        self._wait_for_traffic()
        return self

    def _wait_for_traffic(self, timeout_s: float = 180) -> None:
        """Until the server has seen this load's first prompt (the driver imports vLLM first: 10-40 s on two cores)."""
        url = self.server.base_url.removesuffix("/v1") + "/metrics"

        def prompt_tokens() -> float:
            lines = httpx.get(url, timeout=10).text.splitlines()
            return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:prompt_tokens_total"))

        before, deadline = prompt_tokens(), time.monotonic() + timeout_s
        while prompt_tokens() <= before:
            if time.monotonic() > deadline or not self.thread.is_alive():
                pytest.fail(f"the load never reached the server: {self.error} ({(self.folder / 'vllm-bench.log').read_text()[-1500:]})")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.driver.__exit__(*exc)
        self.thread.join(timeout=30)


def start_watch(workspace: Workspace, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([str(QUANTIZE), "watch", *args, "--json"], cwd=workspace.root, env={**workspace.env, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# A watch window also waits for its canary probe (up to the probe's 60 s per request on an overloaded server): four windows
# under the induced breach took over 300 s on a 2-core CI host while the other worker started a server (7 December).
WATCH_TIMEOUT_S = 600


def finished(process: subprocess.Popen, argv: str, timeout_s: float = WATCH_TIMEOUT_S) -> CommandRun:
    out, err = process.communicate(timeout=timeout_s)
    return CommandRun(argv=[argv], code=process.returncode, stdout=out, stderr=err, wall_s=0.0, marker="")


@pytest.fixture(scope="module")
def watched(workspace: Workspace, w8a8_run: CommandRun, tmp_path_factory) -> SimpleNamespace:
    assert w8a8_run.code == 0, w8a8_run.describe()
    return scenario(workspace, w8a8_run.json["registry_version"], tmp_path_factory.mktemp("watch"))


def scenario(workspace: Workspace, load_tested: int, folder: Path) -> SimpleNamespace:
    """Everything the tests below read, run once: deploy, Prometheus, the server, the light and heavy loads and their watches.
    `load_tested` is w8a8_run's version (other files promote versions without a load test before this one runs)."""
    registry = Registry(workspace.registry_path)
    first = registry.show(MODEL, load_tested)
    assert first.gate is not None and first.gate.performance is not None, "w8a8_run was load-tested"
    second = second_version(workspace, first)
    registry.set_alias(MODEL, "production", first.version)
    registry.set_alias(MODEL, "production", second)
    port, prometheus_port = free_port(), free_port()
    deploy = workspace.quantize("deploy", f"{MODEL}@production", "--out", str(folder / "deploy"), "--metrics-target", f"127.0.0.1:{port}",
                                "--port", str(port), "--scrape-interval", "1s", "--window", WINDOW, "--alert-for", "0s", "--json")
    assert deploy.code == 0, deploy.describe()
    spec = served_spec(f"{MODEL}@production", registry=registry)
    settings = spec.args.serve_settings().model_copy(update={"num_gpu_blocks_override": NUM_BLOCKS})
    prometheus, watchdog = start_prometheus(folder, prometheus_port)
    try:
        with vllm_server(spec.folder, log_path=folder / "server.log", settings=settings, served_name=spec.served_name, port=port) as server:
            url = f"http://127.0.0.1:{port}"  # the server's base URL: watch reads its /metrics
            common = ["--url", url, "--version", f"{MODEL}@production", "--window", WINDOW, "--sample-every", "0.5s"]
            key = {API_KEY_ENV: server.api_key or ""}  # the canary's requests need the server's key (/metrics does not)
            with Load(folder / "light-load", server, prompts(64, 16), concurrency=1, requests=1000):
                within = finished(start_watch(workspace, *common, "--windows", "1", "--out", str(folder / "light"), env=key), "watch light")
            with Load(folder / "heavy-load", server, prompts(64, 300), concurrency=spec.args.max_num_seqs, requests=1000) as heavy:
                breach = finished(start_watch(workspace, *common, "--windows", "4", "--rollback-after", "2", "--out", str(folder / "breach"),
                                              env=key), "watch breach")
            time.sleep(2)  # one more scrape and rule evaluation after the load
            # read while the breach is recent: the preemption alert resolves once its window no longer holds the load
            alerts = httpx.get(f"http://127.0.0.1:{prometheus_port}/api/v1/alerts", timeout=10).json()
            from_prometheus = workspace.quantize("watch", "--url", f"http://127.0.0.1:{port}/metrics", "--prometheus",
                                                 f"http://127.0.0.1:{prometheus_port}", "--version", f"{MODEL}@{second}", "--window", WINDOW,
                                                 "--windows", "6", "--out", str(folder / "prometheus"), "--json", env=key)
            sample = folder / "sample.jsonl"
            sample.write_text("".join(json.dumps({"prompt": item.prompt, "expected": answer, "stop": ["\n"]}) + "\n"
                                      for item, answer in zip(prompts(SHADOW_ITEMS, 1), answers(SHADOW_ITEMS), strict=True)))
            shadow = workspace.quantize("watch", "--url", url, "--version", f"{MODEL}@production", "--window", "1s", "--shadow", str(sample),
                                        "--out", str(folder / "shadow"), "--json", env=key)
            rules = httpx.get(f"http://127.0.0.1:{prometheus_port}/api/v1/rules", timeout=10).json()
            page = httpx.get(f"{url}/metrics", timeout=10).text
            log = (folder / "server.log").read_text(errors="replace")
    finally:
        stop_process_group(prometheus)
        watchdog.stop()
    return SimpleNamespace(folder=folder, first=first.version, second=second, deploy=deploy, within=within, breach=breach, heavy=heavy,
                           prometheus=from_prometheus, shadow=shadow, alerts=alerts, rules=rules, server_log=log, registry=registry, spec=spec,
                           page=page)


def start_prometheus(folder: Path, port: int):
    process, watchdog = start_process_group(
        [PROMETHEUS, f"--config.file={folder / 'deploy' / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(folder)}, log_path=folder / "prometheus.log")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).status_code == 200:
                return process, watchdog
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.5)
    stop_process_group(process)
    watchdog.stop()
    pytest.fail(f"Prometheus did not start: {(folder / 'prometheus.log').read_text()[-2000:]}")
    raise AssertionError  # pytest.fail does not return


def test_the_deployed_files_pass_promtool_and_carry_the_measured_arguments(watched):
    checked = subprocess.run([PROMTOOL, "check", "config", str(watched.folder / "deploy" / "prometheus.yml")], capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    result = watched.deploy.json
    args = result["vllm_args"]
    assert args[args.index("--max-num-seqs") + 1] == str(watched.spec.args.max_num_seqs)
    assert "measured" in result["sources"]["max_num_seqs"]
    assert result["environment"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_COMPUTE_NANS_IN_LOGITS": "1"}
    groups = watched.rules["data"]["groups"]
    assert [g["name"] for g in groups] == [f"quantgate-{MODEL}-v{watched.second}"] and all(r["health"] == "ok" for r in groups[0]["rules"])


# The demo model's ITL is a few ms, inside vLLM's first ITL bucket (10 ms), the resolution the limit is held at; the window
# runs while another test worker shares the 2 cores. An ITL over its limit by less than this factor is that noise; every
# other figure is held exactly. (CI runs saw ITL p95 9.5 ms against envelope limits of 6-10 ms and of 5 us: the load test's
# client had read the stream in bursts; the limit is now raised to the bucket's bound, pipelines/deploy/limits.py.)
ITL_NOISE = 3.0


def test_a_light_window_is_within_the_envelope(watched):
    run = watched.within
    document = run.json
    verdicts = {v["figure"]: v for v in document["overall"]["verdicts"]}
    breached = {name for name, v in verdicts.items() if v["verdict"] == "breach"}
    itl = verdicts["itl_p95_s"]
    assert breached <= {"itl_p95_s"} and (not breached or itl["value"] < ITL_NOISE * itl["limit"]), run.stderr
    assert run.code == (1 if breached else 0), run.stderr
    assert document["requests"] > 0 and document["preemptions"] == 0
    assert document["generation_tokens_per_s"] > 0, "vLLM's statistics are on: the product's servers export vllm:* series"
    assert all(verdicts[name]["verdict"] == "within" for name in ("ttft_p95_s", "kv_cache_usage", "preemptions")), document["overall"]
    assert document["recommendations"] and all(r["planner"]["fits"] for r in document["recommendations"])
    # The canary: the golden set the gate run fixed on the candidate's server agrees with the deployed bundle's server.
    canary = document["windows"][0]["canary"]
    assert document["canary"]["prompts"] == canary["total"] > 0 and canary["healthy"] and canary["answered"] == canary["total"], canary


def test_the_induced_breach_is_reported_and_rolled_back_to_the_previous_verified_version(watched):
    run = watched.breach
    assert run.code == 1, run.stderr
    document = run.json
    assert document["verdict"] == "breach" and document["breached_windows"][:2] == [1, 2]
    # Preemptions are the proof the cache ran out; the usage gauge is only sampled (every 0.5 s), and with 4 usable blocks
    # (vLLM keeps the fifth as its null block) the peak seen while preempting was 1.0 on cpu:avx2, then 0.75 and 0.0 (31
    # preemptions) in two CI runs on cpu:avx512bf16: it is read, not held to a value.
    assert document["preemptions"] > 0 and document["kv_cache_usage"] is not None
    assert all("preemptions" in w["breached"] for w in document["windows"][:2])
    rollback = document["rollback"]
    assert rollback["moved"] and rollback["from_version"] == watched.second and rollback["to_version"] == watched.first
    assert watched.registry.show(MODEL, "production").version == watched.first
    event = watched.registry.history(MODEL, alias="production")[-1]
    assert event.kind == "alias_rollback" and [w["index"] for w in event.evidence["breached_windows"]] == [1, 2]
    assert event.evidence["breached_windows"][0]["values"]["preemptions"] > 0
    kinds = {r["kind"] for r in document["recommendations"]}
    assert {"more_kv_space", "lower_max_num_seqs"} <= kinds, document["recommendations"]
    assert all(r["planner"]["fits"] and r["evidence"]["window"] in (1, 2) for r in document["recommendations"])
    assert Path(document["plot"]).stat().st_size > 10_000
    assert "BREACH" in run.stderr or "breach" in run.stderr.lower()


def test_prometheus_fired_the_generated_alert_and_serves_the_same_windows(watched):
    firing = {a["labels"]["alertname"] for a in watched.alerts["data"]["alerts"] if a["state"] == "firing"}
    assert "VllmPreemptionsOutsideEnvelope" in firing, watched.alerts
    run = watched.prometheus
    assert run.code == 1, run.describe()
    document = run.json
    assert document["source"] == "prometheus" and document["preemptions"] > 0
    assert any("preemptions" in w["breached"] for w in document["windows"])
    assert document["requests"] > 0 and document["ttft_p95_s"] is not None


def test_the_shadow_replay_pairs_the_deployed_version_with_its_baseline(watched):
    run = watched.shadow
    assert run.code == 0, run.describe()
    shadow = run.json["shadow"]
    assert shadow["prompts"] == SHADOW_ITEMS and shadow["labelled"] == SHADOW_ITEMS
    assert shadow["disagreements"] <= 2 and shadow["non_inferiority_shown"] is not None
    assert shadow["kl_mean"] is not None and shadow["kl_mean"] < 0.1
    assert any("one-sided Clopper-Pearson bound" in line for line in shadow["lines"])
    assert any("(95% one-sided bound)" in line for line in shadow["lines"])


def test_the_server_counts_corrupted_requests_and_no_corruption_alert_fires(watched):
    """The product's servers run with VLLM_COMPUTE_NANS_IN_LOGITS=1: vLLM exports vllm:corrupted_requests_total (0 here), the
    page rule on it stays quiet, and so does the ticket for a server without it."""
    corrupted = [line for line in watched.page.splitlines() if line.startswith("vllm:corrupted_requests_total")]
    assert corrupted and all(float(line.rsplit(" ", 1)[1]) == 0 for line in corrupted), watched.page[:2000]
    active = {alert["labels"]["alertname"] for alert in watched.alerts["data"]["alerts"]}
    assert not active & {"VllmCorruptedRequests", "VllmNanCheckOff"}, watched.alerts
