"""Scoring with lm-eval against a running vLLM server, keeping every per-sample result.

lm-eval runs as its own command line (`python -m lm_eval run --model local-completions ...`) from the
project environment, so the scores are exactly what a user gets from lm-eval by hand against the same
server. What is read back, per eval set (the task's name and primary metric come from its EvalSet):

- the set's score: `results_<date_id>.json`, key "<metric>,<first filter>" of the task's results;
- per item, the metric's value as lm-eval logged it: `samples_<task>_<date_id>.jsonl` of that same run
  (the exact task name: `payment` never reads `payment_reference`'s file), the records of the first
  filter only (lm-eval writes one record per item and filter). A mean-aggregated metric logs a number,
  a corpus metric a list ([gold, prediction], [loglikelihood, words or bytes]) that its aggregation reads.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from pipelines.errors import EvalError
from pipelines.evalsets import ROLLING, EvalSet, iter_jsonl, materialize_task
from pipelines.metrics import POINTS, MetricSpec
from pipelines.output import progress
from pipelines.reclaim import die_with_parent
from pipelines.serving import RunningServer

# lm-eval names a run's files by datetime.now().isoformat() with ":" made "-"
# (lm_eval/loggers/evaluation_tracker.py: save_results_aggregated, save_results_samples).
DATE_ID = r"\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(?:\.\d+)?"
RESULTS_FILE = re.compile(rf"results_({DATE_ID})\.json")


class ItemScore(BaseModel):
    """One item as lm-eval logged it: its position in the set, its doc_hash and the metric's value."""

    doc_id: int
    doc_hash: str
    value: float | list

    @property
    def item_id(self) -> str:
        """Unique within a set even when two items are identical (same doc_hash)."""
        return f"{self.doc_id}:{self.doc_hash}"


class SetScore(BaseModel):
    eval_set: str
    eval_set_sha256: str
    metric: MetricSpec
    score: float  # lm-eval's aggregate, in the metric's own scale
    n: int
    items: list[ItemScore]
    wall_s: float


class Prompt(BaseModel):
    doc_id: int
    text: str


@dataclass(frozen=True)
class LmEvalRun:
    """One lm-eval run's output: its results file, parsed, and where its per-sample files are."""

    results: dict
    folder: Path
    date_id: str

    def samples_file(self, task_name: str) -> Path:
        return self.folder / f"samples_{task_name}_{self.date_id}.jsonl"


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


def lm_eval_environment(server: RunningServer) -> dict[str, str]:
    """lm-eval's environment: the server's API key goes here, not on the command line (`ps` shows that).
    local-completions reads OPENAI_API_KEY and sends it as `Authorization: Bearer` (lm_eval/models/
    openai_completions.py: LocalCompletionsAPI.api_key, api_models.py: TemplateAPI.header).

    DISABLE_MULTIPROC=1: lm-eval's bootstrap of a non-mean metric's stderr then runs in-process, with the
    same seeds and the same values (lm_eval/api/metrics.py: bootstrap_stderr), instead of in a Pool of
    forked workers that the parent-death signal would not reach; lm-eval then starts no lasting process."""
    env = dict(os.environ)
    env.pop("OPENAI_API_KEY", None)  # never a user's real OpenAI key towards a local server
    env["DISABLE_MULTIPROC"] = "1"
    if server.api_key:
        env["OPENAI_API_KEY"] = server.api_key
    return env


def materialize_tasks(eval_sets: Iterable[EvalSet], include_dir: Path) -> Path:
    include_dir.mkdir(parents=True, exist_ok=True)
    for eval_set in eval_sets:
        materialize_task(eval_set, include_dir)
    return include_dir


