"""Why a server the product started ended, in one line: the one builder for every server (a run's, a bake-off's, a
repair's, the fleet's; vLLM or llama.cpp).

The server's console log is read from its end, at most CONSOLE_TAIL_BYTES, as a regular file only (a link or a FIFO put
in its place is not followed). In order:
- the exception that ends its first traceback (a worker's `AttributeError: ... 'cpu_gemm_wna16'`), with a known cause
  named first when it is one (`port in use: OSError: [Errno 98] Address already in use`);
- a known cause on any line (out of memory, a port in use, too little free host memory for vLLM's reservation);
- else how it ended, with its last lines: `exited 1; last lines: a | b | c`, or `no output; killed by signal 9 (SIGKILL)`
  for an empty console, and `no console log at <path>` where there is none. Never "(no log)" while a log exists.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from pipelines.bounds import KiB
from pipelines.errors import InputError
from pipelines.files.run_input import read_regular_tail

CONSOLE_TAIL_BYTES = 64 * KiB
TAIL_LINES = 3  # console lines quoted when no cause is found
_ERROR_TAIL_LINES = 8  # log_tail's default: the last error lines of a tool's log (lm-eval, vllm bench)
_CAUSE_DETAIL_LINES = 2
# vLLM's log prefix: "(Worker pid=5533) ERROR 12-03 11:50:43 [multiproc_executor.py:1063] "
_VLLM_PREFIX = re.compile(r"^\([\w ]+ pid=\d+\) +[A-Z]+ +\S+ +\S+ +\[[^\]]*\] ?")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Fault)(: .*)?$")
KNOWN_CAUSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("port in use", re.compile(r"address already in use|\[Errno 98\]", re.IGNORECASE)),
    ("out of memory", re.compile(r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|std::bad_alloc|"
                                 r"\[Errno 12\]", re.IGNORECASE)),
    # a process of the server's group was killed (SIGKILL: the OOM killer's way): the API server then exits 0 (measured)
    ("a server process was killed", re.compile(r"Worker proc \S+ died unexpectedly", re.IGNORECASE)),
    ("too little free host memory", re.compile(r"Available memory on node .* is less than desired", re.IGNORECASE)),
)


KILLED = dict(KNOWN_CAUSES)["a server process was killed"]


def console_tail(log_path: Path) -> str | None:
    """The last CONSOLE_TAIL_BYTES of the console log; None when there is none (absent, or not a regular file)."""
    try:
        return read_regular_tail(log_path, "server's console log", CONSOLE_TAIL_BYTES).decode(errors="replace")
    except (InputError, OSError):
        return None


def ended(returncode: int | None) -> str:
    """`exited N`, `killed by signal N (SIGNAME)`, or `still running`."""
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exited {returncode}"
    try:
        return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return f"killed by signal {-returncode}"


def death_cause(log_path: Path, returncode: int | None) -> str:
    """See the module docstring; the line ends with the log's path."""
    text = console_tail(log_path)
    if text is None:
        return f"no console log at {log_path}; {ended(returncode)}"
    lines = _said(_console_lines(text))
    if not lines:
        return f"no output; {ended(returncode)} (log: {log_path})"
    cause = _traceback_cause(lines) or _known_cause_line(lines)
    killed = next((shorten(line) for line in lines if KILLED.search(line)), None)
    if killed is not None and cause is not None and killed not in cause:
        cause = f"{killed} Then: {cause}"
    if cause is not None:
        return f"{_labelled(cause)} (log: {log_path})"
    return f"{ended(returncode)}; last lines: {' | '.join(shorten(line) for line in lines[-TAIL_LINES:])} (log: {log_path})"


def log_cause(log_path: Path) -> str | None:
    """The root cause of a failure in a server's log: the exception that ends the first traceback in its tail, not the
    wrappers the engine and API server log after it; None when there is none."""
    text = console_tail(log_path)
    return _traceback_cause(_console_lines(text)) if text is not None else None


def log_tail(log_path: Path, lines: int = _ERROR_TAIL_LINES) -> str:
    """The last error lines of a tool's log (the last lines if none says error), folded onto one line."""
    text = console_tail(log_path)
    if text is None:
        return f"(no log at {log_path})"
    all_lines = _said(_console_lines(text))
    errors = [line for line in all_lines if "error" in line.lower()]
    return " | ".join(shorten(line) for line in (errors or all_lines)[-lines:]) or "(empty log)"


def shorten(line: str, head: int = 200, tail: int = 80) -> str:
    # Both ends: vLLM puts the cause first ("Model architectures ['X'] are not supported ...") and may
    # follow it with a very long list, while other lines put it after a long prefix.
    line = line.strip()
    return line if len(line) <= head + tail + 5 else f"{line[:head]} ... {line[-tail:]}"


def _console_lines(text: str) -> list[str]:
    """The console's lines without vLLM's prefix; blank lines stay (one ends a multi-line exception message)."""
    return [_VLLM_PREFIX.sub("", line).rstrip() for line in text.splitlines()]


def _said(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip()]


def _traceback_cause(lines: list[str]) -> str | None:
    in_traceback = False
    for index, line in enumerate(lines):
        if line.strip().startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and _EXCEPTION_LINE.match(line.strip()):
            # A message may go on over indented lines (pydantic's "1 validation error for ModelConfig" + the error itself).
            details = []
            for more in lines[index + 1:index + 1 + _CAUSE_DETAIL_LINES]:
                if not more[:1].isspace() or not more.strip() or more.strip().startswith('File "'):
                    break  # the message ended (a new traceback's frame is no part of it)
                details.append(more.strip())
            return " ".join(shorten(part) for part in [line.strip(), *details])
    return None


def _known_cause_line(lines: list[str]) -> str | None:
    for line in reversed(lines):
        if any(pattern.search(line) for _, pattern in KNOWN_CAUSES):
            return shorten(line)
    return None


def _labelled(cause: str) -> str:
    label = next((name for name, pattern in KNOWN_CAUSES if pattern.search(cause)), None)
    return f"{label}: {cause}" if label else cause
