"""`quantize serve` with real parts (docs/fleet.md): the promoted, signed w8a8 demo version as the primary and its own
16-bit model as the fallback, two real vLLM CPU servers, Debian's nginx in front, and `quantize serve drill` sending a
bounded load while the primary is SIGKILLed, then SIGSTOPped; `serve status` is read while the primary is down, and
`serve stop` must leave nothing running. Bad input: exit 2 with one line, nothing started, nothing left running.

The session's `w8a8_run` (tests/integration/conftest.py) provides the promoted version with its load-test envelope.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from helpers import MARKER, QUANTIZE, CommandRun, Workspace, processes_with_marker

from pipelines.fleet.state import read_state
from pipelines.paths import DEMO_MODEL_NAME
from pipelines.serve.serving import free_port

pytestmark = pytest.mark.integration
START_TIMEOUT_S = 900
NAME = "fleet-e2e"


def deployment(workspace: Workspace, name: str, **body) -> Path:
    path = workspace.root / "fleet" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump({"name": name, "primary": f"{DEMO_MODEL_NAME}@production", **body}))
    return path


@pytest.fixture(scope="module")
def production(workspace: Workspace, w8a8_run: CommandRun) -> int:
    assert w8a8_run.code == 0, w8a8_run.describe()
    version = w8a8_run.json["registry_version"]
    workspace.registry().set_alias(DEMO_MODEL_NAME, "production", version, reason="fleet e2e")
    return version


def run_folder(workspace: Workspace, name: str) -> Path:
    return workspace.artifacts / "serve" / name


def wait_for_phase(workspace: Workspace, name: str, process: subprocess.Popen, phase: str, timeout_s: float) -> None:
    state_file = run_folder(workspace, name) / "state.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"quantize serve exited with {process.returncode}"
        if state_file.is_file() and read_state(state_file.parent).phase == phase:
            return
        time.sleep(1)
    raise AssertionError(f"deployment {name} did not reach {phase} in {timeout_s} s")


def test_the_chain_survives_a_crash_and_a_hang_under_load(workspace: Workspace, production: int) -> None:
    path = deployment(workspace, NAME, fallbacks=[{"base_of": f"{DEMO_MODEL_NAME}@production"}],
                      circuit_breaker={"failures_to_open": 2, "retry_after_s": 5}, listen={"port": free_port()})
    marker = uuid.uuid4().hex
    progress_log = (workspace.root / "fleet" / "serve.stderr").open("w")  # a pipe nobody reads could fill and block it
    serve = subprocess.Popen([str(QUANTIZE), "serve", str(path), "--json"], env={**workspace.env, MARKER: marker}, stdout=subprocess.PIPE,
                             stderr=progress_log, stdin=subprocess.DEVNULL, text=True)
    try:
        wait_for_phase(workspace, NAME, serve, "serving", START_TIMEOUT_S)
        healthy = workspace.quantize("serve", "status", NAME, "--json")
        assert healthy.code == 0 and healthy.json["live_route"] == "primary" and not healthy.json["degraded"], healthy.describe()
        bindings = [re.search(r"VLLM_CPU_OMP_THREADS_BIND=(\S+)", route.vllm_args) for route in read_state(run_folder(workspace, NAME)).routes]
        assert all(bindings) and len({found.group(1) for found in bindings if found}) == min(2, len(os.sched_getaffinity(0))), bindings

        seen_degraded: list[dict] = []
        drill_done = threading.Event()
        drill: list[CommandRun] = []

        def run_drill() -> None:
            # Each route's vLLM on its own core (pipelines/fleet/cores.py): unpinned, both pinned to core 0 and the primary's
            # restart beside the fallback serving this load got 4% of it and never started (CI, 3 December)
            drill.append(workspace.quantize("serve", "drill", NAME, "--hang-s", "15", "--concurrency", "2", "--rate", "5", "--recover-s", "300",
                                            "--json"))
            drill_done.set()

        threading.Thread(target=run_drill, daemon=True).start()
        while not drill_done.wait(1.0):  # while the primary is being restarted (dead, restarting, then starting), status must say so
            primary = read_state(run_folder(workspace, NAME)).routes[0]
            if primary.status in ("dead", "restarting", "starting") and not seen_degraded:
                status = workspace.quantize("serve", "status", NAME, "--json")
                assert status.code == 0, status.describe()
                seen_degraded.append(status.json)
        report = drill[0]
        assert report.code in (0, 1), report.describe()
        result = report.json
        print(json.dumps({key: result[key] for key in ("sent", "answered", "answered_by", "failed", "faults", "breaker", "restarts", "criteria")},
                         indent=1))

        crash, hang = result["faults"]
        # What the supervisor said (an nginx that exited is named there, with how it ended) and nginx's console: the story of a loss.
        folder = run_folder(workspace, NAME)
        story = " | ".join(event.text for event in read_state(folder).events)
        story += " | nginx console: " + (folder / "nginx-console.log").read_text()[-1500:]
        assert result["sent"] == result["answered"], f"requests lost: {story}"
        # The drill's own verdict matches its criteria, each with its figure and limit. Nothing may be lost and a fallback
        # must work; how fast the primary answers again is timed on a loaded 2-core CI host, so its bound is the drill's
        # verdict to report (exit 1 when missed), not this test's to flake on: it must be measured and judged consistently.
        criteria = {item["name"]: item for item in result["criteria"]}
        assert criteria["a working fallback"]["passed"] and criteria["no request lost"]["passed"], result["criteria"]
        assert result["passed"] == all(item["passed"] for item in result["criteria"]) == (report.code == 0), result["criteria"]
        closing = [item for item in result["criteria"] if "answered again" in item["name"]]
        assert len(closing) == 2 and all(item["measured"] is not None for item in closing), closing
        assert all(item["passed"] == (item["measured"] <= item["limit"]) for item in closing), closing
        assert result["answered_by"].get("primary", 0) > 0 and result["answered_by"].get("fallback-1", 0) > 0
        kinds = [(event["route"], event["kind"]) for event in result["breaker"]]
        assert ("primary", "opened") in kinds and ("primary", "closed") in kinds
        assert kinds.index(("primary", "closed"), kinds.index(("primary", "opened"))) > kinds.index(("primary", "opened"))
        assert result["restarts"] >= 1 and crash["recovered_at"] and hang["recovered_at"]

        assert seen_degraded, "serve status was never read while the primary was down"
        degraded = seen_degraded[0]
        assert degraded["degraded"] and degraded["live_route"] == "fallback-1" and "primary" in degraded["why"]

        stop = workspace.quantize("serve", "stop", NAME, "--json")
        assert stop.code == 0, stop.describe()
        out, _ = serve.communicate(timeout=120)
        assert serve.returncode == 0, (workspace.root / "fleet" / "serve.stderr").read_text()[-3000:]
        final = json.loads(out)
        assert final["phase"] == "stopped" and final["traffic"]["requests"] >= result["sent"]
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=120)
        progress_log.close()
    assert processes_with_marker(marker) == []


BAD_INPUT = {
    "unknown version": ({"fallbacks": [f"{DEMO_MODEL_NAME}@999"]}, "fallbacks[0]"),
    "unknown alias": ({"primary": f"{DEMO_MODEL_NAME}@champion"}, "primary"),
    "cycle": ({"fallbacks": [f"{DEMO_MODEL_NAME}@production"]}, "fallbacks[0]"),
    "does not fit": ({"fallbacks": [{"base_of": f"{DEMO_MODEL_NAME}@production", "kv_cache_gib": 4096}]}, "fallbacks[0]"),
    "zero timeout": ({"fallbacks": [{"base_of": f"{DEMO_MODEL_NAME}@production", "timeout_s": 0}]}, "timeout_s"),
    "negative timeout": ({"primary": {"model": f"{DEMO_MODEL_NAME}@production", "timeout_s": -5}}, "timeout_s"),
    "infinite timeout": ({"rules": {"min_timeout_s": "1e999"}}, "min_timeout_s"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_starts_nothing(workspace: Workspace, production: int, case: str) -> None:
    body, field = BAD_INPUT[case]
    name = f"bad-{case.replace(' ', '-')}"
    path = deployment(workspace, name, **body)
    if case == "infinite timeout":  # YAML's 1e999 is a float: written as text, read back as infinity
        path.write_text(path.read_text().replace("'1e999'", "1e999"))
    check_refused(workspace, ["serve", str(path)], name, field)


def test_a_port_in_use_and_a_missing_nginx_start_nothing(workspace: Workspace, production: int) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = deployment(workspace, "bad-port", listen={"port": port})
        check_refused(workspace, ["serve", str(path)], "bad-port", "listen.port")
    path = deployment(workspace, "bad-nginx", fallbacks=[{"base_of": f"{DEMO_MODEL_NAME}@production"}])
    line = check_refused(workspace, ["serve", str(path)], "bad-nginx", "nginx", env={"QUANTGATE_NGINX": "/nonexistent/nginx"})
    assert "apt-get install nginx" in line


def check_refused(workspace: Workspace, argv: list[str], name: str, field: str, env: dict[str, str] | None = None) -> str:
    run = workspace.quantize(*argv, env=env)
    assert run.code == 2, run.describe()
    lines = [line for line in run.stderr.splitlines() if line.startswith("quantize:")]
    assert len(lines) == 1 and field in lines[0], run.describe()
    assert not run_folder(workspace, name).exists(), "a refused deployment made its run folder"
    assert processes_with_marker(run.marker) == []
    assert not [line for line in run.stderr.splitlines() if "starting vLLM" in line]
    return lines[0]


def test_the_export_validates_offline(workspace: Workspace, production: int, tmp_path: Path) -> None:
    path = deployment(workspace, "exported", fallbacks=[{"base_of": f"{DEMO_MODEL_NAME}@production"}])
    run = workspace.quantize("serve", "export", str(path), "--out", str(tmp_path / "k8s"), "--json")
    assert run.code == 0, run.describe()
    assert "strict" in run.json["validated_against"] and "nginx -t" in run.json["proxy_check"]
    assert os.stat(tmp_path / "k8s" / "exported-keys-secret.yaml").st_mode & 0o777 == 0o600
