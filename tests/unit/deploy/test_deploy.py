"""`quantize deploy NAME@ALIAS --out DIR`: the files of a promoted, verified version, checked by Prometheus' own promtool.

The version is the product's own promotion with vLLM, lm-eval and vLLM bench serve faked (tests/unit/test_loadtest_runner.py);
promtool is Debian's (scripts/setup_system.sh installs it)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_loadtest_runner import gate, servers, tool  # noqa: F401 (fixtures)

from pipelines.cli import main
from pipelines.deploy.files import dashboard_expressions
from pipelines.paths import REPO_ROOT
from pipelines.registry.store import Registry
from pipelines.serve.vllm_series import FIRST_LATENCY_BUCKET_S, LATENCY_BUCKETS_S

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def promoted(workspace, *, loadtest: bool = True) -> int:
    assert gate(workspace, loadtest=loadtest).verdict == "promoted"
    registry = Registry(workspace.registry)
    version = registry.list("demo-llama")[-1].version
    registry.set_alias("demo-llama", "production", version)
    return version


def deploy(workspace, out: Path, *extra: str) -> int:
    return main(["deploy", "demo-llama@production", "--out", str(out), "--registry", str(workspace.registry), *extra])


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_deploy_writes_files_promtool_accepts_with_limits_from_the_load_test(tool, servers, workspace, tmp_path, capsys):
    version = promoted(workspace)
    out = tmp_path / "deploy"
    assert deploy(workspace, out, "--json", "--window", "2m", "--alert-for", "0s", "--metrics-target", "127.0.0.1:9000") == 0
    result = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["alert-rules.test.yml", "alert-rules.yml", "grafana-dashboard.json", "prometheus.yml",
                                                     "serve.sh", "spec.json"]
    checked = promtool("check", "config", str(out / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout and "alert-rules.yml" in checked.stdout
    rules = yaml.safe_load((out / "alert-rules.yml").read_text())["groups"][0]["rules"]
    by_figure = {rule["labels"]["figure"]: rule for rule in rules if ("alert" in rule and rule["labels"]["severity"] != "page")
                 or rule.get("alert") in ("VllmTargetDown", "VllmCorruptedRequests")}
    assert set(by_figure) == {"ttft_p95_s", "itl_p95_s", "error_rate", "kv_cache_usage", "preemptions", "waiting_p95", "memory_bytes", "up",
                              "corrupted_requests", "admission_rejections"}
    candidate = Registry(workspace.registry).show("demo-llama", version).gate.performance.figures("candidate")
    ttft = candidate.at(16).ttft_ms.p95
    held = max(min(2.0, ttft * 1.5 / 1000), FIRST_LATENCY_BUCKET_S["ttft"])  # not below vLLM's first TTFT bucket bound
    bound = min(b for b in LATENCY_BUCKETS_S["ttft"] if b >= held)  # the share over the limit is counted at this bucket bound
    records = {rule["record"]: rule["expr"] for rule in rules if "record" in rule}
    assert f'le=~"{bound!r}' in records["quantgate:ttft_over_limit:ratio_rate1h"].replace("\\", "")
    assert "quantgate:ttft_over_limit:ratio_rate3d" in by_figure["ttft_p95_s"]["expr"]  # the ticket; the page holds the 1 h window
    page = next(rule for rule in rules if rule.get("alert") == "VllmTtftBudgetBurn" and rule["labels"]["severity"] == "page")
    assert "quantgate:ttft_over_limit:ratio_rate1h" in page["expr"] and "(14.4 * 0.05)" in page["expr"]
    assert "[2m]" in by_figure["preemptions"]["expr"] and by_figure["preemptions"]["for"] == "0s"
    assert by_figure["waiting_p95"]["expr"].endswith("> 16") and "measured max_num_seqs" in by_figure["waiting_p95"]["annotations"]["description"]
    assert by_figure["memory_bytes"]["expr"].endswith(f"> {float(int(candidate.peak_memory_bytes * 1.5)):g}")
    script = (out / "serve.sh").read_text()
    assert "export VLLM_CPU_KVCACHE_SPACE=1" in script and "export VLLM_COMPUTE_NANS_IN_LOGITS=1" in script
    assert "--max-num-seqs 16" in script and "--max-model-len 512" in script
    assert f"/promoted/demo-llama/v{version}" in script and "--served-model-name demo-llama" in script
    assert "--disable-log-stats" not in script.split("exec ")[1]
    assert (out / "serve.sh").stat().st_mode & 0o100
    syntax = subprocess.run(["sh", "-n", str(out / "serve.sh")], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    config = yaml.safe_load((out / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9000"]
    assert result["vllm_args"][result["vllm_args"].index("--max-num-seqs") + 1] == "16"


def test_every_dashboard_expression_is_promql_prometheus_parses(tool, servers, workspace, tmp_path):
    promoted(workspace)
    out = tmp_path / "deploy"
    assert deploy(workspace, out) == 0
    expressions = dashboard_expressions(json.loads((out / "grafana-dashboard.json").read_text()))
    assert len(expressions) >= 12
    recording = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr{i}", "expr": e} for i, e in enumerate(expressions)]}]}
    (tmp_path / "dashboard-rules.yml").write_text(yaml.safe_dump(recording))
    checked = promtool("check", "rules", str(tmp_path / "dashboard-rules.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_version_without_a_load_test_is_named_and_refused(tool, servers, workspace, tmp_path, capsys):
    promoted(workspace, loadtest=False)
    capsys.readouterr()
    assert deploy(workspace, tmp_path / "deploy") == 2
    line = capsys.readouterr().err.strip()
    assert "promoted without a load test" in line and line.count("\n") == 0
    assert not (tmp_path / "deploy").exists()


def test_a_folder_of_other_files_is_never_replaced(tool, servers, workspace, tmp_path, capsys):
    promoted(workspace)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert deploy(workspace, out) == 2
    assert "did not write" in capsys.readouterr().err and (out / "notes.txt").read_text() == "keep me"
    again = tmp_path / "deploy"
    assert deploy(workspace, again) == 0 and deploy(workspace, again) == 0, "an earlier deployment's folder is replaced"


def test_a_folder_an_earlier_deploy_wrote_is_its_own_whatever_its_spec_layout(tmp_path):
    """spec.json is read back only for who wrote it, so a deployment written before the envelope held the load test's
    figures whole (its fields flat) is still replaced by a new `quantize deploy`, never refused as someone else's."""
    from pipelines.deploy.files import SERVE_SCRIPT, SPEC_FILE, WRITTEN_BY, is_deploy_folder

    flat = {"measured_on": "cpu:avx2", "concurrency": 16, "measured_max_num_seqs": 16, "requests": 160, "failed": 0,
            "ttft_ms": {"p50": 210.0, "p95": 407.0, "p99": 420.0}, "kv_capacity_tokens": 524288, "peak_memory_bytes": 2_000_000_000}
    (tmp_path / SPEC_FILE).write_text(json.dumps({"written_by": WRITTEN_BY, "spec": {"envelope": flat}, "limits": []}))
    (tmp_path / SERVE_SCRIPT).write_text("#!/bin/sh\n")
    assert is_deploy_folder(tmp_path)
    (tmp_path / SPEC_FILE).write_text(json.dumps({"written_by": "someone else", "spec": {"envelope": flat}}))
    assert not is_deploy_folder(tmp_path)


