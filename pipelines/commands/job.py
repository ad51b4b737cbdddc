"""`quantize job FILE [--executor local|ray] [--ray-address ADDRESS] [--objective size|speed]`: run every candidate of a
job file through the runner, here or on a Ray cluster (docs/scale-out.md); one summary at the end, with the winner per
model under the objective and report.md with both frontiers."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.console.capture import add_verbose_option
from pipelines.console.output import console, emit, table
from pipelines.errors import InputError
from pipelines.files.yamlio import load_yaml_file
from pipelines.jobs.ray.address import ADDRESS_FIELD, check_address
from pipelines.repair.objective import OBJECTIVE_HELP, OBJECTIVES, Objective

if TYPE_CHECKING:  # the job machinery imports torch and the runner: seconds, after the address is checked
    from pipelines.jobs.job import Executor, JobSummary


def reasons_by_set(reasons: list[str]) -> str:
    """One line per eval set (reasons read "<set>: <rule broken>"): its first reason and how many more."""
    grouped: dict[str, list[str]] = {}
    for reason in reasons:
        grouped.setdefault(reason.split(":", 1)[0], []).append(reason)
    return "\n".join(group[0] + (f" (+{len(group) - 1} more)" if len(group) > 1 else "") for group in grouped.values())


def _render(summary: JobSummary) -> None:
    rows = [
        [r.model, r.recipe, r.status + (" (cached)" if r.skipped else ""), r.registry_version, f"{r.wall_s:.0f}", r.node,
         reasons_by_set(r.reasons)]
        for r in summary.results
    ]
    columns = ["model", "recipe", "verdict", "registry version", "wall s", "node", "reasons"]
    console.print(table(f"job {summary.job}: {len(rows)} candidate(s) in {summary.wall_s:.0f} s", columns, rows))
    if any(r.reasons for r in summary.results):
        console.print("Every reason: gate.json and report.md in each candidate's run folder (--json lists them all).")
    winners = [[c.model, c.choice.winner or "-", c.choice.decided_by or "-", c.registry_version, " ".join(c.choice.notes)]
               for c in summary.choices]
    if winners:
        console.print(table(f"the winner per model by {summary.objective}", ["model", "winner", "decided by", "registry version", "why"], winners))
        console.print(f"Both frontiers (bytes and throughput against the quality bound): {summary.report_md}")


def run_job(path: Path, *, executor: Executor | None = None, ray_address: str | None = None,
            objective: Objective | None = None) -> JobSummary:
    """The job by its executor: `executor` (--executor), else the job file's `executor:`; `objective` likewise."""
    from pipelines.jobs.job import plan_job, run_locally

    planned = plan_job(path, objective=objective)
    if (executor or planned.job.executor) == "ray":
        from pipelines.jobs.ray.driver import run_on_ray  # ray: only for a job that uses it

        return run_on_ray(planned, address=ray_address)
    if ray_address is not None:
        raise InputError("--ray-address needs the ray executor (--executor ray or `executor: ray`)", field="--ray-address")
    return run_locally(planned)


def _known_address(path: Path, executor: Executor | None, ray_address: str | None) -> tuple[str, str] | None:
    """The address a Ray job will connect to and the option or variable it comes from, when the job runs on Ray: by
    --executor ray, or by a job file that says `executor: ray` (read here for that key alone, bounded; the job file is
    read and checked in full when planned). None for a local job, or a job file planning will refuse."""
    if executor is None:
        try:
            document = load_yaml_file(path, what="job", field="job")
        except InputError:
            return None
        executor = document.get("executor") if isinstance(document, dict) else None
    if executor != "ray":
        return None
    if ray_address is not None:
        return ray_address, ADDRESS_FIELD
    return (os.environ["RAY_ADDRESS"], "RAY_ADDRESS") if os.environ.get("RAY_ADDRESS") else None


def handle(args: argparse.Namespace) -> int:
    early = _known_address(args.file, args.executor, args.ray_address)
    if early is not None:  # the Ray cluster answers (seconds) before the job machinery is even imported
        check_address(*early)
    from pipelines.commands.common import library_output_on_stderr

    with library_output_on_stderr(verbose=args.verbose):
        summary = run_job(args.file, executor=args.executor, ray_address=args.ray_address, objective=args.objective)
    emit({**summary.model_dump(mode="json"), "exit_code": summary.exit_code}, as_json=args.json, render=lambda _: _render(summary))
    return summary.exit_code


def register(subparsers) -> None:
    parser = subparsers.add_parser("job")  # its summary: pipelines.cli.COMMANDS
    parser.add_argument("file", type=Path, help="job YAML (see jobs/demo.yaml)")
    parser.add_argument("--executor", choices=["local", "ray"], default=None,
                        help="local: one candidate after another on this machine; ray: a Ray task per candidate (default: the "
                             "job file's `executor:`, else local)")
    parser.add_argument("--ray-address", default=None, metavar="ADDRESS",
                        help="the Ray cluster: HOST:PORT, ray://HOST:PORT or auto (default: $RAY_ADDRESS, else a local Ray started "
                             "for the job)")
    parser.add_argument("--objective", choices=OBJECTIVES, default=None,
                        help=f"{OBJECTIVE_HELP} (default: the job file's `objective:`, else size)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_verbose_option(parser)
    parser.set_defaults(handler=handle)
