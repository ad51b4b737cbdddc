"""`quantize serve`: a promoted version behind nginx with a fallback chain, a circuit breaker and degradation rules.

    quantize serve DEPLOYMENT.yaml [--nginx PATH]      start every route's vLLM server and nginx; serve until Ctrl-C/SIGTERM
    quantize serve check DEPLOYMENT.yaml               everything `serve` checks before it starts anything; starts nothing
    quantize serve status [NAME]                       which route is live and why; traffic per route; the breaker's timeline
    quantize serve stop [NAME]                         stop a running deployment (and every process it started)
    quantize serve export DEPLOYMENT.yaml --out DIR    the same deployment as Kubernetes manifests, validated offline
    quantize serve drill [NAME]                        under a bounded load, crash then hang the primary: what was answered, by whom

The work is in pipelines/fleet (docs/fleet.md). Exit 0 on success (a deployment stopped by Ctrl-C, SIGTERM or `serve stop`
ends with 0 and its traffic summary; a drill whose every criterion held), 1 when a drill's criterion failed (a request
lost, a route not answering again within its bound, no working fallback), 2 on every error: bad input starts nothing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pipelines.commands.args import float_arg, int_arg
from pipelines.console.output import emit, say, table
from pipelines.errors import InputError
from pipelines.fleet.deployment import Deployment, load_deployment
from pipelines.fleet.drill import MAX_DRILL_S, MAX_REQUESTS, DrillSettings
from pipelines.fleet.state import ServeState, find_state, stop_deployment
from pipelines.planner.gpus import GiB
from pipelines.registry.store import Registry, registry_exists
from pipelines.settings import current as current_settings

ACTIONS = ("check", "status", "stop", "export", "drill")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", usage="quantize serve {DEPLOYMENT.yaml | check DEPLOYMENT.yaml | status [NAME] | stop [NAME] | export DEPLOYMENT.yaml --out DIR"
                       " | drill [NAME]}",
    )  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("what", metavar="DEPLOYMENT.yaml|check|status|stop|export|drill", help="a deployment file to serve, or an action")
    parser.add_argument("target", metavar="DEPLOYMENT.yaml|NAME", nargs="?", help="the deployment file (check, export) or name (status, stop)")
    parser.add_argument("--registry", type=Path, default=None, help="registry database (default: $QUANTGATE_REGISTRY or artifacts/registry.db)")
    parser.add_argument("--nginx", default=None, help="the nginx binary (default: $QUANTGATE_NGINX, else nginx on PATH or in /usr/sbin)")
    parser.add_argument("--out", type=Path, default=None, help="export: the folder for the Kubernetes manifests")
    drill = DrillSettings()
    parser.add_argument("--requests", type=int_arg(1, MAX_REQUESTS), default=drill.requests, help="drill: the most requests sent (%(default)s)")
    parser.add_argument("--concurrency", type=int_arg(1, 64), default=drill.concurrency, help="drill: requests in flight (%(default)s)")
    parser.add_argument("--rate", type=float_arg(0, 10_000, low_open=True), default=drill.rate, help="drill: requests per second, at most")
    parser.add_argument("--hang-s", type=float_arg(0, 600, low_open=True), default=drill.hang_s, help="drill: seconds the primary stays stopped")
    parser.add_argument("--recover-s", type=float_arg(0, MAX_DRILL_S, low_open=True), default=drill.recover_s,
                        help="drill: longest wait for the primary to answer again after each fault")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    parser.set_defaults(handler=serve)


def serve(args: argparse.Namespace) -> int:
    if args.what in ("status", "stop", "drill"):
        return {"status": _status, "stop": _stop, "drill": _drill}[args.what](args)
    if args.what in ("check", "export"):
        if args.target is None:
            raise InputError(f"`quantize serve {args.what}` needs a deployment file", field="DEPLOYMENT.yaml")
        return _check(args, Path(args.target)) if args.what == "check" else _export(args, Path(args.target))
    if args.target is not None:
        raise InputError(f"unexpected {args.target!r} after the deployment file (actions: {', '.join(ACTIONS)})", field="DEPLOYMENT.yaml")
    return _serve(args, Path(args.what))


def _registry(args: argparse.Namespace) -> Registry:
    path = args.registry or current_settings().registry_path
    if not registry_exists(path):
        raise InputError("no registry database here: promote a version first (`quantize --recipe ...`)", file=path, field="--registry")
    return Registry(path)


def _nginx(args: argparse.Namespace) -> str | None:
    return args.nginx or current_settings().nginx


def _prepare(args: argparse.Namespace, source: Path):
    from pipelines.fleet.supervisor import prepare

    deployment = load_deployment(source)
    return prepare(deployment, source, _registry(args), nginx=_nginx(args))


def _check(args: argparse.Namespace, source: Path) -> int:
    prepared = _prepare(args, source)
    emit(prepared, as_json=args.json, render=_render_prepared)
    return 0


def _serve(args: argparse.Namespace, source: Path) -> int:
    from pipelines.fleet.supervisor import Supervisor

    prepared = _prepare(args, source)
    if not args.json:  # with --json, stdout carries only the final document
        _render_prepared(prepared)
    state = Supervisor(prepared).run()
    emit(state, as_json=args.json, render=_render_final)
    return 0


def _status(args: argparse.Namespace) -> int:
    from pipelines.fleet.status import status_report

    _, state = find_state(args.target)
    emit(status_report(state), as_json=args.json, render=_render_status)
    return 0


def _stop(args: argparse.Namespace) -> int:
    folder, state = find_state(args.target)
    took = stop_deployment(folder, state)
    result = {"name": state.name, "stopped": True, "seconds": round(took, 2)}
    emit(result, as_json=args.json, render=lambda _: say(f"deployment {state.name!r} stopped in {took:.1f} s: every server and nginx"))
    return 0


def _drill(args: argparse.Namespace) -> int:
    from pipelines.fleet.drill import run_drill

    folder, _ = find_state(args.target)
    settings = DrillSettings(requests=args.requests, concurrency=args.concurrency, rate=args.rate, hang_s=args.hang_s, recover_s=args.recover_s)
    report = run_drill(folder, settings)
    emit(report, as_json=args.json, render=_render_drill)
    return 0 if report.passed else 1


def _export(args: argparse.Namespace, source: Path) -> int:
    from pipelines.fleet.kubernetes import export_manifests

    if args.out is None:
        raise InputError("`quantize serve export` needs --out DIR", field="--out")
    deployment: Deployment = load_deployment(source)
    from pipelines.fleet.routes import resolve_routes

    routes = resolve_routes(deployment, _registry(args), source=source, here=False)  # the cluster's image serves, not this host
    exported = export_manifests(deployment, routes, args.out)
    emit(exported, as_json=args.json, render=_render_export)
    return 0


# --- rendering ---------------------------------------------------------------------------------------------


def _render_prepared(prepared) -> None:
    memory = {item.label: item for item in prepared.fit.routes}
    rows = [
        [route.label, route.ref, f"{route.model} v{route.version}" + (" (16-bit base)" if route.kind == "base" else ""),
         f"{route.timeout_s:g} s", route.serve.max_num_seqs, f"{memory[route.label].total_bytes / GiB:.2f} GiB", route.verified]
        for route in prepared.routes
    ]
    say(table(f"deployment {prepared.deployment.name}: {len(rows)} routes, every one verified", ["route", "as written", "serves", "timeout",
                                                                                                   "max_num_seqs", "memory", "verified"], rows))
    for route in prepared.routes:
        say(f"{route.label} timeout: {route.timeout_basis}")
    fit = prepared.fit
    say(f"fits: {fit.required_bytes / GiB:.2f} GiB of {fit.available_bytes / GiB:.2f} GiB ({fit.machine})")
    if prepared.cores is not None:
        pinned = ", ".join(f"{route.label} on {cores}" for route, cores in zip(prepared.routes, prepared.cores.cores, strict=True))
        say(f"cores: {pinned} ({prepared.cores.note})")
    say(prepared.nginx_check)


def _clock(at: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at)) if at else "-"


def _render_final(state: ServeState) -> None:
    traffic = state.traffic
    if traffic is None:
        say(f"deployment {state.name} stopped; no traffic")
        return
    rows = [[route.label, route.answered, route.busy, sum(route.failed.values()), route.skipped_breaker_open, route.skipped_at_max_conns]
            for route in traffic.routes]
    columns = ["route", "answered", "busy (503/429)", "failed", "skipped (breaker)", "skipped (max_conns)"]
    say(table(f"deployment {state.name}: {traffic.requests} requests, {traffic.answered} answered", columns, rows))
    for why, count in traffic.failed.items():
        say(f"not answered: {count} x {why}")
    for event in traffic.breaker:
        say(f"breaker {event.route} {event.kind} at {_clock(event.at)} ({event.why})")


def _render_status(report) -> None:
    state = "degraded" if report.degraded else ("serving" if report.running else report.phase)
    say(f"{report.name}: {state}; live route: {report.live_route or 'none'} ({report.why})")
    rows = [[row.label, row.serves, row.port or "-", row.status, row.health, row.breaker, row.answered, row.failed, row.recent_answered,
             f"{row.timeout_s:g} s", row.restarts, row.why] for row in report.routes]
    say(table(f"routes of {report.name} ({report.endpoint}, model {report.served_model_name})",
              ["route", "serves", "port", "process", "/health", "breaker", "answered", "failed", "last 60 s", "timeout", "restarts", "why"], rows))
    failed = ", ".join(f"{count} x {why}" for why, count in report.failed.items()) or "none"
    say(f"requests: {report.requests}, answered {report.answered}, not answered: {failed}; last 60 s: {report.recent_requests}")
    say(f"turned away with no route answering: {report.busy} x 529 (a route busy), {report.down} x 503 (every route down)")
    for line in report.breaker_events:
        say(f"breaker: {line}")


def _render_export(exported) -> None:
    say(table(f"Kubernetes manifests in {exported.folder}", ["file", "kind", "name"],
              [[item.file, item.kind, item.name] for item in exported.objects]))
    say(f"every object validated against the {exported.validated_against}")
    say(exported.proxy_check)
    say(f"apply with `kubectl apply -k {exported.folder}` once the models volume holds what docs/fleet.md lists")


def _render_drill(report) -> None:
    say(f"drill on {report.deployment} ({report.endpoint}): {report.sent} requests sent at concurrency {report.settings.concurrency} (at most "
        f"{report.settings.rate:g}/s) in "
        f"{report.ended_at - report.started_at:.0f} s; {report.answered} answered, {report.sent - report.answered} not")
    say(table("answered by", ["route", "requests"], [[route, count] for route, count in sorted(report.answered_by.items())]))
    for why, count in report.failed.items():
        say(f"not answered: {count} x {why}")
    for fault in report.faults:
        back = f", answered again after {fault.recovered_at - fault.at:.1f} s" if fault.recovered_at else ""
        say(f"{_clock(fault.at)} {fault.kind} of pid {fault.pid}: {fault.in_flight} requests in flight{back}")
    for event in report.breaker:
        say(f"{_clock(event.at)} breaker {event.route} {event.kind} ({event.why})")
    rows = [[item.name, "-" if item.measured is None else f"{item.measured:g}", f"{item.rule} {item.limit:g} {item.unit}",
             "ok" if item.passed else "FAILED", item.detail] for item in report.criteria]
    say(table("the drill's criteria", ["criterion", "measured", "limit", "verdict", "detail"], rows))
    failed = [item.name for item in report.criteria if not item.passed]
    say("drill passed: every criterion held" if report.passed else f"drill FAILED: {'; '.join(failed)}")
