"""gate/price.py keeps --price-seconds: a set whose one gate judgement is foreseen to take longer is not simulated, and
says so (a BLEU set's judgement aggregates the set twice per bootstrap resample: minutes at 250 items)."""

from __future__ import annotations

import time

from pipelines.evaluation.metrics import make_spec
from pipelines.gate.policy import load_gate_policy
from pipelines.gate.price import judgement_seconds, measured_noise, simulated_price

RULES = load_gate_policy(None)[0].for_set(None, "texts")


def _pairs(n: int) -> list[list[str]]:
    return [[f"the order {i} was sent to the customer on monday", f"the order {i} was sent to a customer on monday"] for i in range(n)]


def test_a_text_set_whose_judgement_outlasts_the_budget_is_not_simulated() -> None:
    spec = make_spec("bleu", "bleu")
    values = _pairs(250)
    assert judgement_seconds(spec, values) > 0.5
    noise = measured_noise(spec, values, values, "model")
    started = time.monotonic()
    price = simulated_price("texts", spec, RULES, 250, noise, seconds=0.5)
    assert time.monotonic() - started < 30
    assert price.reps == 0 and price.pass_rate is None and price.method.startswith("not simulated")
    assert "--price-seconds" in price.method


def test_averaged_metrics_are_foreseen_to_cost_nothing() -> None:
    assert judgement_seconds(make_spec("score", "mean"), [0.5] * 1000) == 0.0
