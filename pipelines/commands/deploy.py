"""`quantize deploy NAME@ALIAS --out DIR`: the deployment files of a promoted, verified registry version."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.commands.args import duration_arg, int_arg
from pipelines.console.output import emit, progress, say, table
from pipelines.deploy.files import DeploySettings, write_deployment
from pipelines.deploy.limits import limits
from pipelines.deploy.slo import slos
from pipelines.deploy.spec import served_spec
from pipelines.registry.store import open_registry


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("deploy", description="Write the deployment files of a promoted, verified registry version: the vLLM "
                                   "serve command with its measured arguments, a Prometheus scrape config, alert rules whose thresholds "
                                   "come from the version's own load test and the policy's SLOs, and a Grafana dashboard.")
    parser.add_argument("reference", metavar="NAME@ALIAS", help="a registry version: NAME@ALIAS, NAME@VERSION or NAME (its newest promoted)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (new, empty, or an earlier deployment's)")
    parser.add_argument("--served-name", default=None, help="the model name clients ask for (default: the model's name)")
    parser.add_argument("--port", type=int_arg(1, 65535), default=8000, help="the port the server listens on (default: %(default)s)")
    parser.add_argument("--metrics-target", default=None, metavar="HOST:PORT",
                        help="what Prometheus scrapes (default: localhost:PORT); `quantize watch --url` names the same")
    parser.add_argument("--scrape-interval", type=duration_arg(1, 3600), default=15.0, metavar="DURATION",
                        help="Prometheus' scrape and rule interval (default: 15s)")
    parser.add_argument("--window", type=duration_arg(1, 86_400), default=300.0, metavar="DURATION",
                        help="the window of the capacity, corrupted-request and overload rules, as `quantize watch --window` "
                        "(default: 5m; the SLOs' burn-rate windows are fixed, 5m to 3d)")
    parser.add_argument("--alert-for", type=duration_arg(0, 86_400), default=60.0, metavar="DURATION",
                        help="how long a capacity or overload rule must hold before it fires (default: 1m)")
    parser.add_argument("--registry", metavar="PATH", type=Path, default=None,
                        help="registry database (default: $QUANTGATE_REGISTRY or artifacts/registry.db)")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    parser.set_defaults(handler=_deploy)


def _deploy(args: argparse.Namespace) -> int:
    registry = open_registry(args.registry)
    spec = served_spec(args.reference, registry=registry, served_name=args.served_name)
    envelope = spec.require_envelope()
    settings = DeploySettings(metrics_target=args.metrics_target or f"localhost:{args.port}", port=args.port,
                              scrape_interval_s=int(args.scrape_interval), window_s=int(args.window), alert_for_s=int(args.alert_for))
    progress(f"{spec.model} v{spec.version} verified ({'signed bundle' if spec.signed else 'artifact'}: {spec.folder})")
    written = write_deployment(spec, settings, args.out)
    result = {"model": spec.model, "version": spec.version, "reference": spec.reference, "folder": str(spec.folder),
              "served_name": spec.served_name, "vllm_args": spec.args.cli_args(), "environment": spec.args.environment(),
              "sources": spec.args.sources, "limits": [limit.model_dump() for limit in limits(envelope)],
              "slos": [slo.model_dump() for slo in slos(spec)], "notes": spec.notes,
              "files": {name: str(path) for name, path in written.items()}}

    def render(value: dict) -> None:
        say(table(f"{spec.model} v{spec.version} ({spec.reference}) -> {args.out}", ["argument", "value", "from"],
                  [list(row) for row in spec.args.described()]))
        say(table("Limits (quantize watch; the capacity ones are alert-rules.yml tickets)", ["figure", "limit", "from"],
                  [[limit["figure"], f"{limit['limit']:g}", limit["source"]] for limit in value["limits"]]))
        say(table("Burn-rate SLOs (page: 14.4x over 1h and 5m, or 6x over 6h and 30m; ticket: 3x over 1d and 2h, or 1x over 3d and 6h)",
                  ["SLO", "budget", "bad"], [[slo["figure"], f"{slo['budget']:.4g}", slo["description"]] for slo in value["slos"]]))
        for note in spec.notes:
            say(f"note: {note}")
        say("written: " + ", ".join(value["files"]))

    emit(result, as_json=args.json, render=render)
    return 0
