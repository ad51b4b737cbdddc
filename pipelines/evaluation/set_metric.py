"""An eval set's primary metric: the first `metric_list` entry of its task YAML, with lm-eval's defaults for what it
leaves out, refused where lm-eval logs no per-item value of it or the gate cannot judge its aggregation. The task's
other keys are checked by pipelines.evaluation.evalsets, which calls `metric_spec` once per set."""

from __future__ import annotations

from typing import Any

from pipelines.errors import InputError
from pipelines.evaluation.metrics import CORPUS_AGGREGATIONS, DEFAULT_METRIC, MetricSpec, make_spec
from pipelines.files.yamlio import FunctionRef

ROLLING = "loglikelihood_rolling"
# The per-item metrics lm-eval's ConfigurableTask.process_results (lm_eval/api/task.py) logs for each output
# type; a task with its own `process_results` logs whatever that function returns. `likelihood` is left
# out: lm-eval logs it as (gold, loglikelihoods) yet averages it, which fails.
PRODUCED_METRICS = {
    "generate_until": frozenset({"exact_match", "bleu", "chrf", "chrf++", "ter"}),
    "multiple_choice": frozenset({"acc", "acc_norm", "acc_bytes", "acc_mutual_info", "exact_match", "f1", "mcc", "brier_score"}),
    "loglikelihood": frozenset({"perplexity", "acc"}),
    ROLLING: frozenset({"word_perplexity", "byte_perplexity", "bits_per_byte"}),
}
FIRST_METRIC = "metric_list[0]"
JUDGED_AGGREGATIONS = CORPUS_AGGREGATIONS | {"mean"}


def metric_spec(config: dict, where: str) -> MetricSpec:
    """The first metric_list entry, with lm-eval's defaults for what it leaves out; refused if the gate cannot judge it."""
    entries = config.get("metric_list")
    if entries is None:
        return make_spec(*DEFAULT_METRIC[config["output_type"]])
    entry = _first_metric(entries, where)
    name = _metric_name(entry["metric"])
    _check_produced(name, entry["metric"], config, where)
    default_aggregation, default_direction = lm_eval_metric_defaults(name)
    aggregation = entry.get("aggregation", default_aggregation)
    higher_is_better = entry.get("higher_is_better", default_direction)
    aggregation = _check_aggregation(name, aggregation, default_aggregation, where)
    if not isinstance(higher_is_better, bool):
        got = f"lm-eval has no default for {name!r}" if higher_is_better is None else f"got {higher_is_better!r}"
        raise InputError(f"must be true or false ({got})", file=where, field=f"{FIRST_METRIC}.higher_is_better")
    return make_spec(name, aggregation, higher_is_better)


def _first_metric(entries: Any, where: str) -> dict:
    if not isinstance(entries, list) or not entries:
        raise InputError("a list of {metric: ...} entries, the first one judged", file=where, field="metric_list")
    entry = entries[0]
    if not isinstance(entry, dict) or not isinstance(entry.get("metric"), str) or not entry["metric"]:
        raise InputError("needs a metric name", file=where, field=f"{FIRST_METRIC}.metric")
    return entry


def _metric_name(metric: str) -> str:
    """lm-eval names a `!function` metric by the function's __name__ (lm_eval/api/task.py)."""
    return metric.rsplit(".", 1)[-1] if isinstance(metric, FunctionRef) else metric


def _check_produced(name: str, metric: str, config: dict, where: str) -> None:
    output_type = config["output_type"]
    if isinstance(config.get("process_results"), FunctionRef):
        return  # the task's own function decides what is logged
    if isinstance(metric, FunctionRef) and output_type == "generate_until":
        return  # called on each (reference, prediction) pair
    produced = PRODUCED_METRICS[output_type]
    if name not in produced:
        raise InputError(
            f"lm-eval logs no per-item {name!r} for {output_type} (it logs {', '.join(sorted(produced))}; "
            "a task's own process_results may log others)",
            file=where, field=f"{FIRST_METRIC}.metric",
        )


def _check_aggregation(name: str, aggregation: Any, default: str | None, where: str) -> str:
    """The aggregation, refused unless the gate can judge it and it can aggregate the metric's per-item values."""
    field = f"{FIRST_METRIC}.aggregation"
    if aggregation is None:
        raise InputError(f"lm-eval has no default aggregation for {name!r}: give one", file=where, field=field)
    if isinstance(aggregation, FunctionRef) or not isinstance(aggregation, str) or aggregation not in JUDGED_AGGREGATIONS:
        raise InputError(
            f"the gate cannot judge aggregation {aggregation!r}: use mean or one of {', '.join(sorted(CORPUS_AGGREGATIONS))}",
            file=where, field=field,
        )
    # A registered metric is logged per item as a number (mean) or as a list (corpus): the other kind fails in lm-eval.
    if default is not None and (aggregation == "mean") != (default == "mean"):
        raise InputError(f"{aggregation!r} cannot aggregate {name!r}; lm-eval's own aggregation for it is {default!r}", file=where, field=field)
    return aggregation


def lm_eval_metric_defaults(name: str) -> tuple[str | None, bool | None]:
    """The aggregation name and direction lm-eval registers for a metric (lm_eval/api/metrics.py); None if unregistered."""
    import lm_eval.api.metrics  # noqa: F401 - registers lm-eval's metrics and aggregations

    # heavy: imported when used
    from lm_eval.api.registry import (
        AGGREGATION_REGISTRY,
        HIGHER_IS_BETTER_REGISTRY,
        METRIC_AGGREGATION_REGISTRY,
    )

    aggregation_names = {function: key for key, function in AGGREGATION_REGISTRY.items()}
    return aggregation_names.get(METRIC_AGGREGATION_REGISTRY.get(name, None)), HIGHER_IS_BETTER_REGISTRY.get(name, None)
