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
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import hostile_inputs  # noqa: F401 (the cases register themselves in BUILDERS)
from hostile_world import BUILDERS, QUANTIZE, Builder, Case, Outcome, Workspace, workspace

STDERR_CUT = 160
LONG_LINE = 2000  # an error line longer than this is a BREAK (the issue saw 100 KB ones)


@dataclass
class Row:
    case: Case
    outcome: Outcome
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


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
    problems = judge(case, outcome)
    # the table names the temporary folder $WS (its name changes every run)
    shown = (case.shown or " ".join(case.argv)).replace(str(ws.root), "$WS")
    return Row(case=replace(case, shown=shown), outcome=replace(outcome, stderr=outcome.stderr.replace(str(ws.root), "$WS")), problems=problems)


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

