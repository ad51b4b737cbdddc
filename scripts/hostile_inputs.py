"""The hostile inputs of issue 49, one builder each (registered with @case, run by scripts/hostile_cases.py): a forged run
folder for serve stop/drill/status, a user's kustomize folder for serve export, impossible figures and hostile peers for watch
(the fake vLLM metrics pages of tests/unit/watch/metrics_pages.py), spec.json as a device, a FIFO or a sparse 8 GiB file for
deploy, a slow eval set, unverified repairs, a bundle with an added folder, 100 KB arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from hostile_world import (
    MODEL,
    REPO,
    Builder,
    Case,
    Workspace,
    absent,
    alias_kept,
    alive,
    alone,
    case,
    fresh,
    unchanged,
)

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
def prometheus_1e999(ws: Workspace, stack: ExitStack) -> Case:
    from test_watch_hostile import _prometheus_answering

    now = time.time()
    url = metrics_peer(stack, _prometheus_answering([{"metric": {}, "values": [[now - 30, "1e999"], [now - 1, "-1e999"]]}]))
    return Case("watch --prometheus: every series' values 1e999 and -1e999",
                ["watch", "--url", "http://127.0.0.1:8000/metrics", "--prometheus", url.removesuffix("/metrics"), "--window", "1m",
                 "--version", f"{MODEL}@production", "--rollback-after", "1", "--registry", str(ws.registry), "--timeout", "5s",
                 "--out", str(fresh(ws, "watch") / "w")], check=lambda outcome: alias_kept(ws))


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
    # refusing a URL by its length costs nothing: 5 s of CPU is the CLI's start (about 2 s) and a margin
    return Case("watch --url of 100 KB", ["watch", "--url", huge, *FAST], limit_s=120, cpu_limit_s=5,
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
    return Case("registry show: a 100 KB model name", ["registry", "show", "m" * 100_000, "production", "--registry", str(ws.registry)],
                shown="registry show mmm…(100 KB) production --registry DB")


@case
def huge_deploy_ref(ws: Workspace, stack: ExitStack) -> Case:
    return Case("deploy: a 100 KB NAME@ALIAS", ["deploy", f"{MODEL}@" + "p" * 100_000, "--out", str(fresh(ws, "deploy")), "--registry",
                                               str(ws.registry)], shown="deploy demo-llama@ppp…(100 KB) --out DIR --registry DB")


@case
def huge_serve_name(ws: Workspace, stack: ExitStack) -> Case:
    return Case("serve stop: a 100 KB name", ["serve", "stop", "n" * 100_000], shown="serve stop nnn…(100 KB)")


