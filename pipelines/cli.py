"""`quantize`: argument parsing and the exit contract; the work is in the library.

The exit contract (docs/exit-codes.md), enforced here and nowhere else:

    0  success / promoted
    1  rejected by the gate: only a handler's own return value; no error ever exits 1
    2  any error: a usage error, bad input, a server or scoring failure, an interruption, or an
       unexpected exception (a bug), whose traceback goes to a log file instead of the terminal

An error prints exactly one line on stderr, `quantize: error: FILE: FIELD: message` (or `quantize:
internal error: ...` naming the traceback's log file); with `--json` the same error is also a JSON
object on stdout: {"error", "exit_code", "file", "field", "kind"}.

`quantize --recipe NAME` (no sub-command) runs the whole job: quantize, serve, score, gate, promote.

Commands are a lazy table (COMMANDS: name -> module, summary): `quantize --help` lists them all from the
table and only the chosen command's module is imported. A command whose module cannot be imported, or
does not register its name, is an internal error (exit 2, the traceback in a log), never a missing entry.
Adding a command is one table entry and a module with `register(subparsers)`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from pipelines.console.output import printable
from pipelines.errors import EXIT_ERROR, EXIT_OK, EXIT_REJECTED, MAX_LINE_CHARS, QuantGateError, bounded
from pipelines.evaluation.budget import new_command_budget
from pipelines.settings import current as current_settings


class Command(NamedTuple):
    module: str  # imported only when the command is chosen; it has `register(subparsers)`
    summary: str  # the line `quantize --help` shows


COMMANDS: dict[str, Command] = {
    "run": Command("pipelines.commands.run", "quantize, serve, score and gate one model with one recipe (the default command)"),
    "gate": Command("pipelines.commands.gate", "gate an existing artifact against its 16-bit baseline"),
    "recipe": Command("pipelines.commands.recipe", "list, show and validate quantization recipes"),
    "eval-sets": Command("pipelines.commands.eval_sets", "list, validate and size (power) the business eval sets"),
    "plan": Command("pipelines.commands.plan", "memory plan: weights, KV cache, activations, overhead; does it fit the GPU?"),
    "job": Command("pipelines.commands.job", "run a job file: many models x recipes, continue past failures, one summary"),
    "bakeoff": Command("pipelines.commands.bakeoff", "one intent through every quantize backend: a table and plot of bytes, speed, quality, verdict"),
    "registry": Command("pipelines.commands.registry", "the model registry: versions, status, aliases, history"),
    "models": Command("pipelines.commands.models", "add a real pretrained model (from a GGUF) under models/, list them"),
    "loadtest": Command("pipelines.commands.loadtest", "load-test a model (and a candidate against it) with vLLM bench serve"),
    "repair": Command("pipelines.commands.repair", "repair a rejected run: move its most sensitive modules up a fallback ladder until it passes"),
    "serve": Command("pipelines.commands.serve", "serve versions behind nginx: fallback chain, circuit breaker; status, stop, drill, export"),
    "doctor": Command("pipelines.commands.doctor", "this host's class, its vLLM build, and what each recipe and ladder rung gets here"),
    "deploy": Command("pipelines.commands.deploy", "deployment files of a promoted version: serve command, scrape config, alert rules, dashboard"),
    "regate": Command("pipelines.commands.regate", "re-check a promoted version on the serving runtime at hand (vLLM, torch, host class, kernels)"),
    "watch": Command("pipelines.commands.watch", "hold a deployed vLLM server's live metrics to the envelope its version was promoted on"),
    "report": Command("pipelines.commands.report", "the HTML page of a run, a repair or a registry model, to open in a browser"),
}
DEFAULT_COMMAND = "run"


class CommandLoadError(Exception):
    """A command in COMMANDS whose module cannot be imported or does not register it: a bug, exit 2."""


class UsageError(Exception):
    """A command line argparse refuses: exit 2 with one line, like every other error."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are raised, not printed with the usage block and exited on (sub-parsers inherit it)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