def load_prompts(eval_set: EvalSet, include_dir: Path) -> list[Prompt]:
    """The text lm-eval sends per item, rendered by its own task loader so templates agree."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_dir), include_defaults=False)
    task = manager.load(eval_set.task_name)["tasks"][eval_set.task_name]
    # A rolling set sends doc_to_target alone (lm_eval/api/task.py, construct_requests).
    render = task.doc_to_target if eval_set.output_type == ROLLING else task.doc_to_text
    return [Prompt(doc_id=index, text=str(render(doc))) for index, doc in enumerate(task.eval_docs)]


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
    command = lm_eval_command(server, tokenizer_dir, [s.task_name for s in eval_sets], include_dir, output_dir)
    progress(f"scoring {', '.join(s.name for s in eval_sets)} with lm-eval against {server.served_name} (log: {log_path})")
    started = time.monotonic()
    _run_watching_server(command, server, log_path)
    elapsed = time.monotonic() - started
    run = read_lm_eval_run(output_dir, log_path)
    scores = {s.name: read_set_score(s, run, elapsed / len(eval_sets)) for s in eval_sets}
    for score in scores.values():
        progress(f"  {score.eval_set}: {score.metric.name} = {_shown(score)} over {score.n} items")
    return scores


def _shown(score: SetScore) -> str:
    return f"{100 * score.score:.1f}%" if score.metric.unit == POINTS else f"{score.score:.4g}"


def _run_watching_server(command: list[str], server: RunningServer, log_path: Path) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        # Dies with `quantize` however it ends (SIGKILL included); it starts no lasting process (lm_eval_environment).
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=lm_eval_environment(server),
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
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


def read_lm_eval_run(output_dir: Path, log_path: Path | None = None) -> LmEvalRun:
    """The newest lm-eval run under output_dir (lm-eval adds a folder per model name)."""
    found = [(match.group(1), path) for path in output_dir.rglob("results_*.json") if (match := RESULTS_FILE.fullmatch(path.name))]
    if not found:
        raise EvalError("lm-eval wrote no results file", file=log_path or output_dir)
    date_id, path = max(found)
    return LmEvalRun(results=json.loads(path.read_text()), folder=path.parent, date_id=date_id)


def read_set_score(eval_set: EvalSet, run: LmEvalRun, wall_s: float) -> SetScore:
    """The set's primary metric under its first filter: lm-eval's aggregate and every item's value."""
    key = f"{eval_set.metric.name},{eval_set.filter_name}"  # lm-eval's "metric,filter" results key
    task_results = run.results.get("results", {}).get(eval_set.task_name, {})
    if key not in task_results:
        raise EvalError(f"lm-eval reported no {key!r} for task {eval_set.task_name}", file=run.folder / f"results_{run.date_id}.json")
    items = read_items(eval_set, run.samples_file(eval_set.task_name))
    return SetScore(
        eval_set=eval_set.name, eval_set_sha256=eval_set.sha256, metric=eval_set.metric,
        score=float(task_results[key]), n=len(items), items=items, wall_s=wall_s,
    )


def read_items(eval_set: EvalSet, samples_file: Path) -> list[ItemScore]:
    """The first filter's record of every item, in set order."""
    if not samples_file.is_file():
        raise EvalError(f"lm-eval wrote no per-sample file for task {eval_set.task_name}", file=samples_file)
    items = [
        _item(record, eval_set.metric.name, samples_file, number)
        for number, record in iter_jsonl(samples_file)
        if record.get("filter") == eval_set.filter_name
    ]
    return sorted(items, key=lambda item: item.doc_id)


def _item(record: dict, metric: str, samples_file: Path, number: int) -> ItemScore:
    if metric not in record:
        raise EvalError(f"the sample record has no value of {metric!r}", file=samples_file, field=f"line {number}")
    try:
        return ItemScore(doc_id=record.get("doc_id"), doc_hash=record.get("doc_hash"), value=record[metric])
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(map(str, problem["loc"]))
        raise EvalError(f"{where}: {problem['msg']} (got {problem['input']!r})", file=samples_file, field=f"line {number}") from None
