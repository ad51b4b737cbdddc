"""`quantize regate NAME@ALIAS [--baseline DIR]`: a promoted version re-checked on the serving runtime at hand (the
kernel probe, the paired gate rescored set by set, the semantic canary), the result signed beside its bundle.

Exit 0 passed (this runtime may now serve the version: `serve`, `deploy` and `watch --version` accept it), 1 failed
(the reasons name the set or the check), 2 every error (an unknown version, a missing baseline, a changed eval set).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.commands.common import library_output_on_stderr
from pipelines.console.capture import add_verbose_option
from pipelines.console.output import emit, progress, say, table
from pipelines.registry.store import open_registry
from pipelines.runs.regate import RegateOutcome, regate


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("regate", description="Re-check a promoted version on the serving runtime at hand (vLLM, torch, "
                                   "transformers, compressed-tensors, host class, kernels): kernel probe, paired gate against its 16-bit "
                                   "baseline rescored here (stops at the first failed set), semantic canary. The result is signed "
                                   "beside the version's bundle; a passing re-gate lets serve, deploy and watch use this runtime.")
    parser.add_argument("reference", metavar="NAME@ALIAS", help="a promoted registry version: NAME@ALIAS or NAME@VERSION")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="the 16-bit model folder, when it is no longer where the version's gate found it")
    parser.add_argument("--registry", metavar="PATH", type=Path, default=None,
                        help="registry database (default: $QUANTGATE_REGISTRY or artifacts/registry.db)")
    parser.add_argument("--json", action="store_true", help="print the re-gate record as JSON")
    add_verbose_option(parser)
    parser.set_defaults(handler=_regate)


def _regate(args: argparse.Namespace) -> int:
    registry = open_registry(args.registry)
    with library_output_on_stderr(verbose=args.verbose):
        outcome = regate(args.reference, registry, baseline_dir=args.baseline)
    document = {**outcome.record.model_dump(mode="json"), "signed_folder": str(outcome.folder)}
    emit(document, as_json=args.json, render=lambda _: _render(outcome))
    return outcome.exit_code


def _render(outcome: RegateOutcome) -> None:
    record = outcome.record
    say(f"{record.model} v{record.version}: re-gate {record.verdict.upper()} on {record.runtime.summary()} in {record.cost_s:.0f} s")
    say(f"gated on {record.gated_runtime.summary()}; " + (f"changes: {'; '.join(record.changes)}" if record.changes else "no change"))
    say(table("Sets (narrowest promotion margin first; stops at the first failed set)", ["set", "verdict", "reasons"],
              [[s.name, s.verdict, "; ".join(s.reasons)] for s in record.sets]))
    if record.divergence is not None:
        say(f"semantic canary: {record.divergence.get('summary', '')}")
    for reason in record.reasons:
        say(f"reason: {reason}")
    progress(f"signed re-gate evidence: {outcome.folder}; run folder {outcome.run_dir}")