# --- the parser -------------------------------------------------------------------------------------------


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """`quantize`'s parser: every command listed, only `chosen`'s module imported to add its arguments."""
    parser = _Parser(
        prog="quantize",
        description="Quantize an LLM, serve it on vLLM, gate it on business test sets, promote it.",
        epilog="Exit codes: 0 promoted / success, 1 rejected by the gate, 2 error (docs/exit-codes.md).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        if name == chosen:
            _register(name, subparsers)
        else:  # listed by --help; never parsed (argv names another command)
            subparsers.add_parser(name, help=command.summary, add_help=False)
    return parser


def load_command(name: str) -> ModuleType:
    """The module of command `name`; one that cannot be imported is a CommandLoadError naming it."""
    module = COMMANDS[name].module
    try:
        return importlib.import_module(module)
    except Exception as error:  # whatever stops the import (ImportError, SyntaxError, ...) is a bug
        raise CommandLoadError(f"command {name!r} cannot be loaded from {module}: {type(error).__name__}: {error}") from error


def _register(name: str, subparsers: argparse._SubParsersAction) -> None:
    register = getattr(load_command(name), "register", None)
    if register is None:
        raise CommandLoadError(f"command {name!r}: {COMMANDS[name].module} has no register(subparsers)")
    register(subparsers)
    if name not in subparsers.choices:
        raise CommandLoadError(f"command {name!r}: {COMMANDS[name].module}.register() did not add it")


def _with_default_command(argv: list[str]) -> list[str]:
    """`quantize --recipe ...` is `quantize run --recipe ...`; a first word that is not a command is refused, never
    read as run's arguments."""
    if argv and (argv[0] in COMMANDS or argv[0] in ("-h", "--help")):
        return argv
    if argv and not argv[0].startswith("-"):
        nearest = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" (did you mean {nearest[0]!r}?)" if nearest else ""
        raise UsageError(f"quantize: unknown command {_one_line(argv[0][:80])!r}{hint}; the commands are: {', '.join(COMMANDS)}")
    return [DEFAULT_COMMAND, *argv]


def _raise_keyboard_interrupt_on_sigterm() -> None:
    # SIGTERM takes the same clean-up path as Ctrl-C: servers stopped, temporary folders removed.
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


# --- reporting an error -----------------------------------------------------------------------------------


def _one_line(text: object) -> str:
    """One bounded line (errors.MAX_LINE_CHARS), control characters shown as \\xNN (a name in an error cannot drive the
    terminal, a 100 KB value cannot flood it)."""
    return bounded(printable(str(text)), MAX_LINE_CHARS)


def _report(line: str, as_json: bool, document: dict[str, Any]) -> int:
    """The error's one line on stderr and, with --json, its JSON object on stdout; always exit 2."""
    print(_one_line(line), file=sys.stderr)
    if as_json:
        try:
            sys.stdout.write(json.dumps({**document, "exit_code": EXIT_ERROR}, default=str) + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass  # stdout closed: the exit code and the stderr line still tell
    return EXIT_ERROR


def _report_error(error: QuantGateError, as_json: bool) -> int:
    document = {"error": _one_line(error.message), "file": error.file, "field": error.field, "kind": _kind(error)}
    details = getattr(error, "details", None)
    if details:
        document.update({key: value for key, value in details.items() if key not in document})
    return _report(f"quantize: error: {error.one_line()}", as_json, document)


def _kind(error: QuantGateError) -> str:
    name = type(error).__name__
    return {"InputError": "input", "ServeError": "serve", "EvalError": "eval", "LoadTestError": "loadtest"}.get(name, "error")


def _internal_error(error: BaseException, argv: list[str], as_json: bool) -> int:
    """A bug, or an input nobody checked: exit 2 with one line; the traceback goes to a log file."""
    where = _write_traceback(error, argv)
    summary = f"{type(error).__name__}: {_one_line(error)}"
    saved = f"traceback in {where}" if isinstance(where, Path) else f"traceback not saved: {where}"
    document = {"error": summary, "file": None, "field": None, "kind": "internal", "traceback": str(where) if isinstance(where, Path) else None}
    return _report(f"quantize: internal error: {summary} ({saved})", as_json, document)


def log_dirs() -> list[Path]:
    """Where tracebacks of internal errors go: the artifacts root's logs/, else the temporary folder."""
    return [current_settings().logs_dir, Path(tempfile.gettempdir()) / "quantgate-logs"]


def _write_traceback(error: BaseException, argv: list[str]) -> Path | str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    text = (
        f"quantize internal error at {stamp}\nargv: {argv!r}\npython: {sys.version.split()[0]}\ncwd: {os.getcwd()}\n\n"
        + "".join(traceback.format_exception(type(error), error, error.__traceback__))
    )
    problems = []
    for folder in log_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"internal-error-{stamp}-{os.getpid()}.log"
            path.write_text(text, encoding="utf-8", errors="backslashreplace")
            return path
        except OSError as problem:
            problems.append(f"{folder}: {problem.strerror or problem}")
    return "; ".join(problems)


# --- main -------------------------------------------------------------------------------------------------


def _caches_under_the_artifacts_root() -> None:
    """torch's compiler cache defaults to <system temp>/torchinductor_<user>, made as soon as torch._dynamo is imported
    (transformers and llm-compressor import it): this process's and its children's go under the artifacts root unless
    the user chose a folder. Only for the command as a process (main() without argv), never inside a caller's process."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(current_settings().artifacts_dir.resolve() / "cache" / "torchinductor"))


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        _caches_under_the_artifacts_root()
    arguments = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    as_json = "--json" in arguments
    try:
        argv = _with_default_command(arguments)
        args = build_parser(argv[0] if argv[0] in COMMANDS else None).parse_args(argv)
    except UsageError as error:
        return _report(f"quantize: error: {error}", as_json, {"error": _one_line(error), "file": None, "field": None, "kind": "usage"})
    except SystemExit as done:  # --help: argparse printed it
        return done.code if isinstance(done.code, int) and done.code in (EXIT_OK, EXIT_ERROR) else EXIT_ERROR
    except Exception as error:  # a command that cannot load (CommandLoadError) is a bug, still exit 2
        return _internal_error(error, arguments, as_json)
    as_json = bool(getattr(args, "json", as_json))
    if not getattr(args, "handler", None):
        return _report("quantize: error: no command given (see `quantize --help`)", as_json,
                       {"error": "no command given", "file": None, "field": None, "kind": "usage"})
    _raise_keyboard_interrupt_on_sigterm()
    new_command_budget()  # one rendering budget per command, over every eval set it renders
    try:
        code = args.handler(args)
    except QuantGateError as error:
        return _report_error(error, as_json)
    except KeyboardInterrupt:
        line = "quantize: interrupted; servers stopped and partial outputs removed"
        return _report(line, as_json, {"error": "interrupted", "file": None, "field": None, "kind": "interrupted"})
    except BaseException as error:  # the contract: nothing escapes as a traceback or as exit 1
        if isinstance(error, SystemExit) and error.code in (None, 0):
            return EXIT_OK
        return _internal_error(error, arguments, as_json)
    if isinstance(code, bool) or not isinstance(code, int) or code not in (EXIT_OK, EXIT_REJECTED, EXIT_ERROR):
        return _internal_error(TypeError(f"handler {args.handler.__name__} returned {code!r}, not 0, 1 or 2"), arguments, as_json)
    return code


if __name__ == "__main__":
    sys.exit(main())
