"""`quantize`: argument parsing and exit codes only; the work is in the library.

Exit codes: 0 success / promoted, 1 rejected by the gate, 2 error (bad input, server failure, ...).
`quantize --recipe NAME` (no sub-command) runs the whole job: quantize, serve, score, gate, promote.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from typing import Sequence

from pipelines.errors import QuantGateError

COMMAND_MODULES = ("run", "gate", "recipe", "eval_sets", "plan", "job", "registry")
DEFAULT_COMMAND = "run"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantize",
        description="Quantize an LLM, serve it on vLLM, gate it on business test sets, promote it.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"pipelines.commands.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"pipelines.commands.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def _with_default_command(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    known = set(parser._subparsers._group_actions[0].choices) if parser._subparsers else set()  # noqa: SLF001
    if argv and (argv[0] in known or argv[0] in ("-h", "--help")):
        return argv
    return [DEFAULT_COMMAND, *argv]


def _raise_keyboard_interrupt_on_sigterm() -> None:
    # SIGTERM takes the same clean-up path as Ctrl-C: servers stopped, temporary folders removed.
    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_with_default_command(list(sys.argv[1:] if argv is None else argv), parser))
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    _raise_keyboard_interrupt_on_sigterm()
    try:
        return int(args.handler(args))
    except QuantGateError as error:
        print(f"quantize: error: {error.one_line()}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("quantize: interrupted; servers stopped and partial outputs removed", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
