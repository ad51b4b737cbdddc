"""GuideLLM's benchmark, run several times in one process of its own environment (.venv-guidellm).

Run by that environment's interpreter, never imported by the project (it imports guidellm):

    .venv-guidellm/bin/python pipelines/benchmarks/guidellm_driver.py < ORDERS

The twin of pipelines/loadtest/vllm_bench_driver.py, for the load-generator comparison
(pipelines/benchmarks/loadgen.py): it imports GuideLLM first and says so, then reads JSON lines from stdin,
one per run, {"name": str, "spec": {...}, "key": str}, and runs each as `guidellm run` would (GuideLLM's
`BenchmarkScenario.create` then `benchmark_generative_text`), with `key` as the backend's API key: the key is
never on a command line or in a file (GuideLLM's CLI takes it only as `--backend ...,api_key=KEY` or in a
scenario file). It prints one "done" line per run and exits when stdin closes. Exit codes: 0 every run done,
3 a run raised (after its traceback).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback

DONE_PREFIX = "quantgate-guidellm: done"
READY_LINE = "quantgate-guidellm: GuideLLM imported, waiting for runs"


def main() -> int:
    from guidellm.benchmark.entrypoints import benchmark_generative_text  # type: ignore[import-not-found]  # heavy, its own env
    from guidellm.schemas.benchmark.entrypoints import BenchmarkScenario  # type: ignore[import-not-found]  # heavy, its own env

    print(READY_LINE, flush=True)
    finished = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        order = json.loads(line)
        spec = order["spec"]
        spec["backend"] = {**spec["backend"], "api_key": order.get("key") or None}
        started = time.monotonic()
        try:
            args = BenchmarkScenario.create(scenario=None, spec=spec, metadata={"labels": {"run": order["name"]}})
            asyncio.run(benchmark_generative_text(args=args, progress=False, console=None))
        except BaseException:
            traceback.print_exc()
            print(f"quantgate-guidellm: run {finished + 1} ({order['name']}) failed", flush=True)
            return 3
        finished += 1
        print(f"{DONE_PREFIX} {finished} {order['name']} in {time.monotonic() - started:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
