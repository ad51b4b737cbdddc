"""Scoring with lm-eval against a running vLLM server, keeping every per-sample result.

lm-eval runs as its own command line (`python -m lm_eval run --model local-completions ...`) from the
project environment, so the scores are exactly what a user gets from lm-eval by hand against the same
server. What is read back, per eval set (the task's name and primary metric come from its EvalSet):

- the set's score: `results_<date_id>.json`, key "<metric>,<first filter>" of the task's results;
- per item, the metric's value as lm-eval logged it: `samples_<task>_<date_id>.jsonl` of that same run
  (the exact task name: `payment` never reads `payment_reference`'s file), the records of the first
  filter only (lm-eval writes one record per item and filter). A mean-aggregated metric logs a number,
  a corpus metric a list ([gold, prediction], [loglikelihood, words or bytes]) that its aggregation reads.

Sets that ask for the model's chat template (`metadata.chat_template: true`) or a system instruction are
scored in an lm-eval run of their own per distinct (chat_template, system_instruction): with
`--apply_chat_template` lm-eval renders the prompt through the tokenizer's chat template, which
local-completions does only with `tokenized_requests=True` (lm_eval/models/api_models.py:
TemplateAPI.apply_chat_template; with False it hands a JSON message list to /v1/completions). So a chat
run sends token ids, tokenized without special tokens (the template writes its own BOS), for
generate_until and for the log-likelihoods of multiple choice alike.

While lm-eval runs, its log is followed for tqdm's "Requesting API: n/total" and fed to the product's
progress bar (pipelines.console.progress).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.console.output import progress
from pipelines.console.progress import Bar, track
from pipelines.errors import EvalError, InputError
from pipelines.evaluation.evalsets import ROLLING, EvalSet, materialize_task
from pipelines.evaluation.metrics import POINTS, MetricSpec
from pipelines.files.jsonl import MiB, iter_jsonl
from pipelines.serve.reclaim import die_with_parent
from pipelines.serve.serving import RunningServer, log_tail

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
    num_concurrent: int = 16, *, chat_template: bool = False, system_instruction: str | None = None,
) -> list[str]:
    """lm-eval's command line. chat_template: --apply_chat_template, with token-id requests (the only way
    local-completions applies a template); system_instruction: --system_instruction."""
    model_args = ",".join(
        [
            f"model={server.served_name}",
            f"base_url={server.base_url}/completions",
            f"tokenizer={tokenizer_dir}",
            f"tokenized_requests={chat_template}",
            f"num_concurrent={num_concurrent}",
            "max_retries=3",
            f"timeout={int(server.request_timeout_s)}",
        ]
    )
    command = [
        sys.executable, "-m", "lm_eval", "run",
        "--model", "local-completions",
        "--model_args", model_args,
        "--tasks", ",".join(task_names),
        "--include_path", str(include_dir),
        "--log_samples",
        "--output_path", str(output_dir),
        "--seed", "0",
    ]
    if chat_template:
        command.append("--apply_chat_template")  # fewshot_as_multiturn follows (lm-eval's default with it)
    if system_instruction is not None:
        command += ["--system_instruction", system_instruction]
    return command


LM_EVAL_SCRATCH = "lm-eval-scratch"  # beside lm-eval's log: its datasets cache and temporary files, removed when it ends


def lm_eval_environment(server: RunningServer, scratch: Path | None = None) -> dict[str, str]:
    """lm-eval's environment: the server's API key goes here, not on the command line (`ps` shows that).
    local-completions reads OPENAI_API_KEY and sends it as `Authorization: Bearer` (lm_eval/models/
    openai_completions.py: LocalCompletionsAPI.api_key, api_models.py: TemplateAPI.header).

    DISABLE_MULTIPROC=1: lm-eval's bootstrap of a non-mean metric's stderr then runs in-process, with the
    same seeds and the same values (lm_eval/api/metrics.py: bootstrap_stderr), instead of in a Pool of
    forked workers that the parent-death signal would not reach; lm-eval then starts no lasting process.

    `scratch` (a folder inside the run folder): the datasets cache lm-eval's `datasets` writes the set's JSON
    into (HF_DATASETS_CACHE, else ~/.cache/huggingface/datasets) and its temporary files (TMPDIR)."""
    env = dict(os.environ)
    env.pop("OPENAI_API_KEY", None)  # never a user's real OpenAI key towards a local server
    env["DISABLE_MULTIPROC"] = "1"
    if server.api_key:
        env["OPENAI_API_KEY"] = server.api_key
    if scratch is not None:
        env.update(HF_DATASETS_CACHE=str(scratch / "datasets"), TMPDIR=str(scratch / "tmp"))
    return env


def materialize_tasks(eval_sets: Iterable[EvalSet], include_dir: Path) -> Path:
    include_dir.mkdir(parents=True, exist_ok=True)
    for eval_set in eval_sets:
        materialize_task(eval_set, include_dir)
    return include_dir


LM_EVAL_FEWSHOT_SEED = 0  # `--seed 0` seeds lm-eval's few-shot sampler too (lm_eval/config/evaluate_config.py)


def load_prompts(eval_set: EvalSet, include_dir: Path, tokenizer_dir: Path | None = None) -> list[Prompt]:
    """The prompts of one set (load_all_prompts for several: lm-eval then reads each task YAML once)."""
    return load_all_prompts([eval_set], include_dir, tokenizer_dir)[eval_set.name]


def load_all_prompts(eval_sets: list[EvalSet], include_dir: Path, tokenizer_dir: Path | None = None) -> dict[str, list[Prompt]]:
    """The text lm-eval sends per item of every set, built by lm-eval's own code: the task's fewshot_context
    (description, few-shot examples, system instruction) and, for a chat set, lm-eval's local-completions
    chat templating with the tokenizer in `tokenizer_dir`. A rolling set sends its doc_to_target alone.

    One TaskManager for the include folder loads every set's task in one call: lm-eval reads each task YAML
    twice (its index, then the task), not once per set it indexes for each set loaded.

    Without `tokenizer_dir` a chat set's prompts are its raw prompts (a warning says so): KL is then
    measured on text that is not what lm-eval sent."""
    if not eval_sets:
        return {}
    from lm_eval.tasks import TaskManager  # heavy: imported when used

    with datasets_cache(Path(include_dir).parent):
        manager = TaskManager(include_path=str(include_dir), include_defaults=False)
        tasks = manager.load([s.task_name for s in eval_sets])["tasks"]
        return {s.name: _task_prompts(s, tasks[s.task_name], tokenizer_dir) for s in eval_sets}


@contextmanager
def datasets_cache(parent: Path) -> Iterator[Path]:
    """In this process, the redirect the lm-eval subprocess gets (lm_eval_environment): `datasets` writes every JSON file
    it loads into its cache, HF_DATASETS_CACHE as read when it was imported (else ~/.cache/huggingface/datasets, outside
    the artifacts root). For the block its cache is a fresh folder in `parent` (beside the materialized tasks, inside the
    run folder), removed when the block ends, however it ends."""
    import datasets.config as config

    names = ("HF_DATASETS_CACHE", "DOWNLOADED_DATASETS_PATH", "EXTRACTED_DATASETS_PATH")
    saved = {name: getattr(config, name) for name in names}
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{LM_EVAL_SCRATCH}-datasets-", dir=parent))
    config.HF_DATASETS_CACHE = folder
    config.DOWNLOADED_DATASETS_PATH = folder / config.DOWNLOADED_DATASETS_DIR
    config.EXTRACTED_DATASETS_PATH = config.DOWNLOADED_DATASETS_PATH / config.EXTRACTED_DATASETS_DIR
    try:
        yield folder
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        shutil.rmtree(folder, ignore_errors=True)


def _task_prompts(eval_set: EvalSet, task, tokenizer_dir: Path | None) -> list[Prompt]:
    if eval_set.output_type == ROLLING:  # lm_eval/api/task.py: construct_requests
        return [Prompt(doc_id=index, text=str(task.doc_to_target(doc))) for index, doc in enumerate(task.eval_docs)]
    chat = None
    if eval_set.chat_template:
        if tokenizer_dir is None:
            progress(f"eval set {eval_set.name}: KL is measured on the raw prompt, not the chat-templated one lm-eval sends")
        else:
            chat = _lm_eval_chat_template(eval_set, tokenizer_dir)
    num_fewshot = task.get_config("num_fewshot") or 0
    if num_fewshot:
        task.set_fewshot_seed(seed=LM_EVAL_FEWSHOT_SEED)
    prompts = []
    for index, doc in enumerate(task.eval_docs):
        context = task.fewshot_context(
            doc, num_fewshot, system_instruction=eval_set.system_instruction, apply_chat_template=chat is not None,
            fewshot_as_multiturn=chat is not None, chat_template=chat, gen_prefix=task.doc_to_prefix(doc),
        )
        prompts.append(Prompt(doc_id=index, text=str(context[0] if isinstance(context, list) else context)))
    return prompts


def _lm_eval_chat_template(eval_set: EvalSet, tokenizer_dir: Path):
    """lm-eval's own apply_chat_template of local-completions as a chat run uses it (huggingface tokenizer,
    tokenized_requests=True: the template rendered to text by the tokenizer). A model without a chat
    template is refused here, before any server starts."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI  # heavy: imported when used

    model = LocalCompletionsAPI(
        base_url="http://127.0.0.1:1/v1/completions", tokenizer=str(tokenizer_dir), tokenizer_backend="huggingface",
        tokenized_requests=True,
    )
    if not getattr(model.tokenizer, "chat_template", None):
        raise InputError(
            f"eval set {eval_set.name} asks for the model's chat template (metadata.chat_template) but the tokenizer has none",
            file=tokenizer_dir, field="chat_template",
        )
    return model.apply_chat_template