@pytest.mark.parametrize("option", [["--window", "0"], ["--window", "nan"], ["--window", "1e999"], ["--scrape-interval", "-5s"],
                                    ["--port", "70000"]])
def test_hostile_options_are_one_line_exit_2(tool, servers, workspace, tmp_path, capsys, option):
    assert deploy(workspace, tmp_path / "deploy", *option) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "deploy").exists()


def rule_test(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, "test", "rules", "alert-rules.test.yml"], cwd=folder, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_burn_rate_rules_fire_on_the_series_that_must_and_hold_on_those_that_must_not(tool, servers, workspace, tmp_path):
    promoted(workspace)
    out = tmp_path / "deploy"
    assert deploy(workspace, out) == 0
    checked = promtool("check", "rules", str(out / "alert-rules.yml"))
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    tested = rule_test(out)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    # The cases can fail: rules without the overload exclusion page on overload alone; a ticket at half the budget's burn fires
    # on errors just under the SLO.
    rules, cases = (out / "alert-rules.yml").read_text(), yaml.safe_load((out / "alert-rules.test.yml").read_text())
    for broken, case, alert in ((rules.replace("vllm:admission_rejections_total{", "vllm:no_such_series{"), "must fire: the overload",
                                 "VllmErrorRateBudgetBurn"),
                                (rules.replace("> (1 * 0.01)", "> (0.5 * 0.01)"), "must not fire: errors just under", "VllmErrorRateBudgetBurn")):
        assert broken != rules
        (out / "alert-rules.yml").write_text(broken)
        subset = {**cases, "tests": [test for test in cases["tests"] if test["name"].startswith(case)]}
        assert len(subset["tests"]) == 1
        (out / "alert-rules.test.yml").write_text(yaml.safe_dump(subset))
        failed = rule_test(out)
        assert failed.returncode == 1 and f"alertname: {alert}" in failed.stdout + failed.stderr, failed.stdout + failed.stderr


@pytest.mark.parametrize(("window", "alert_for"), [("8s", "0s"), pytest.param("2m", "30m", marks=pytest.mark.slow),
                                                   pytest.param("1h", "1m", marks=pytest.mark.slow)])
def test_the_window_timed_cases_hold_for_any_window_and_for(tool, servers, workspace, tmp_path, window, alert_for):
    promoted(workspace)
    out = tmp_path / "deploy"
    assert deploy(workspace, out, "--window", window, "--alert-for", alert_for) == 0
    cases = yaml.safe_load((out / "alert-rules.test.yml").read_text())
    cases["tests"] = [test for test in cases["tests"] if "corrupted" in test["name"] or "overload" in test["name"]]
    assert len(cases["tests"]) == 3
    (out / "alert-rules.test.yml").write_text(yaml.safe_dump(cases))
    tested = rule_test(out)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_the_latency_buckets_are_the_serve_environments_vllm_defaults():
    source = next(REPO_ROOT.glob(".venv-serve/lib/python3*/site-packages/vllm/v1/metrics/buckets.py"), None)
    if source is None:
        pytest.skip("no serve environment (.venv-serve): make setup builds it")
    constants = _tuples(source)
    assert {"ttft": constants["TIME_TO_FIRST_TOKEN_BUCKETS"], "itl": constants["INTER_TOKEN_LATENCY_BUCKETS"],
                                 "e2e": constants["REQUEST_LATENCY_BUCKETS"]} == LATENCY_BUCKETS_S


def _tuples(source: Path) -> dict[str, tuple]:
    """The module-level tuple constants of a Python file (annotated or not)."""
    found = {}
    for node in ast.parse(source.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Tuple):  # type: ignore[union-attr]
            found[target.id] = ast.literal_eval(node.value)  # type: ignore[union-attr]
    return found
