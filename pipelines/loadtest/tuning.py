"""Measured tuning: the largest max_num_seqs the sweep showed meeting the SLOs, next to the planner's.

The measured value is the top of the longest run of swept levels, from 1 up, at which the model's requests all
completed and (when the policy sets SLO targets) its good fraction reached `slo.min_good_fraction`: a level
that passes only above one that failed is noise, not capacity. It was measured on this machine's serve target
and with the servers' own max_num_seqs, which bounds the sweep. gpu_memory_utilization comes from the planner
for that many sequences on the policy's fit GPU when the policy names one; otherwise it is the utilization
the servers ran with (on CPU: the share of host memory vLLM may take), with the measured memory peak beside it.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.errors import InputError
from pipelines.loadtest.config import PerformancePolicy
from pipelines.loadtest.results import ModelFigures, Tuning
from pipelines.planner import Plan
from pipelines.planner import plan as make_plan
from pipelines.serve.serving import ServeSettings


def meets(level, policy: PerformancePolicy) -> bool:
    if level.failed:
        return False
    return level.good_fraction is None or level.good_fraction + 1e-9 >= policy.slo.min_good_fraction


def measured_max_num_seqs(model: ModelFigures, policy: PerformancePolicy) -> int | None:
    best = None
    for level in sorted(model.levels, key=lambda item: item.concurrency):
        if not meets(level, policy):
            break
        best = level.concurrency
    return best


def measured_tuning(
    model: ModelFigures, policy: PerformancePolicy, serve: ServeSettings, *, swept_up_to: int, limited_by: str | None,
    plan: dict | None, artifact_dir: Path, target: str,
) -> Tuning:
    measured = measured_max_num_seqs(model, policy)
    tuning = Tuning(measured_max_num_seqs=measured, swept_up_to=swept_up_to, limited_by=limited_by)
    planned = _planner_row(plan)
    if planned is not None:
        tuning = tuning.model_copy(update={
            "planner_max_num_seqs": planned.max_num_seqs, "planner_gpu_memory_utilization": planned.gpu_memory_utilization,
        })
    if measured is None:
        return tuning.model_copy(update={"basis": f"no swept level met the SLOs on {target}"})
    replanned = _replan(plan, artifact_dir, measured) if plan else None
    if plan and replanned is not None:
        utilization, batched = replanned.gpu_memory_utilization, replanned.max_num_batched_tokens
        basis = (f"max_num_seqs measured on {target}; gpu_memory_utilization: the planner's for {measured} sequences of "
                 f"{replanned.max_model_len} tokens on {plan['gpu']['name']}")
    else:
        utilization, batched = serve.memory_fraction, None
        basis = (f"max_num_seqs measured on {target}; gpu_memory_utilization: the servers' own setting"
                 + (" (on CPU: the share of host memory vLLM may take)" if target.split(":")[0] == "cpu" else ""))
    args = f"--max-num-seqs {measured} --max-model-len {serve.max_model_len} --gpu-memory-utilization {utilization:.2f}"
    if batched is not None:
        args += f" --max-num-batched-tokens {batched}"
    return tuning.model_copy(update={"gpu_memory_utilization": utilization, "basis": basis, "vllm_args": args})


def _planner_row(plan: dict | None):
    if not plan:
        return None

    return Plan.model_validate(plan).fit_row().recommended


def _replan(plan: dict, artifact_dir: Path, concurrency: int):
    """The planner's recommendation for `concurrency` sequences on the plan's GPU (None when it does not fit)."""

    old = Plan.model_validate(plan)
    try:
        fresh = make_plan(artifact_dir / "config.json", [], old.gpu, old.max_model_len, concurrency,
                          artifact_dir=artifact_dir, settings=old.settings)
    except InputError:
        return None
    return fresh.fit_row().recommended
