"""Shared fixtures: a tiny random Llama with the demo model's shape, its calibration data, the demo model.

The tiny model has the dimensions of models/demo-llama (hidden 256, intermediate 768, 4 layers, 4 heads,
2 KV heads, head_dim 64, bf16, untied lm_head) but random weights and a small vocabulary, so tests can
quantize and serve it in seconds before (or without) the trained demo model.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from postgres_cluster import PostgresCluster, postgres_available, postgres_cluster

from pipelines.paths import DEMO_MODEL_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY_VOCAB = 512
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": TINY_VOCAB,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "bfloat16",
}


def sample_texts(count: int) -> list[str]:
    """Deterministic ticket-like lines, for the tokenizer and for calibration."""
    teams = ("billing", "shipping", "returns", "accounts")
    return [f"Ticket {i}: order {(i * 7919) % 100000:05d} goes to {teams[i % 4]}, ref PAY-{(i * 104729) % 9973}." for i in range(count)]


def make_tiny_llama(folder: Path) -> Path:
    """Write a random-weight Llama (demo-model shape) and a byte-level BPE tokenizer into `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipelines.demo.tokenizer import train_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA_CONFIG.items() if k not in ("model_type", "architectures")})
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    train_tokenizer(sample_texts(200), TINY_VOCAB).save_pretrained(folder)
    return folder


def write_calibration_set(folder: Path, count: int = 64) -> Path:
    """A calibration set folder as pipelines.evaluation.evalsets reads it: set.yaml + data.jsonl with a `text` field."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "set.yaml").write_text("kind: calibration\ndescription: tiny test calibration lines\n")
    (folder / "data.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in sample_texts(count)))
    return folder


@pytest.fixture(scope="session")
def tiny_llama_config() -> dict[str, Any]:
    return dict(TINY_LLAMA_CONFIG)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def demo_or_tiny_model(request: pytest.FixtureRequest) -> Path:
    """models/demo-llama once it exists, else the tiny random Llama."""
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return DEMO_MODEL_DIR
    return request.getfixturevalue("tiny_llama_dir")


@pytest.fixture(scope="session")
def calibration_set_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_calibration_set(tmp_path_factory.mktemp("eval_sets") / "calibration")


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresCluster]:
    """A throwaway PostgreSQL cluster for the session (tests/postgres_cluster.py); each test creates its own database."""
    if not postgres_available():
        pytest.fail("PostgreSQL's binaries are missing (scripts/setup_system.sh installs Debian's postgresql)")
    with postgres_cluster(tmp_path_factory.mktemp("postgres")) as cluster:
        yield cluster


# The end-to-end files with models, runs and servers of their own (no session fixture of the demo model's runs): one work unit.
OWN_MODELS = ("tests/integration/test_families_e2e.py", "tests/integration/test_formats_e2e.py", "tests/integration/test_real_model.py")
# End-to-end files that read nothing of the demo-model unit's session (their own artifacts root, server or database, no
# w8a8/aggressive run, no quantized artifact of its root): each a work unit of its own, taken by whichever worker is free.
ON_THEIR_OWN = ("tests/integration/test_lifecycle.py", "tests/integration/test_mlflow_mirror.py", "tests/integration/test_plain_lm_eval.py",
                "tests/integration/test_registry_postgres.py")


def work_unit(nodeid: str) -> str:
    """The work unit a test belongs to under `make test` (docs/testing.md): own-models, demo-model, an end-to-end file on
    its own (its path), or the test itself (every unit test)."""
    if not nodeid.startswith("tests/integration/"):
        return nodeid
    if nodeid.startswith(OWN_MODELS):
        return "own-models"
    if nodeid.startswith(ON_THEIR_OWN):
        return nodeid.split("::", 1)[0]
    return "demo-model"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin (-p no:xdist) it is not called
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`make test` (-n 2 --dist loadscope): the end-to-end tests run as two work units, each kept on one worker: the files
    with models of their own (the family jobs, one lane on the last core; the real pretrained model) and the rest, whose
    session fixtures (one w8a8 quantize, the baseline's cached scores) must be computed once. Every unit test is a unit
    of its own, run by whichever worker finishes its end-to-end unit first. Measured on 2 cores (CI, 4 December): the
    demo-model unit 51 minutes, the family jobs 28.5 beside it, then the unit tier; the real model (7 minutes) moved over.
    Again on 4 December (AVX-512 host, 40 min of pytest): the demo-model unit was still the longest; the formats file (FP8
    and KV runs on their own sets, 10-11 min) moved over, and the family jobs calibrate on 16 samples (about 5 min less).
    7 December: the end-to-end files that share nothing with the demo-model unit's session (ON_THEIR_OWN) left it, each a
    unit of its own for whichever worker is free (docs/testing.md maps what each unit costs).
    (xdist's own loadgroup marks do not reach its scheduler under pytest 9: it renames a node id pytest no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return SuiteScheduling(config, log)


_TORCH_DEFAULT_THREADS: list[int] = []  # torch's own count in this worker, read before the first change


def _torch_threads_for(item: pytest.Item) -> None:
    """Under pytest-xdist (two workers on two cores) a unit test computes with torch on one thread. Torch's default, a
    thread per core in each worker, oversubscribes the cores beside the other worker's vLLM server and its threads spin
    on each other: four repair tests, run side by side at load 12-15 (7 December), took 179 CPU-seconds (601 s) with
    two threads and 43 (407 s) with one. The end-to-end tests keep torch's default: their in-process quantizations must
    give the bits the `quantize` commands they start give (GPTQ and SmoothQuant sum in a thread-count-dependent order,
    pipelines/artifact.py). Only this process: vLLM and the commands the tests start keep their own settings."""
    torch = sys.modules.get("torch")  # imported by a test or fixture, never here: most of the unit tier runs without it
    if torch is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if not _TORCH_DEFAULT_THREADS:
        _TORCH_DEFAULT_THREADS.append(torch.get_num_threads())
    wanted = 1 if item.nodeid.startswith("tests/unit/") else _TORCH_DEFAULT_THREADS[0]
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _torch_threads_for(item)


def pytest_runtest_call(item: pytest.Item) -> None:
    _torch_threads_for(item)  # again: the test's fixtures may have imported torch


class _WorkerClock:
    """Where a `make test` run spends its time: per xdist worker, the seconds its tests took (setup, call, teardown) in each
    work unit and when its last test ended; printed at the end, so a CI log shows which unit is the critical path."""

    def __init__(self) -> None:
        import time

        self.started = time.monotonic()
        self.busy: dict[str, dict[str, float]] = {}
        self.last_end: dict[str, float] = {}

    def add(self, worker: str, nodeid: str, seconds: float) -> None:
        import time

        scope = work_unit(nodeid)
        unit = "unit tests" if scope == nodeid else "e2e on their own" if scope.startswith(ON_THEIR_OWN) else scope
        per_unit = self.busy.setdefault(worker, {})
        per_unit[unit] = per_unit.get(unit, 0.0) + seconds
        self.last_end[worker] = time.monotonic() - self.started

    def lines(self) -> list[str]:
        return [f"{worker}: last test ended at {self.last_end[worker] / 60:.1f} min; busy {sum(units.values()) / 60:.1f} min: "
                + ", ".join(f"{unit} {seconds / 60:.1f} min" for unit, seconds in sorted(units.items()))
                for worker, units in sorted(self.busy.items())]


_CLOCK = _WorkerClock()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # set by xdist on the controller: the worker that ran the test
    if node is not None:
        _CLOCK.add(node.gateway.id, report.nodeid, report.duration)


@pytest.hookimpl(trylast=True)  # after the slowest durations: the end of a CI log is what is kept
def pytest_terminal_summary(terminalreporter) -> None:
    if _CLOCK.busy:
        terminalreporter.write_sep("=", "time per worker and work unit")
        for line in _CLOCK.lines():
            terminalreporter.write_line(line)
