"""The canary's error rates, by simulation on the toy model of fake_openai.py (no HTTP): a tolerance measured from two
self-checks, then many probes of the same weights under fresh noise (false alarms) and of perturbed weights (misses).

The toy model's noise is independent per logit and request, a stand-in for vLLM's batch-dependent numerics; its
near ties flip between passes (measured on vLLM: about 1 answer in 240), which the margin rule must absorb."""

from __future__ import annotations

import random

import pytest
from fake_openai import ToyModel
from scipy.stats import beta

from pipelines.canary.build import summarize, tolerance_from
from pipelines.canary.compare import Answer, distance, judge
from pipelines.canary.golden import GoldenPrompt, Tolerance

PROMPTS, TOKENS, TOP_K = 24, 16, 8
pytestmark = pytest.mark.slow  # 200 simulated probes of each kind: about 10 s of CPU


def answer(model: ToyModel, prompt: list[int]) -> Answer:
    body = model.complete(prompt, TOKENS, TOP_K)["choices"][0]["logprobs"]
    return Answer(ids=[int(t.split(":")[1]) for t in body["tokens"]], top_logprobs=body["top_logprobs"])


def golden(model: ToyModel, prompts: list[list[int]]) -> tuple[list[GoldenPrompt], Tolerance]:
    recorded = [answer(model, p) for p in prompts]
    golden = [GoldenPrompt(id=f"p{i:02d}", eval_set="s", doc_id=i, text="", prompt_ids=p, answer_ids=a.ids, answer_text="",
                           top_logprobs=a.top_logprobs) for i, (p, a) in enumerate(zip(prompts, recorded, strict=True))]
    checks = [summarize(name, 1, [distance(g, answer(model, g.prompt_ids), TOP_K) for g in golden], 0.0) for name in ("alone", "load")]
    return golden, tolerance_from(checks)


def unhealthy(model: ToyModel, golden: list[GoldenPrompt], tolerance: Tolerance) -> bool:
    disagreeing = sum(judge(distance(g, answer(model, g.prompt_ids), TOP_K), tolerance).disagrees for g in golden)
    return disagreeing > tolerance.max_disagreeing


def upper_95(failures: int, trials: int) -> float:
    """One-sided 95% Clopper-Pearson upper bound of a rate."""
    return 1.0 if failures == trials else float(beta.ppf(0.95, failures + 1, trials - failures))


def test_false_alarms_and_misses_by_simulation() -> None:
    rng = random.Random(3)
    false_alarms = misses = trials = 0
    for build in range(10):  # ten promotions, each with its own golden set and measured tolerance
        prompts = [[1] + [rng.randrange(3, 40) for _ in range(6)] for _ in range(PROMPTS)]
        same = ToyModel(weights=0, noise=0.01)
        golden_set, tolerance = golden(same, prompts)
        for _ in range(20):
            trials += 1
            false_alarms += unhealthy(same, golden_set, tolerance)
            misses += not unhealthy(ToyModel(weights=build + 1, noise=0.01, perturb=0.5), golden_set, tolerance)
    # Stated rates (docs/watch.md): per probe, false alarms <= 1.5% and misses <= 1.5% at 95% confidence on this model.
    assert false_alarms == 0 and upper_95(false_alarms, trials) < 0.015, (false_alarms, trials)
    assert misses == 0 and upper_95(misses, trials) < 0.015, (misses, trials)
