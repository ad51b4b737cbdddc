"""Quantize progress follows llm-compressor's own pipeline: subgraph k is counted only after llm-compressor
finished subgraph k, and the total is every subgraph of every sequential pass it runs.

Real oneshot runs on tiny random models of several families (tests/families.py), with a calibrating recipe
of two passes (SmoothQuant, then int8 weights with static per-tensor activation scales: oneshot's
independent pipeline gives each its own sequential pass) and with GPTQ. What llm-compressor finished is
recorded at its modifiers (Modifier.update_event, where SmoothQuant smooths and GPTQ quantizes a subgraph's
layers), independently of how pipelines.quantize.progress listens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from families import make_family_model, tokenizer_texts

from pipelines.console.progress import Bar
from pipelines.quantize.calibration import calibration_dataset
from pipelines.quantize.progress import following_llmcompressor

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

SAMPLES = 2
STATIC_INT8 = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False},
}
INT4_WEIGHTS = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}


def smoothquant_then_static() -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    return [SmoothQuantModifier(smoothing_strength=0.5), QuantizationModifier(config_groups={"int8": STATIC_INT8}, ignore=["lm_head"])]


def gptq_down_proj() -> list[Any]:
    """GPTQ on one Linear per layer: GPTQ's own per-subgraph compression, in a few seconds on a CPU."""
    from llmcompressor.modifiers.quantization import GPTQModifier

    return [GPTQModifier(config_groups={"int4": {**INT4_WEIGHTS, "targets": ["re:.*mlp\\.down_proj$"]}}, ignore=["lm_head"])]


def round_to_nearest() -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(config_groups={"int4": INT4_WEIGHTS}, ignore=["lm_head"])]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = make_family_model(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def run(model_dir: Path, recipe: list[Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Bar, list[tuple[Any, ...]]]:
    """oneshot as pipelines.quantize.oneshot.run_oneshot runs it, inside following_llmcompressor; returns the bar and
    the timeline: ("done", modifier, modules) when a modifier has handled a SEQUENTIAL_EPOCH_END, ("bar", k, n)
    at each change of the bar."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers import Modifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    timeline: list[tuple[Any, ...]] = []
    handled = Modifier.update_event

    def update_event(self: Any, state: Any, event: Any, **kwargs: Any) -> Any:
        result = handled(self, state, event, **kwargs)
        if event.type_.name == "SEQUENTIAL_EPOCH_END":
            timeline.append(("done", type(self).__name__, len(kwargs["modules"])))
        return result

    monkeypatch.setattr(Modifier, "update_event", update_event)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    dataset = calibration_dataset(tokenizer, tokenizer_texts(SAMPLES), 32)
    bar = Bar("quantize", None, "subgraph", emit=None, on_change=lambda b: timeline.append(("bar", b.completed, b.total)))
    with following_llmcompressor(bar):
        oneshot(model=model, recipe=recipe, dataset=dataset, num_calibration_samples=SAMPLES,
                shuffle_calibration_samples=False, max_seq_length=32)
    return bar, timeline


def assert_counts_follow_llmcompressor(bar: Bar, timeline: list[tuple[Any, ...]], expected_total: int) -> None:
    counts = [event[1] for event in timeline if event[0] == "bar"]
    assert bar.total == expected_total and bar.completed == expected_total
    assert counts == sorted(counts) and counts[-1] == expected_total  # rises monotonically to n
    assert {event[2] for event in timeline if event[0] == "bar"} == {expected_total}  # n known from the first trace on
    done = 0
    for event in timeline:
        if event[0] == "done":
            done += 1
        else:
            assert event[1] == done, f"count {event[1]} reported after {done} subgraphs finished: {timeline}"
    assert done == expected_total
    assert sorted(set(counts) - {0}) == list(range(1, expected_total + 1))  # every subgraph, none skipped
    assert bar.line().startswith(f"quantize: subgraph {expected_total}/{expected_total}, ")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3"])
def test_two_passes_count_every_subgraph_after_llmcompressor_finished_it(family: str, family_dir, monkeypatch) -> None:
    model_dir = family_dir(family)
    bar, timeline = run(model_dir, smoothquant_then_static(), monkeypatch)
    layers = 4  # tests/families.py: the embeddings, one subgraph per layer (the last with norm and lm_head)
    assert_counts_follow_llmcompressor(bar, timeline, expected_total=2 * (layers + 1))
    passes = [event[1] for event in timeline if event[0] == "done"]
    assert passes == ["SmoothQuantModifier"] * (layers + 1) + ["QuantizationModifier"] * (layers + 1)
    # the first pass ends half-way: what the old per-layer pre-hook showed as "layer 3/4" all through the second
    assert ("bar", layers + 1, 2 * (layers + 1)) in timeline


@pytest.mark.slow
def test_gptq_counts_a_subgraph_once_its_layers_are_quantized(family_dir, monkeypatch) -> None:
    bar, timeline = run(family_dir("gemma3"), gptq_down_proj(), monkeypatch)
    assert_counts_follow_llmcompressor(bar, timeline, expected_total=5)


def test_round_to_nearest_traces_nothing_and_counts_nothing(family_dir, monkeypatch) -> None:
    bar, timeline = run(family_dir("llama"), round_to_nearest(), monkeypatch)
    # the data-free pipeline's one epoch end, over the whole model, is no subgraph: the bar waits for oneshot
    assert [event[:2] for event in timeline] == [("done", "QuantizationModifier")]
    assert bar.total is None and bar.completed == 0


def test_llmcompressor_is_left_as_it_was(family_dir, monkeypatch) -> None:
    import llmcompressor.pipelines.sequential.pipeline as sequential
    from llmcompressor.core.session import CompressionSession
    from llmcompressor.pipelines.registry import CalibrationPipeline

    before = (CompressionSession.event, sequential.trace_subgraphs, CalibrationPipeline.__dict__["from_modifiers"])
    bar = Bar("quantize", None, "subgraph", emit=None)
    with pytest.raises(RuntimeError), following_llmcompressor(bar):
        assert CompressionSession.event is not before[0]
        raise RuntimeError("oneshot failed")
    assert (CompressionSession.event, sequential.trace_subgraphs, CalibrationPipeline.__dict__["from_modifiers"]) == before
