"""What a gate run drives: the servers it starts, the scorer, the KL requests, the prompts and their length check,
the load test after a promoted gate and the canary's golden set. run_gate takes one GateStack; the real one unless told
otherwise (a test hands it a fake, tests/fakes.py, instead of patching the runner's names)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from pipelines.canary.build import fix_golden
from pipelines.evaluation.divergence import baseline_references, candidate_topk
from pipelines.evaluation.evaluate import check_prompt_lengths, load_all_prompts, score_eval_sets
from pipelines.loadtest.gate_hook import after_quality_gate
from pipelines.serve.serving import RunningServer, vllm_server


@dataclass(frozen=True)
class GateStack:
    serve: Callable[..., AbstractContextManager[RunningServer]] = vllm_server
    score: Callable[..., dict[str, Any]] = score_eval_sets
    references: Callable[..., list[Any]] = baseline_references
    topk: Callable[..., list[Any]] = candidate_topk
    prompts: Callable[..., dict[str, list[Any]]] = load_all_prompts
    check_lengths: Callable[..., None] = check_prompt_lengths
    load_test: Callable[..., tuple[Any, Any]] = after_quality_gate
    golden: Callable[..., Any] = fix_golden  # the canary's golden set, fixed on the promoted candidate's server


REAL_STACK = GateStack()
