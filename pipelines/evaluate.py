"""Scoring with lm-eval against a running vLLM server, keeping every per-sample result.

lm-eval runs as its own command line (`python -m lm_eval run --model local-completions ...`) from the
project environment, so the scores are exactly what a user gets from lm-eval by hand against the same
server; the per-sample JSONL it writes (--log_samples) is parsed so baseline and candidate items pair up
by lm-eval's doc_hash.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

from pydantic import BaseModel

from pipelines.errors import EvalError
from pipelines.evalsets import EvalSet, load_task_config, materialize_task
from pipelines.output import progress
from pipelines.serving import RunningServer

PRIMARY_METRIC = {"generate_until": "exact_match", "multiple_choice": "acc", "loglikelihood": "acc"}
BINARY_METRICS = {"exact_match", "acc", "acc_norm"}


class ItemScore(BaseModel):
    item_id: str
    doc_id: int
    score: float


class SetScore(BaseModel):
    eval_set: str
    eval_set_sha256: str
    metric: str
    binary: bool
    score: float
    n: int
    items: list[ItemScore]
    wall_s: float


class Prompt(BaseModel):
    doc_id: int
    text: str


def task_name(eval_set: EvalSet) -> str:
    return str(load_task_config(eval_set.task_yaml)["task"])


def primary_metric(eval_set: EvalSet) -> str:
    """The first metric the task YAML lists (lm-eval's own default for its output type otherwise)."""
    metrics = load_task_config(eval_set.task_yaml).get("metric_list") or []
    return str(metrics[0]["metric"]) if metrics else PRIMARY_METRIC.get(eval_set.output_type, "acc")


def lm_eval_command(
    server: RunningServer, tokenizer_dir: Path, task_names: list[str], include_dir: Path, output_dir: Path,
    num_concurrent: int = 16,
) -> list[str]:
    model_args = ",".join(
        [
            f"model={server.served_name}",
            f"base_url={server.base_url}/completions",
            f"tokenizer={tokenizer_dir}",
            "tokenized_requests=False",
            f"num_concurrent={num_concurrent}",
            "max_retries=3",
            f"timeout={int(server.request_timeout_s)}",
        ]
    )
    return [
        sys.executable, "-m", "lm_eval", "run",
        "--model", "local-completions",
        "--model_args", model_args,
        "--tasks", ",".join(task_names),
        "--include_path", str(include_dir),
        "--log_samples",
        "--output_path", str(output_dir),
        "--seed", "0",
    ]


def materialize_tasks(eval_sets: Iterable[EvalSet], include_dir: Path) -> Path:
    include_dir.mkdir(parents=True, exist_ok=True)
    for eval_set in eval_sets:
        materialize_task(eval_set, include_dir)
    return include_dir


def load_prompts(eval_set: EvalSet, include_dir: Path) -> list[Prompt]:
    """The prompts exactly as lm-eval renders them (its own task loader, so templates agree)."""
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=str(include_dir), include_defaults=False)
    task = get_task_dict([task_name(eval_set)], manager)[task_name(eval_set)]
    docs = task.eval_docs
    return [Prompt(doc_id=index, text=str(task.doc_to_text(doc))) for index, doc in enumerate(docs)]


def check_prompt_lengths(eval_set: EvalSet, prompts: list[Prompt], tokenizer_dir: Path, max_model_len: int, reserve: int) -> None:
    """Refuse, before any server starts, an item that cannot fit the served context."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for prompt in prompts:
        length = len(tokenizer(prompt.text)["input_ids"])
        if length + reserve > max_model_len:
            raise EvalError(
                f"item {prompt.doc_id} is {length} tokens; with {reserve} tokens for the answer it exceeds "
                f"max_model_len {max_model_len}",
                file=eval_set.data, field=f"eval set {eval_set.name}",
            )


def score_eval_sets(
    server: RunningServer, tokenizer_dir: Path, eval_sets: list[EvalSet], include_dir: Path, work_dir: Path,
) -> dict[str, SetScore]:
    """Run lm-eval once for all sets against `server`; return per-set scores with per-item results."""
    output_dir = work_dir / "lm_eval"
    log_path = work_dir / "lm_eval.log"
    command = lm_eval_command(server, tokenizer_dir, [task_name(s) for s in eval_sets], include_dir, output_dir)
    progress(f"scoring {', '.join(s.name for s in eval_sets)} with lm-eval against {server.served_name} (log: {log_path})")
    started = time.monotonic()
    _run_watching_server(command, server, log_path)
    elapsed = time.monotonic() - started
    results = _read_results(output_dir, log_path)
    scores = {s.name: _set_score(s, results, output_dir, elapsed / len(eval_sets)) for s in eval_sets}
    for score in scores.values():
        progress(f"  {score.eval_set}: {score.metric} = {100 * score.score:.1f}% over {score.n} items")
    return scores


def _run_watching_server(command: list[str], server: RunningServer, log_path: Path) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while process.poll() is None:
                if server.process.poll() is not None:
                    process.kill()
                    server.check_alive()
                time.sleep(0.5)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    server.check_alive()
    if process.returncode != 0:
        from pipelines.serving import log_tail

        raise EvalError(f"lm-eval failed (exit code {process.returncode}): {log_tail(log_path, 3)}", file=log_path)


def _read_results(output_dir: Path, log_path: Path) -> dict:
    found = sorted(output_dir.rglob("results_*.json"))
    if not found:
        raise EvalError("lm-eval wrote no results file", file=log_path)
    return json.loads(found[-1].read_text())


def _set_score(eval_set: EvalSet, results: dict, output_dir: Path, wall_s: float) -> SetScore:
    metric = primary_metric(eval_set)
    task_results = results["results"].get(task_name(eval_set), {})
    key = next((k for k in task_results if k.split(",")[0] == metric), None)
    if key is None:
        raise EvalError(f"lm-eval reported no '{metric}' for task {task_name(eval_set)}", file=eval_set.task_yaml)
    items = _read_items(eval_set, metric, output_dir)
    return SetScore(
        eval_set=eval_set.name, eval_set_sha256=eval_set.sha256, metric=metric,
        binary=metric in BINARY_METRICS, score=float(task_results[key]), n=len(items), items=items, wall_s=wall_s,
    )


def _read_items(eval_set: EvalSet, metric: str, output_dir: Path) -> list[ItemScore]:
    files = sorted(output_dir.rglob(f"samples_{task_name(eval_set)}_*.jsonl"))
    if not files:
        raise EvalError(f"lm-eval wrote no per-sample file for task {task_name(eval_set)}", file=output_dir)
    items = []
    for line in files[-1].read_text().splitlines():
        record = json.loads(line)
        items.append(ItemScore(item_id=record["doc_hash"], doc_id=int(record["doc_id"]), score=float(record[metric])))
    return sorted(items, key=lambda item: item.doc_id)