ANSWER_RESERVE_TOKENS = 32  # tokens every prompt leaves free for its answer in the served context


def load_tokenizer(folder: Path) -> Any:
    """The model folder's tokenizer (transformers' AutoTokenizer); one it cannot load is an InputError naming the folder."""
    from transformers import AutoTokenizer  # heavy: imported when used

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as error:  # transformers raises ValueError, OSError, TypeError, ... for a folder it cannot read
        raise InputError(f"cannot load the model's tokenizer: {type(error).__name__}: {error}", file=folder, field="tokenizer") from None


def check_prompt_lengths(eval_set: EvalSet, prompts: list[Prompt], tokenizer_dir: Path, max_model_len: int, reserve: int) -> None:
    """Refuse, before any server starts, an item that cannot fit the served context."""
    tokenizer = load_tokenizer(tokenizer_dir)
    for prompt in prompts:
        length = len(tokenizer(prompt.text)["input_ids"])
        if length + reserve > max_model_len:
            raise EvalError(
                f"item {prompt.doc_id} is {length} tokens; with {reserve} tokens for the answer it exceeds "
                f"max_model_len {max_model_len}",
                file=eval_set.data, field=f"eval set {eval_set.name}",
            )


def lm_eval_groups(eval_sets: list[EvalSet]) -> list[tuple[str, list[EvalSet]]]:
    """The lm-eval runs that score `eval_sets`: one per distinct (chat_template, system_instruction), in the
    order first met, each with the name of its output folder and log (`lm_eval`, `lm_eval-chat`, ...)."""
    groups: dict[tuple[bool, str | None], list[EvalSet]] = {}
    for eval_set in eval_sets:
        groups.setdefault(eval_set.lm_eval_options, []).append(eval_set)
    named, used = [], set()
    for (chat, instruction), members in groups.items():
        base = "lm_eval" + ("-chat" if chat else "") + ("-system" if instruction is not None else "")
        name, number = base, 2
        while name in used:
            name, number = f"{base}{number}", number + 1
        used.add(name)
        named.append((name, members))
    return named


