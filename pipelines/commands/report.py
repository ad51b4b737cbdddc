"""`quantize report RUN_ID|NAME [--out FILE]`: the HTML page of a run, a repair or a registry model.

A run's page is built from its gate.json, a repair's from its repair.json, a model's from the registry (versions,
aliases, verdicts over time, events). The page is one self-contained file (no script, no network fetch).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError

from pipelines.console.output import emit, say
from pipelines.errors import InputError, from_validation_error
from pipelines.gate.schema import read_report
from pipelines.registry.store import open_registry
from pipelines.repair.page import render_repair_page
from pipelines.repair.result import REPAIR_JSON, load_result
from pipelines.reports.locate import GATE_JSON, Located, default_out, locate, unknown_target, write_page
from pipelines.reports.model_page import ModelHistory, render_model_page
from pipelines.reports.run_page import render_run_page
from pipelines.settings import current as current_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", description="Write the HTML page of a run (its gate.json), a repair (its repair.json) or "
                                   "a registry model (its versions, aliases, verdicts over time): one self-contained file to open in a browser.")
    parser.add_argument("target", metavar="RUN_ID|NAME", help="a folder under artifacts/runs/, or a model's name in the registry")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="where to write the page (default: report.html in the run's folder; artifacts/reports/NAME.html for a model)")
    parser.add_argument("--registry", metavar="PATH", type=Path, default=None,
                        help="registry database (default: $QUANTGATE_REGISTRY or artifacts/registry.db)")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    parser.set_defaults(handler=_report)


def _page(located: Located, runs_dir: Path, registry: Path | None) -> str:
    if located.kind == "run" and located.folder is not None:
        report = read_report(located.folder / GATE_JSON)[0]
        return render_run_page(report, run_id=located.name, file=located.folder / GATE_JSON)
    if located.kind == "repair" and located.folder is not None:
        try:
            return render_repair_page(load_result(located.folder))
        except ValidationError as error:
            raise from_validation_error(error, located.folder / REPAIR_JSON) from None
    try:
        history = ModelHistory.read(open_registry(registry), located.name)
    except InputError as error:
        if error.field != "model":
            raise
        raise unknown_target(located.name, runs_dir, error) from None
    return render_model_page(history)


def _report(args: argparse.Namespace) -> int:
    settings = current_settings()
    located = locate(args.target, settings.runs_dir)
    html = _page(located, settings.runs_dir, args.registry)
    path = write_page(args.out or default_out(located, settings.artifacts_dir), html)
    result = {"kind": located.kind, "target": located.name, "page": str(path), "bytes": len(html.encode())}
    emit(result, as_json=args.json, render=lambda value: say(f"{value['kind']} page of {value['target']}: {value['page']}"))
    return 0
