"""Running a subprocess backend's quantize step: backend_tool.py in the backend's environment, with the contract of
every child the product starts (pipelines/serve/reclaim.py): its own process group with a parent-death signal and a
watchdog, so it dies with `quantize` however `quantize` ends; Ctrl-C or an error stops it. Its chatter goes to a log
under artifacts/logs; its stage lines become the product's progress; a death is reported by its cause (the last
exception line in the log) with the log's path.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel

from pipelines.console.output import progress
from pipelines.errors import QuantizeError
from pipelines.quantize.backends.environment import backend_process_env, ensure_environment
from pipelines.quantize.backends.specs import BackendPlan, BackendSpec
from pipelines.serve.reclaim import exit_description
from pipelines.serve.serving import start_process_group, stop_process_group
from pipelines.settings import current as current_settings

TOOL_SCRIPT = Path(__file__).resolve().with_name("backend_tool.py")
MARKER = "QUANTGATE-BACKEND "
_POLL_S = 0.5
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


class BackendRun(BaseModel):
    seconds: float
    versions: dict[str, str]
    peak_bytes: int
    log: Path


def run_backend(
    spec: BackendSpec, plan: BackendPlan, model_dir: Path, out_dir: Path, *, texts: list[str], max_seq_length: int, seed: int,
    label: str = "",
) -> BackendRun:
    """Quantize `model_dir` into `out_dir` with the backend's own tool; its figures, or a QuantizeError. `label` names
    its log (the artifact's folder name; `out_dir` is a staging folder)."""
    logs = current_settings().logs_dir
    log_path = logs / f"{spec.name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{label or out_dir.name}.log"
    logs.mkdir(parents=True, exist_ok=True)
    python = ensure_environment(spec, logs / f"setup-{spec.environment}.log")
    with tempfile.TemporaryDirectory(prefix=f"{spec.name}-", dir=logs) as scratch_name:
        scratch = Path(scratch_name)
        job = scratch / "job.json"
        job.write_text(json.dumps(_job(spec, plan, model_dir, out_dir, scratch, texts, max_seq_length, seed)))
        progress(f"running {spec.name} in {python.parent.parent.name} (its output: {log_path})")
        # -P: the tool's own folder must not shadow what the backend imports
        process, watchdog = start_process_group([str(python), "-P", str(TOOL_SCRIPT), str(job)],
                                                env=backend_process_env(spec, scratch), log_path=log_path)
        try:
            done = _follow(process, log_path, spec.name)
        finally:
            stop_process_group(process)
            watchdog.stop()
            _keep_library_logs(scratch, log_path)
    if process.returncode != 0 or done is None:
        raise QuantizeError(f"{spec.name} failed ({exit_description(process.returncode)}): {_cause(log_path)}", file=log_path)
    return BackendRun(seconds=float(done["seconds"]), versions=dict(done["versions"]), peak_bytes=int(done["peak_bytes"]), log=log_path)


def _job(spec: BackendSpec, plan: BackendPlan, model_dir: Path, out_dir: Path, scratch: Path, texts: list[str],
         max_seq_length: int, seed: int) -> dict:
    calibration = None
    if texts:
        texts_file = scratch / "calibration.jsonl"
        texts_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        calibration = {"texts_file": str(texts_file), "max_seq_length": max_seq_length, "seed": seed}
    return {"backend": spec.name, "model_dir": str(model_dir), "out_dir": str(out_dir), "workdir": str(scratch), "config": plan.config,
            "calibration": calibration}


def _keep_library_logs(scratch: Path, log_path: Path) -> None:
    """Logs a library wrote into its working folder (GPTQModel's per-layer losses in ./logs) kept beside the run's log."""
    for extra in sorted((scratch / "logs").glob("*.log")):
        shutil.move(extra, log_path.with_name(f"{log_path.stem}-{extra.name}"))


def _follow(process, log_path: Path, name: str) -> dict | None:
    """Wait for the tool, turning its stage lines into progress; the `done` line's fields, or None."""
    offset, done = 0, None
    while True:
        exited = process.poll() is not None
        offset, lines = _new_lines(log_path, offset)
        for line in lines:
            if line.startswith(MARKER):
                stage = json.loads(line[len(MARKER):])
                done = stage if stage.get("stage") == "done" else done
                progress(_stage_text(name, stage))
        if exited:
            return done
        time.sleep(_POLL_S)


def _new_lines(log_path: Path, offset: int) -> tuple[int, list[str]]:
    try:
        with log_path.open("rb") as handle:
            handle.seek(offset)
            chunk = handle.read()
    except OSError:
        return offset, []
    complete = chunk.rfind(b"\n") + 1  # a line still being written is read next time
    return offset + complete, chunk[:complete].decode(errors="replace").splitlines()


def _stage_text(name: str, stage: dict) -> str:
    what = stage.get("stage")
    if what == "quantizing":
        return f"{name}: quantizing ({stage.get('samples', 0)} calibration samples)"
    if what == "done":
        return f"{name}: done in {float(stage.get('seconds', 0)):.1f} s"
    return f"{name}: {what}"


def _cause(log_path: Path) -> str:
    """The last exception line of the log (Python's traceback ends with it), else its last line."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    exceptions = [line for line in lines if _EXCEPTION_LINE.match(line)]
    picked = (exceptions or lines or ["(empty log)"])[-1]
    return picked[:400]
