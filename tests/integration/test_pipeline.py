"""The whole job end to end on the demo model: real llm-compressor, real vLLM (serve environment), real lm-eval.

The commands run once per session (tests/integration/conftest.py) against a temporary artifacts root and
registry; these tests read what they left: exit codes, --json outcomes, gate.json, run folders, registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import NEGATIVE_CONTROL
from vllm_util import complete

from pipelines.evaluation.evalsets import discover_eval_sets
from pipelines.paths import DEMO_MODEL_DIR
from pipelines.serve.serving import RunningServer, vllm_server

pytestmark = pytest.mark.integration

RULES = ("max_abs_drop", "max_rel_drop", "ni_margin", "max_flip_rate", "max_kl", "fit:")


def gate_report(run) -> dict:
    return json.loads(Path(run.json["gate_json"]).read_text())


def test_w8a8_is_promoted_and_registered(workspace, w8a8_run, eval_set_names: list[str], no_process_left):
    assert w8a8_run.code == 0, w8a8_run.describe()
    outcome, report = w8a8_run.json, gate_report(w8a8_run)
    assert outcome["verdict"] == report["gate"]["verdict"] == "promoted"
    assert report["gate"]["reasons"] == []
    assert sorted(s["eval_set"] for s in report["gate"]["sets"]) == sorted(eval_set_names)
    assert all(s["kl_items"] == s["n"] for s in report["gate"]["sets"]), "KL must be measured on every item"
    version = workspace.registry().show(DEMO_MODEL_DIR.name, outcome["registry_version"])
    assert (version.status, version.recipe_name) == ("promoted", "w8a8")
    assert Path(version.gate_path) == Path(outcome["gate_json"]).resolve()
    assert Path(version.artifact_path) == Path(outcome["artifact_dir"]).resolve()
    no_process_left(w8a8_run)


def test_the_first_run_serves_the_baseline_and_keeps_the_evidence(w8a8_run):
    run_dir = Path(w8a8_run.json["run_dir"])
    for name in ("gate.json", "report.md", "baseline-server.log", "candidate-server.log", "baseline/lm_eval.log", "candidate/lm_eval.log"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "candidate" / "lm_eval").rglob("samples_*.jsonl")), "per-sample results are kept"
    stages = gate_report(w8a8_run)["stages"]
    assert stages["baseline_serve_start_s"] > 0 and stages["candidate_serve_start_s"] > 0
    assert (run_dir / "report.md").read_text().startswith("# Quantization gate: PROMOTED")
    # The default policy's noise floor: every pass/fail set's baseline scored a second time, on a fresh server
    assert stages["baseline_repeat_serve_start_s"] > 0 and (run_dir / "baseline_repeat-server.log").is_file()
    for verdict in gate_report(w8a8_run)["gate"]["sets"]:
        floor = verdict["noise_floor"]
        assert floor["n"] == verdict["n"] and floor["reference"] == "mean of both passes", verdict["eval_set"]
        assert len(floor["unstable_items"]) == floor["flips"] == floor["right_to_wrong"] + floor["wrong_to_right"]
        assert floor["rate_low"] <= floor["rate"] <= floor["rate_high"] and floor["floor"] < verdict["rules"]["ni_margin"]
    assert "## Runtime noise floor" in (run_dir / "report.md").read_text()


def test_aggressive_is_rejected_with_reasons_naming_the_set_and_the_rule(workspace, aggressive_run, eval_set_names: list[str], no_process_left):
    assert aggressive_run.code == 1, aggressive_run.describe()
    outcome, report = aggressive_run.json, gate_report(aggressive_run)
    assert outcome["verdict"] == report["gate"]["verdict"] == "rejected"
    assert outcome["reasons"] == report["gate"]["reasons"] and outcome["reasons"]
    failed = {s["eval_set"] for s in report["gate"]["sets"] if not s["passed"]}
    worst = min(report["gate"]["sets"], key=lambda s: s["delta"])
    assert worst["delta"] <= -10.0, f"the negative control must lose >= 10 points on a set: {worst}"
    assert any(reason.startswith(f"{worst['eval_set']}:") and "max_abs_drop" in reason for reason in outcome["reasons"])
    for reason in outcome["reasons"]:
        set_name = reason.split(":")[0]
        assert set_name in failed and set_name in eval_set_names, reason
        assert any(rule in reason for rule in RULES), reason
    version = workspace.registry().show(DEMO_MODEL_DIR.name, outcome["registry_version"])
    assert (version.status, version.recipe_name) == ("rejected", NEGATIVE_CONTROL)
    assert Path(version.gate_path) == Path(outcome["gate_json"]).resolve()
    no_process_left(aggressive_run)


def test_a_warm_rerun_starts_no_baseline_server(aggressive_run):
    run_dir = Path(aggressive_run.json["run_dir"])
    assert not (run_dir / "baseline-server.log").exists() and not (run_dir / "baseline").exists()
    stages = gate_report(aggressive_run)["stages"]
    assert "baseline_serve_start_s" not in stages and "baseline_scoring_s" not in stages
    assert stages["candidate_serve_start_s"] > 0
    assert "no baseline server needed" in aggressive_run.stderr


def test_the_baseline_gated_against_itself_passes_through_the_ci_script(self_gate_run, smallest_set: str, no_process_left):
    assert self_gate_run.code == 0, self_gate_run.describe()
    lines = self_gate_run.stdout.splitlines()
    assert lines[0] == "verdict: promoted (exit 0)"
    gate_json = Path(next(line for line in lines if line.startswith("evidence: ")).removeprefix("evidence: "))
    (verdict,) = json.loads(gate_json.read_text())["gate"]["sets"]
    assert verdict["eval_set"] == smallest_set and verdict["passed"]
    assert verdict["delta"] == 0.0 and verdict["flips_right_to_wrong"] == 0
    assert verdict["kl_mean"] is not None and verdict["kl_mean"] < 1e-3
    assert f"set {smallest_set}: " in self_gate_run.stdout
    no_process_left(self_gate_run)


def test_a_model_vllm_cannot_start_is_an_error_that_leaves_nothing_behind(workspace, broken_start_run, broken_model: Path, no_process_left):
    assert broken_start_run.code == 2, broken_start_run.describe()
    error = broken_start_run.json  # with --json an error is a JSON object on stdout
    assert error["exit_code"] == 2 and "NoSuchModelForCausalLM" in error["error"]
    assert "vLLM exited during start-up" in broken_start_run.error_line
    assert "NoSuchModelForCausalLM" in broken_start_run.error_line, broken_start_run.error_line
    (run_dir,) = broken_start_run.new_runs
    assert run_dir.name.endswith("-error") and "ServeError" in (run_dir / "error.txt").read_text()
    assert (run_dir / "candidate-server.log").is_file() and not (run_dir / "gate.json").exists()
    assert not list(workspace.runs_dir.glob(".*.tmp"))
    assert all(Path(v.artifact_path) != broken_model.resolve() for v in workspace.registry().list())
    no_process_left(broken_start_run)


def test_the_run_after_a_failed_start_works(broken_start_run, self_gate_run):
    # self_gate_run is started after broken_start_run (fixture order) in the same artifacts root.
    assert (broken_start_run.code, self_gate_run.code) == (2, 0), self_gate_run.describe()


def test_an_item_longer_than_the_context_is_refused_before_serving(workspace, smallest_set: str, no_process_left):
    run = workspace.quantize(
        "gate", "--artifact", str(DEMO_MODEL_DIR), "--baseline", str(DEMO_MODEL_DIR),
        "--eval-sets", smallest_set, "--max-model-len", "40", "--no-registry", "--allow-unverified",
    )
    assert run.code == 2, run.describe()
    assert f"eval set {smallest_set}" in run.error_line and "item 0 is" in run.error_line
    assert "max_model_len 40" in run.error_line and "data.jsonl" in run.error_line
    (run_dir,) = run.new_runs
    assert run_dir.name.endswith("-error") and not list(run_dir.glob("*-server.log")), "no server may start"
    no_process_left(run)


def _lm_eval_by_hand(server: RunningServer, artifact: Path, set_folder: Path, task: str, output: Path) -> subprocess.CompletedProcess:
    """lm-eval's own command line, as a user would type it (with the server's key), run from the eval set's folder."""
    model_args = f"model=candidate,base_url={server.base_url}/completions,tokenizer={artifact},tokenized_requests=False,num_concurrent=4"
    return subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
         "--tasks", task, "--include_path", str(set_folder), "--output_path", str(output), "--log_samples"],
        cwd=set_folder, capture_output=True, text=True, timeout=900, env={**os.environ, "OPENAI_API_KEY": server.api_key},
    )


