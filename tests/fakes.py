"""Fakes shared by the unit tests: real files in tmp folders, validated by the product's own code, and the
stand-ins for vLLM, lm-eval and the KL requests (FakeStack; its fixtures are in tests/unit/conftest.py).

Every helper more than one test module uses lives here (or, for the end-to-end tests only, in
tests/integration/helpers.py): no test module imports from another test module or from a conftest.py."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pipelines.artifact import MANIFEST_FILES_KEY
from pipelines.evaluation.divergence import Reference
from pipelines.evaluation.evalsets import EvalSet, validate_eval_set
from pipelines.evaluation.evaluate import ItemScore, Prompt, SetScore
from pipelines.evaluation.metrics import make_spec
from pipelines.files.hashing import file_hashes
from pipelines.gate.policy import DEFAULT_POLICY, Policy, SetPolicy, load_policy
from pipelines.gate.schema import FitCheck, GateReport
from pipelines.gate.verdict import PairedItem, SetComparison, decide
from pipelines.jobs import job as job_module
from pipelines.recipe import LoadedRecipe
from pipelines.registry.promotion import promote_signed
from pipelines.registry.signing import SignatureRecord
from pipelines.registry.store import EvalSetRef, NewVersion, Registry, Version
from pipelines.runs import runner
from pipelines.runs.runner import RunOutcome
from pipelines.runs.stack import GateStack
from pipelines.serve.serving import ServeSettings

N_ITEMS = 120
TOKEN = "token_id:7"

# --------------------------------------------------------------------------------- eval sets

# A valid generate_until task; write_eval_set sets `task` to the set's name.
TASK_CONFIG = {
    "task": "refunds",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": "data.jsonl"}},
    "test_split": "test",
    "output_type": "generate_until",
    "doc_to_text": "Question: {{question}}\nAnswer:",
    "doc_to_target": "answer",
}


def write_eval_set(
    root: Path, name: str, task: dict | bytes | None, data: bytes | Iterable[dict | str], *, set_file: bytes | None = None,
) -> Path:
    """An eval-set folder as a user writes one: root/name/name.yaml (a dict is dumped, bytes written as
    they are; None: no task YAML), set.yaml when given, and data.jsonl (objects or lines, one per line, or bytes)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    if task is not None:
        (folder / f"{name}.yaml").write_bytes(task if isinstance(task, bytes) else yaml.safe_dump(task, sort_keys=False).encode())
    if set_file is not None:
        (folder / "set.yaml").write_bytes(set_file)
    if not isinstance(data, bytes):
        data = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in data).encode()
    (folder / "data.jsonl").write_bytes(data)
    return folder


def make_eval_set(root: Path, name: str = "tickets", answers: str = "abc", items: int = N_ITEMS) -> EvalSet:
    """A real eval set folder (task YAML, data, a `!function` helper), validated by pipelines.evaluation.evalsets."""
    task = {**TASK_CONFIG, "task": name, "doc_to_text": "{{q}}", "doc_to_target": "{{a}}"}
    folder = write_eval_set(root, name, task, [{"q": f"q{i}", "a": answers} for i in range(items)])
    (folder / "utils.py").write_text("def process(doc):\n    return doc\n")
    return validate_eval_set(folder)


# --------------------------------------------------------------------------------- model folders

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
    "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False, "dtype": "bfloat16",
}


def make_model(folder: Path, *, manifest: bool = False) -> Path:
    """A model folder the runner and the planner (the default policy's fit check) can read; no real weights."""
    import numpy
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    save_file({"lm_head.weight": numpy.full((4, 4), len(folder.name), dtype=numpy.float16)}, str(folder / "model.safetensors"))
    if manifest:
        (folder / "manifest.json").write_text(json.dumps({MANIFEST_FILES_KEY: file_hashes(folder)}))
    return folder