def score_eval_sets(
    server: RunningServer, tokenizer_dir: Path, eval_sets: list[EvalSet], include_dir: Path, work_dir: Path,
    deadline: ScoringDeadline | None = None,
) -> dict[str, SetScore]:
    """Run lm-eval against `server` (once per group of sets with the same chat options); return per-set
    scores with per-item results. `deadline`: stop when the measured pace projects past the policy's limit."""
    scores: dict[str, SetScore] = {}
    for name, members in lm_eval_groups(eval_sets):
        chat, instruction = members[0].lm_eval_options
        output_dir, log_path = work_dir / name, work_dir / f"{name}.log"
        command = lm_eval_command(
            server, tokenizer_dir, [s.task_name for s in members], include_dir, output_dir,
            chat_template=chat, system_instruction=instruction,
        )
        how = " with the chat template" if chat else ""
        progress(f"scoring {', '.join(s.name for s in members)} with lm-eval{how} against {server.served_name} (log: {log_path})")
        started = time.monotonic()
        requests = [s.num_requests for s in members if s.num_requests is not None]
        total = sum(requests) if len(requests) == len(members) else None  # unknown when one set's count is
        with track(f"scoring {server.served_name}", total=total, unit="request") as bar:
            _run_watching_server(command, server, log_path, bar=bar, deadline=deadline)
            if total is not None:
                bar.update(completed=total)  # lm-eval finished: every request was answered
                if deadline is not None:
                    deadline.done_before += total
        elapsed = time.monotonic() - started
        run = read_lm_eval_run(output_dir, log_path)
        for eval_set in members:
            scores[eval_set.name] = read_set_score(eval_set, run, elapsed / len(members))
            score = scores[eval_set.name]
            progress(f"  {score.eval_set}: {score.metric.name} = {_shown(score)} over {score.n} items")
    return {s.name: scores[s.name] for s in eval_sets}


