"""The canary against swapped weights (docs/watch.md, "The canary, measured"):

    python -m pipelines.benchmarks.canary_swap --bundle artifacts/promoted/demo-llama/v2 \
        --other w4a16=artifacts/candidates/demo-llama/w4a16-... --other base=models/demo-llama [--probes 2]

Fixes a golden set on the bundle's own server (as a promotion does), probes it `--probes` times alone and as many times
while clients send sampled requests, then serves each `--other` folder under the same served name and probes it alike.
Prints one line per probe (prompts disagreeing, the per-prompt log-probability shift and KL, wall time) and writes every
probe's CanaryResult to `--out`. Not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pipelines.canary.build import DEFAULT_PROMPTS, build_golden, draw, sources_of
from pipelines.canary.golden import GoldenSet
from pipelines.canary.probe import CanaryResult, probe_canary
from pipelines.evaluation.evalsets import select_eval_sets
from pipelines.evaluation.evaluate import load_all_prompts, materialize_tasks
from pipelines.paths import DEMO_EVAL_SETS
from pipelines.serve.serving import LOOPBACK, RunningServer, ServeSettings, vllm_server

SERVED_NAME = "canary-under-test"
LOAD_CLIENTS = 8


@contextmanager
def background_load(server: RunningServer, texts: list[str]) -> Iterator[None]:
    """LOAD_CLIENTS clients sending sampled 32-token completions until the block ends."""
    stop = threading.Event()

    def client(offset: int) -> None:
        with httpx.Client(timeout=60) as http:
            index = offset
            while not stop.is_set():
                try:
                    http.post(f"{server.base_url}/completions", headers=server.auth_headers,
                              json={"model": SERVED_NAME, "prompt": texts[index % len(texts)], "max_tokens": 32, "temperature": 0.7})
                except httpx.HTTPError:
                    pass
                index += LOAD_CLIENTS

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(LOAD_CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)


def probes(server: RunningServer, golden: GoldenSet, label: str, count: int, texts: list[str]) -> list[dict]:
    rows = []
    for loaded in (False, True):
        with background_load(server, texts) if loaded else _nothing():
            for _ in range(count):
                result = probe_canary(f"http://{LOOPBACK}:{server.port}", model=SERVED_NAME, golden=golden, api_key=server.api_key,
                                      timeout_s=300)
                rows.append({"server": label, "under_load": loaded, **result.model_dump(mode="json")})
                print(_line(label, loaded, result), flush=True)
    return rows


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _line(label: str, loaded: bool, result: CanaryResult) -> str:
    shifts = sorted(check.shift or 0.0 for check in result.checks) or [0.0]
    kl = max((check.kl or 0.0 for check in result.checks), default=0.0)
    return (f"{label:>12} {'load ' if loaded else 'alone'} {result.wall_s:6.2f} s  {len(result.disagreeing):>3} of {result.total} disagree"
            f"  shift min/median/max {shifts[0]:.3g}/{shifts[len(shifts) // 2]:.3g}/{shifts[-1]:.3g} nats  max KL {kl:.2g}"
            + (f"  error: {result.error}" if result.error else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.benchmarks.canary_swap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="the promoted version's folder (its golden set is fixed on it)")
    parser.add_argument("--other", action="append", default=[], metavar="LABEL=FOLDER", help="weights served under the same name")
    parser.add_argument("--eval-sets", default=",".join(DEMO_EVAL_SETS))
    parser.add_argument("--probes", type=int, default=2, help="probes alone, and as many under load, per server (default 2)")
    parser.add_argument("--out", type=Path, default=Path("canary-swap.json"))
    args = parser.parse_args(argv)
    others = [tuple(item.split("=", 1)) for item in args.other]
    sets = select_eval_sets(args.eval_sets.split(","))
    work = args.out.with_suffix(".work")
    prompts = load_all_prompts(sets, materialize_tasks(sets, work / "tasks"), args.bundle)
    sources = sources_of(prompts, {s.name: s.chat_template for s in sets})
    texts = [p.text for items in prompts.values() for p in items]
    settings, rows = ServeSettings(), []
    with vllm_server(args.bundle, log_path=work / "bundle.log", settings=settings, served_name=SERVED_NAME) as server:
        golden = build_golden(f"http://{LOOPBACK}:{server.port}", model=SERVED_NAME, api_key=server.api_key,
                              drawn=draw(sources, DEFAULT_PROMPTS, 0), seed=0, timeout_s=300)
        print(f"golden set: {len(golden.prompts)} prompts in {golden.build_s:.1f} s; tolerance "
              f"{golden.tolerance.model_dump(exclude={'rule', 'self_checks'})}", flush=True)
        rows += probes(server, golden, "promoted", args.probes, texts)
    for label, folder in others:
        with vllm_server(Path(folder), log_path=work / f"{label}.log", settings=settings, served_name=SERVED_NAME) as server:
            rows += probes(server, golden, label, args.probes, texts)
    args.out.write_text(json.dumps({"golden": golden.model_dump(mode="json"), "probes": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
