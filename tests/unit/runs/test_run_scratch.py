"""Library caches and temporary files of a run land in its run folder and go with the process that made them:
vLLM's `vllm_dist_*` rendezvous file (one per start, in the system's temporary folder before), torch's compile
caches and locks (TMPDIR of the server), and lm-eval's datasets cache (HF_DATASETS_CACHE of its subprocess)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
from fakes import write_serve_python

from pipelines.errors import ServeError
from pipelines.evaluation import evaluate
from pipelines.serve import serving

# A stand-in for vLLM: writes a rendezvous file where vLLM writes its own (tempfile.gettempdir(): TMPDIR), records
# where, and fails its start (a started server's temporary folder goes the same way: the block's finally).
WRITES_A_TEMP_FILE = """
import os, sys, tempfile
path = os.path.join(tempfile.gettempdir(), "vllm_dist_fake")
open(path, "w").write("x")
print("wrote", path, "rpc", os.environ.get("VLLM_RPC_BASE_PATH"), flush=True)
sys.exit(3)
"""


def test_a_vllm_start_writes_its_temporary_files_in_the_run_folder_and_they_go_with_it(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "fake_vllm.py"
    script.write_text(WRITES_A_TEMP_FILE)
    write_serve_python(tmp_path / "venv", f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    monkeypatch.setenv("QUANTGATE_SERVE_VENV", str(tmp_path / "venv"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = tmp_path / "runs" / ".run.tmp"
    run.mkdir(parents=True)
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(ServeError, match="exit code 3"), serving.vllm_server(model, log_path=run / "candidate-server.log"):
        pass
    words = (run / "candidate-server.log").read_text().split()
    written = Path(words[words.index("wrote") + 1])
    assert written.parent.parent.parent == run and written.parent.name == "tmp"  # <run>/quantgate-vllm-<pid>-*/tmp/
    assert not written.exists() and list(run.iterdir()) == [run / "candidate-server.log"]  # removed with the server
    assert words[words.index("rpc") + 1] == tempfile.gettempdir()  # sockets keep a short path
    assert not {name for name in set(os.listdir(tempfile.gettempdir())) - before if name.startswith("vllm_dist_")}


def test_lm_eval_keeps_its_datasets_cache_and_temporary_files_in_the_run_folder(tmp_path: Path) -> None:
    server = serving.RunningServer.model_construct(
        model_dir=tmp_path, served_name="candidate", port=8000, log_path=tmp_path / "log", process=None,
        startup_s=0.0, request_timeout_s=60.0, api_key="k",
    )
    env = evaluate.lm_eval_environment(server, tmp_path / "scratch")
    assert env["HF_DATASETS_CACHE"] == str(tmp_path / "scratch" / "datasets") and env["TMPDIR"] == str(tmp_path / "scratch" / "tmp")


def test_lm_evals_scratch_folder_is_removed_however_the_run_ends(tmp_path: Path, monkeypatch) -> None:
    server = serving.RunningServer.model_construct(
        model_dir=tmp_path, served_name="candidate", port=8000, log_path=tmp_path / "log", process=type("P", (), {"poll": lambda self: None})(),
        startup_s=0.0, request_timeout_s=60.0, api_key="k",
    )
    command = [sys.executable, "-c", "import os, tempfile; open(os.path.join(tempfile.gettempdir(), 'x'), 'w').write('x'); "
               "os.makedirs(os.environ['HF_DATASETS_CACHE']); print(tempfile.gettempdir())"]
    evaluate._run_watching_server(command, server, tmp_path / "work" / "lm-eval.log")
    used = Path((tmp_path / "work" / "lm-eval.log").read_text().strip())
    assert used.is_relative_to(tmp_path / "work") and not used.exists()
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["lm-eval.log"]