def test_reported_scores_equal_lm_eval_own_command_line(workspace, w8a8_run, smallest_set: str, tmp_path: Path):
    """Served from the signed promotion bundle (the artifact + evidence/ + model.sig, docs/registry.md): vLLM serves
    it unchanged, gives the gate's scores, and the signature still verifies after serving."""
    assert w8a8_run.code == 0, w8a8_run.describe()
    registry = workspace.registry()
    version = registry.show(DEMO_MODEL_DIR.name, w8a8_run.json["registry_version"])
    signed = registry.verify_signature(version, required=True)
    assert signed is not None and (signed.bundle / "evidence" / "gate.json").is_file()
    artifact, run_dir = signed.bundle, Path(w8a8_run.json["run_dir"])
    (eval_set,) = [s for s in discover_eval_sets() if s.name == smallest_set]
    task = eval_set.task_name
    (reported,) = [s for s in gate_report(w8a8_run)["gate"]["sets"] if s["eval_set"] == smallest_set]
    with vllm_server(artifact, log_path=tmp_path / "server.log", served_name="candidate") as server:
        result = _lm_eval_by_hand(server, artifact, eval_set.folder, task, tmp_path / "out")
        answer = complete(server, "Ticket 7: order", max_tokens=4)
    assert answer["usage"]["completion_tokens"] >= 1 and answer["choices"][0]["finish_reason"] in ("length", "stop")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    by_hand = json.loads(results_file.read_text())["results"][task]
    key = next(k for k in by_hand if k.split(",")[0] == reported["metric"] and "stderr" not in k)
    assert 100 * by_hand[key] == pytest.approx(reported["candidate_score"], abs=1e-6)
    # And item by item, paired by lm-eval's doc_hash.
    (hand_samples,) = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
    (pipeline_samples,) = (run_dir / "candidate" / "lm_eval").rglob(f"samples_{task}_*.jsonl")

    def per_item(path: Path) -> dict[str, float]:
        return {r["doc_hash"]: r[reported["metric"]] for r in map(json.loads, path.read_text().splitlines())}

    assert per_item(hand_samples) == per_item(pipeline_samples)
    assert registry.verify_signature(version, required=True) is not None  # serving changed nothing in the bundle