def _shown(score: SetScore) -> str:
    return f"{100 * score.score:.1f}%" if score.metric.unit == POINTS else f"{score.score:.4g}"


class RequestCounter:
    """Requests lm-eval has finished, read from its log: tqdm's "Requesting API: 45%|...| 675/1500 [...]".

    lm-eval (lm_eval/models/api_models.py) shows one such bar per batch of requests (the log-likelihoods,
    then each group of generation settings), each redrawn after a carriage return and closed with a
    newline; a bar that starts over (a smaller count or another total) or a closed one is added to the
    finished count."""

    _BAR = re.compile(r"Requesting API:\s*\d+%\|[^|\r\n]*\|\s*(\d+)/(\d+)")
    _SEGMENT = re.compile(r"([^\r\n]*)([\r\n])")

    def __init__(self) -> None:
        self._carry = ""
        self._finished = 0
        self._current: tuple[int, int] | None = None

    @property
    def done(self) -> int:
        return self._finished + (self._current[0] if self._current else 0)

    def feed(self, text: str) -> int:
        data = self._carry + text
        cut = max(data.rfind("\r"), data.rfind("\n"))
        complete, self._carry = data[: cut + 1], data[cut + 1 :]
        for segment, separator in self._SEGMENT.findall(complete):
            match = self._BAR.search(segment)
            if match is None:
                continue
            count, total = int(match.group(1)), int(match.group(2))
            if self._current is not None and (total != self._current[1] or count < self._current[0]):
                self._finished += self._current[0]
            self._current = (count, total)
            if separator == "\n":  # tqdm closed the bar
                self._finished += count
                self._current = None
        if len(self._carry) > 4096:  # a line that never ends is no bar
            self._carry = self._carry[-4096:]
        return self.done