# Python source that starves the process running it, for real: pinned to one CPU beside a busy competitor at normal
# priority in the same session (one autogroup) but another process group, it turns SCHED_IDLE and spins: always runnable,
# given about 0.3% of the CPU. The competitor exits with its parent or after STARVE_FOR_S.
STARVE_FOR_S = 60
STARVE_SOURCE = f"""
import os, time
cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {{cpu}})
if os.fork() == 0:
    os.setpgid(0, 0)
    parent, until = os.getppid(), time.monotonic() + {STARVE_FOR_S}
    while time.monotonic() < until and os.getppid() == parent:
        sum(range(100_000))
    os._exit(0)
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


def write_serve_python(venv: Path, script: str) -> Path:
    """A stand-in serve environment: venv/bin/python is the shell `script` (point QUANTGATE_SERVE_VENV at venv)."""
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(script)
    python.chmod(0o755)
    return python


# --------------------------------------------------------------------------------- the serving stack


class FakeStack:
    """Stands in for vLLM + lm-eval + the KL requests; `lost` candidate items score 0, `renamed` change doc_hash."""

    def __init__(self) -> None:
        self.starts: list[str] = []
        self.scored: list[tuple[str, list[str]]] = []
        self.lost = 0
        self.renamed: set[int] = set()
        self.unstable: set[int] = set()  # items the baseline's second scoring (the noise floor) answers wrong
        self.fail_candidate: BaseException | None = None

    @contextmanager
    def server(self, model_dir: Path, *, log_path: Path, settings=None, served_name: str = "model", port=None):
        self.starts.append(served_name)
        log_path.write_text(f"fake vLLM serving {model_dir}\n")
        yield SimpleNamespace(served_name=served_name, model_dir=model_dir, startup_s=1.5)

    def score(self, server, tokenizer_dir, eval_sets, include_dir, work_dir, deadline=None) -> dict[str, SetScore]:
        assert all((include_dir / s.task_yaml.name).is_file() for s in eval_sets), "tasks not materialized"
        if server.served_name == "candidate" and self.fail_candidate is not None:
            raise self.fail_candidate
        self.scored.append((server.served_name, [s.name for s in eval_sets]))
        return {s.name: self._set_score(s, server.served_name) for s in eval_sets}

    def _set_score(self, eval_set: EvalSet, served_name: str) -> SetScore:
        candidate = served_name == "candidate"
        items = [
            ItemScore(
                doc_id=i, doc_hash=f"{eval_set.name}-{i}" + ("-other" if candidate and i in self.renamed else ""),
                value=0.0 if (candidate and i < self.lost) or (served_name == "baseline_repeat" and i in self.unstable) else 1.0,
            )
            for i in range(N_ITEMS)
        ]
        return SetScore(
            eval_set=eval_set.name, eval_set_sha256=eval_set.sha256, metric=eval_set.metric,
            score=sum(item.value for item in items) / N_ITEMS, n=N_ITEMS, items=items, wall_s=0.1,
        )

    @staticmethod
    def references(server, prompts, *, add_special_tokens: bool = True) -> list[Reference]:
        return [Reference(doc_id=i, prompt_ids=[1, 2], generated_ids=[7], baseline_topk=[{TOKEN: math.log(0.9)}]) for i, _ in prompts]

    @staticmethod
    def topk(server, references) -> list[list[dict[str, float]]]:
        return [[{TOKEN: math.log(0.9)}] for _ in references]

    @staticmethod
    def prompts(sets, include_dir, tokenizer_dir=None) -> dict[str, list[Prompt]]:
        return {s.name: [Prompt(doc_id=i, text=f"q{i}") for i in range(N_ITEMS)] for s in sets}

    def stack(self, **real: object) -> GateStack:
        """The runner's stack with these fakes; the load test after a promoted gate is off (it has tests of its own:
        tests/unit/loadtest/test_loadtest_runner.py). `real`: parts to keep or replace (e.g. load_test=after_quality_gate)."""
        fakes = {"serve": self.server, "score": self.score, "references": self.references, "topk": self.topk, "prompts": self.prompts,
                 "check_lengths": lambda *args: None, "load_test": lambda gate, pool, inputs, stages: (gate, None),
                 "golden": lambda serve, sources, path: None}
        return GateStack(**{**fakes, **real})  # type: ignore[arg-type]


# A signature record no bundle holds: Registry.promote refuses it (the one door is promote_signed).
UNSIGNED = SignatureRecord(method="key", bundle="/nonexistent", signature_sha256="0" * 64, key_id="0" * 64, public_key="", key_source="test",
                           signed_at="2026-12-03T00:00:00+00:00", files=0, bytes=0, sign_s=0.0)


def promote(registry: Registry, version: Version, reason: str = "gate passed", evidence: dict | None = None, **options) -> Version:
    """Promote through the registry's one door, as the runner and `quantize registry promote` do: the promotion bundle
    assembled and signed (a project key beside the registry), then the version marked promoted with its signature."""
    return promote_signed(registry, version, reason, evidence, **options)


def gate_workspace(root: Path) -> SimpleNamespace:
    """A baseline, a verified artifact and an eval set under root; runs and registry paths beside them."""
    return SimpleNamespace(
        root=root,
        baseline=make_model(root / "models" / "demo-llama"),
        artifact=make_model(root / "candidates" / "w8a8-0123", manifest=True),
        eval_set=make_eval_set(root / "eval_sets"),
        runs=root / "runs",
        registry=root / "registry.db",
    )


def gate_settings(
    ws: SimpleNamespace, *, eval_set: EvalSet | None = None, serve: ServeSettings | None = None, registry: bool = True,
) -> runner.GateSettings:
    return runner.GateSettings(
        eval_sets=[eval_set or ws.eval_set], policy=load_policy(DEFAULT_POLICY), policy_path=DEFAULT_POLICY,
        serve=serve or ServeSettings(), registry_path=ws.registry if registry else None,
        runs_dir=ws.runs, cache_dir=ws.root / "cache",
    )


# --------------------------------------------------------------------------------- artifacts and gate reports (the registry's inputs)


def make_artifact(folder: Path, weights: bytes = b"weights") -> Path:
    """A quantized-artifact folder as pipelines.quantize.oneshot leaves it: files plus manifest.json."""
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text('{"quantization_config": {}}')
    (folder / "sub" / "tokenizer.json").write_text("{}")
    manifest = {MANIFEST_FILES_KEY: file_hashes(folder)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def gate_report(verdict: str = "promoted", created_at: str = "2026-12-01T10:00:00+00:00") -> GateReport:
    """A GateReport as the runner makes it: one pass/fail set of 200 items, 1 lost (promoted) or 40 (rejected)."""
    lost = 1 if verdict == "promoted" else 40
    items = [PairedItem(item_id=f"t{i}", baseline=1.0, candidate=0.0 if i < lost else 1.0, kl=0.003) for i in range(200)]
    comparison = SetComparison(eval_set="tickets", metric=make_spec("exact_match"), items=items, kl_method="top-20 logprobs")
    report = GateReport(created_at=created_at, inputs={"recipe": "w8a8"}, gate=decide([comparison], load_policy(DEFAULT_POLICY), "w8a8"))
    assert report.gate.verdict == verdict
    return report


def make_gate(path: Path, verdict: str = "promoted", created_at: str = "2026-12-01T10:00:00+00:00") -> Path:
    """A gate.json as pipelines.runs.runner writes it (a GateReport); another `created_at` is other evidence."""
    path.write_text(json.dumps(gate_report(verdict, created_at).model_dump(mode="json")))
    return path


def new_version(artifact: Path, gate: Path | None = None, model: str = "demo-llama") -> NewVersion:
    return NewVersion(
        source_model=model, source_hash="src-hash", artifact_path=artifact, recipe_name="w8a8",
        recipe_hash="recipe-hash", eval_sets=[EvalSetRef(name="tickets", hash="set-hash")], gate_path=gate,
    )


# --------------------------------------------------------------------------------- a rendered report's input

REPORT_POLICY = Policy(
    defaults=SetPolicy(
        max_abs_drop=2.0, max_rel_drop=None, non_inferiority=True, ni_margin=5.0, max_flip_rate=0.05, max_kl=None, min_items=100
    )
)


def set_comparison(name: str, lost: int, kept: int) -> SetComparison:
    cells = [(1.0, 0.0)] * lost + [(1.0, 1.0)] * kept
    items = [PairedItem(item_id=f"{name}{i}", baseline=b, candidate=c, kl=0.002) for i, (b, c) in enumerate(cells)]
    return SetComparison(eval_set=name, metric=make_spec("exact_match"), items=items, kl_method="top-20 logprobs")


def make_report(*, plan=None) -> GateReport:
    """A rejected report (25 of 200 lost on `orders|v2`, a too-small `[tickets]`) with inputs, stage times and a fit check."""
    gate = decide(
        [set_comparison("orders|v2", lost=25, kept=175), set_comparison("[tickets]", lost=0, kept=20)],
        REPORT_POLICY,
        "w8a8",
        fit=FitCheck(fits=True, required_bytes=3 * 1024**3, available_bytes=24 * 1024**3, gpu="L4-24GB"),
    )
    return GateReport(
        created_at="2026-11-02T10:00:00Z",
        inputs={
            "model": {"path": "models/demo-llama", "hash": "a" * 64},
            "artifact": {"path": "artifacts/demo-w8a8", "hash": "b" * 64},
            "recipe": {"path": "recipes/w8a8.yaml", "hash": "c" * 64},
            "eval_sets": {"orders": {"path": "eval_sets/orders", "hash": "d" * 64}},
        },
        stages={"quantize": 1.5, "serve": 28.25, "score": 40.0},
        plan=plan,
        gate=gate,
    )


# --------------------------------------------------------------------------------- the registry job's runner

JOB_RECIPES = ["w8a8", "w4a16", "gptq", "aggressive"]


class FakeRunner:
    """quantize_and_gate stand-in: a verdict (or an exception) per recipe; records every call."""

    def __init__(self, tmp_path: Path, behaviour: dict[str, object]):
        self.tmp_path = tmp_path
        self.behaviour = behaviour
        self.calls: list[tuple[str, str]] = []
        self.kwargs: list[dict] = []

    def __call__(self, loaded: LoadedRecipe, model_dir: Path, settings, *, force: bool = False, **kwargs) -> RunOutcome:
        recipe = loaded.name  # the job hands over the recipe it parsed at plan time
        self.calls.append((model_dir.name, recipe))
        self.kwargs.append(kwargs)
        what = self.behaviour.get(recipe, "promoted")
        if isinstance(what, BaseException):
            raise what
        run_dir = self.tmp_path / "runs" / f"{recipe}-{len(self.calls)}"
        artifact = self.tmp_path / "candidates" / model_dir.name / recipe
        if not artifact.exists():  # what quantize leaves: the files and manifest.json
            make_artifact(artifact, weights=recipe.encode())
        return RunOutcome(
            verdict=what, exit_code=0 if what == "promoted" else 1, run_dir=run_dir, gate_json=run_dir / "gate.json",
            report_md=run_dir / "report.md", artifact_dir=artifact, registry_version=None,  # nothing registered: no registry here
            reasons=[] if what == "promoted" else [f"tickets: drop 9.00 points > max_abs_drop 2.0 ({recipe})"], stages={},
        )


def write_job(folder: Path, text: str, name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def demo_job(folder: Path, recipes: list[str] = JOB_RECIPES, extra: str = "") -> Path:
    return write_job(
        folder,
        f"name: nightly\nregistry: registry.db\n{extra}candidates:\n  - model: models/demo-llama\n    recipes: [{', '.join(recipes)}]\n",
    )


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeRunner) -> FakeRunner:
    """The job runs `fake` instead of quantize_and_gate."""
    monkeypatch.setattr(job_module, "quantize_and_gate", fake)
    return fake


@contextmanager
def answered_probe(monkeypatch: pytest.MonkeyPatch, cache: Path, profile, run_probe):
    """The kernel probe answered by `run_probe(request, timeout_s=...)` for host `profile`, its cache in `cache`."""
    from pipelines.hardware import kernels, probe_rules

    monkeypatch.setattr(kernels, "run_probe", run_probe)
    monkeypatch.setattr(kernels, "cache_dir", lambda: cache)
    monkeypatch.setattr(probe_rules, "host_profile", lambda: profile)
    kernels._cached.cache_clear()
    try:
        yield
    finally:
        kernels._cached.cache_clear()


def promoted(cli, workspace: SimpleNamespace, model: str = "demo-llama") -> Version:
    """One more promoted version of the workspace's artifact: each gate run is new evidence, hence a new version,
    unless it ran in the same second as the last one (gate.json's created_at has seconds): then it runs again."""
    before = len(Registry(workspace.registry).list()) if workspace.registry.exists() else 0
    while True:
        assert cli() == 0
        versions = Registry(workspace.registry).list(model)
        if len(versions) > before:
            return versions[-1]
        time.sleep(0.2)