class ScoringDeadline(BaseModel):
    """The policy's max_scoring_time_s, held against the measured pace: once `min_elapsed_s` have passed, scoring
    stops (exit 2) as soon as the requests answered so far project past the limit, or when it is reached."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    limit_s: float
    policy_file: Path
    total: int | None  # requests of every set the role scores
    min_elapsed_s: float = 30.0
    started: float = Field(default_factory=lambda: time.monotonic())
    done_before: int = 0  # requests of the lm-eval groups already finished

    def check(self, completed: int) -> None:
        elapsed = time.monotonic() - self.started
        answered = self.done_before + completed
        projected = elapsed / answered * self.total if answered and self.total else None
        if elapsed > self.limit_s or (elapsed >= self.min_elapsed_s and projected is not None and projected > self.limit_s):
            pace = f"{answered:,} of {self.total:,} requests in {elapsed:.0f} s" if self.total else f"{elapsed:.0f} s"
            raise InputError(
                f"candidate scoring projected at {projected or elapsed:,.0f} s ({pace}) > max_scoring_time_s {self.limit_s:g}: stopped",
                file=self.policy_file, field="max_scoring_time_s",
            )


class _LogFollower:
    """Reads what lm-eval appended to its log since the last call and moves the progress bar."""

    def __init__(self, log_path: Path, bar: Bar | None) -> None:
        self._path, self._bar = log_path, bar
        self._offset = 0
        self._counter = RequestCounter()
        self.completed = 0

    def poll(self) -> None:
        if self._bar is None:
            return
        try:
            with self._path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read(1 << 20)
        except OSError:
            return
        self._offset += len(chunk)
        self.completed = self._counter.feed(chunk.decode("utf-8", errors="replace"))
        self._bar.update(completed=self.completed)


@contextmanager
def _removed_after(folder: Path) -> Iterator[None]:
    """`folder` removed when the block ends, however it ends (it holds caches, not evidence)."""
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_watching_server(
    command: list[str], server: RunningServer, log_path: Path, bar: Bar | None = None, deadline: ScoringDeadline | None = None,
) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    follower = _LogFollower(log_path, bar)
    scratch = log_path.parent / f"{LM_EVAL_SCRATCH}-{log_path.stem}"
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log, _removed_after(scratch):
        # Dies with `quantize` however it ends (SIGKILL included); it starts no lasting process (lm_eval_environment).
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=lm_eval_environment(server, scratch),
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
        try:
            while process.poll() is None:
                if server.process.poll() is not None:
                    process.kill()
                    server.check_alive()
                follower.poll()
                if deadline is not None:
                    deadline.check(follower.completed)
                time.sleep(0.5)
            follower.poll()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    server.check_alive()
    if process.returncode != 0:

        server.check_engine()
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


# lm-eval's per-sample file (written by the product's own lm-eval run): each line holds an item, its prompt
# (up to 1,000,000 characters, once per choice) and the responses, so it is held to wider bounds than a data file.
SAMPLE_LINE_BYTES = 256 * MiB
SAMPLES_FILE_BYTES = 16 * 1024 * MiB


def read_items(eval_set: EvalSet, samples_file: Path) -> list[ItemScore]:
    """The first filter's record of every item, in set order. A NaN or infinite value (lm-eval writes them as the bare
    literals `NaN` / `-Infinity`) is read as that number, and so is an item whose logged loglikelihoods are not finite (the
    servers' shim sends NaN log-probabilities as literals: pipelines.hardware.emulation): a candidate's is the gate's to
    reject naming the items, a baseline's is an error (pipelines.gate.pairing)."""
    if not samples_file.is_file():
        raise EvalError(f"lm-eval wrote no per-sample file for task {eval_set.task_name}", file=samples_file)
    items = [
        _item(record, eval_set, samples_file, number)
        for number, record in iter_jsonl(samples_file, max_line_bytes=SAMPLE_LINE_BYTES, max_file_bytes=SAMPLES_FILE_BYTES,
                                         non_finite=True)
        if record.get("filter") == eval_set.filter_name
    ]
    return sorted(items, key=lambda item: item.doc_id)


# The output types whose responses lm-eval logs as loglikelihoods ([loglikelihood, is_greedy] pairs, or one number).
LOGLIKELIHOOD_TYPES = frozenset({"multiple_choice", "loglikelihood", ROLLING})


def _item(record: dict, eval_set: EvalSet, samples_file: Path, number: int) -> ItemScore:
    metric = eval_set.metric.name
    if metric not in record:
        raise EvalError(f"the sample record has no value of {metric!r}", file=samples_file, field=f"line {number}")
    value = record[metric]
    if eval_set.output_type in LOGLIKELIHOOD_TYPES and _non_finite_response(record.get("filtered_resps")):
        # lm-eval turns NaN loglikelihoods into a finite accuracy (argmax picks the first NaN): no measurement at all.
        value = value if _non_finite_response(value) else math.nan
    try:
        return ItemScore(doc_id=record.get("doc_id"), doc_hash=record.get("doc_hash"), value=value)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(map(str, problem["loc"]))
        raise EvalError(f"{where}: {problem['msg']} (got {problem['input']!r})", file=samples_file, field=f"line {number}") from None


def _non_finite_response(responses: object) -> bool:
    """Whether a loglikelihood lm-eval logged (as a number, or as its text: "nan", "-inf") is NaN or infinite."""
    if isinstance(responses, list):
        return any(_non_finite_response(response) for response in responses)
    if isinstance(responses, str):
        try:
            responses = float(responses)
        except ValueError:  # the is_greedy flag ("True" / "False")
            return False
    return isinstance(responses, float) and not math.isfinite(responses)
