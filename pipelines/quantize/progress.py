"""Quantize progress as llm-compressor itself reports it: subgraph k of n, counted when its pipeline says so.

Every calibrating recipe runs llm-compressor's sequential pipeline. It traces the model into subgraphs (the
embeddings, one per decoder layer, the last with the final norm and lm_head: num_hidden_layers + 1 on the
families we ship) and takes them one at a time: a calibration forward over every sample, then the
SEQUENTIAL_EPOCH_END event, at which the modifiers finish that subgraph (SmoothQuant smooths it, GPTQ
quantizes its Linear layers), then a propagation forward that feeds the next subgraph. oneshot's default
`independent` pipeline runs one such pass per calibrating modifier: w8a8 (SmoothQuant, then GPTQ) is two
passes over the whole model.

`following_llmcompressor(bar)` counts exactly that, from llm-compressor's own sources:

- the count: one per SEQUENTIAL_EPOCH_END dispatched during a sequential pass, after the modifiers handled
  it (CompressionSession.event, through which every LifecycleCallbacks event goes);
- the total: the number of subgraphs `trace_subgraphs` built for the pass, times the number of sequential
  passes the pipeline oneshot chose will run (CalibrationPipeline.from_modifiers, as llm-compressor infers it).

What this replaced, a forward pre-hook on each decoder layer taken to mean "the layers before it are done",
fires 2 x samples times per layer per pass (calibration and propagation) and could not tell passes apart: on
w8a8 it reached the last layer at the end of the quick SmoothQuant pass and stayed there through the whole
GPTQ pass ("layer 17/18, ~40 s left" for minutes on Gemma 3 while llm-compressor was at 11/18).

Data-free recipes (round-to-nearest weights) trace nothing and run no forward: the bar has no total and
ends when oneshot returns. Nothing here changes what llm-compressor computes; every wrapper calls the
original first and is removed on exit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.console.progress import Bar


class _Follower:
    """The count of one oneshot run, fed by the wrappers below."""

    def __init__(self, bar: Bar) -> None:
        self.bar = bar
        self.planned: int | None = None  # sequential passes the chosen pipeline will run (None: not seen yet)
        self.passes: list[int] = []  # subgraphs of each sequential pass begun so far
        self.done_in_pass = 0
        self.done = 0  # subgraphs finished, all passes
        self.in_pass = False
        self._lock = threading.Lock()

    def total(self) -> int:
        """Subgraphs traced so far plus, for each planned pass not begun, as many as the last one had."""
        remaining = max(0, (self.planned or 0) - len(self.passes))
        return sum(self.passes) + remaining * (self.passes[-1] if self.passes else 0)

    def pipeline_chosen(self, sequential_passes: int) -> None:
        with self._lock:
            if self.planned is None:  # the first choice is oneshot's own; later ones are the independent pipeline's
                self.planned = sequential_passes

    def traced(self, subgraphs: int) -> None:
        with self._lock:
            self.passes.append(subgraphs)
            self.done_in_pass = 0
            self.in_pass = True
            total = self.total()
        self.bar.update(total=total)

    def epoch_end(self) -> None:
        with self._lock:
            if not self.in_pass or self.done_in_pass >= self.passes[-1]:
                return  # a data-free or basic pipeline's single epoch end: no subgraph
            self.done_in_pass += 1
            self.done += 1
            done = self.done
        self.bar.update(completed=done)

    def calibration_end(self) -> None:
        with self._lock:
            self.in_pass = False


def sequential_passes(pipeline: Any, modifiers: list[Any], choose: Any) -> int:
    """How many sequential passes `pipeline` runs over `modifiers`; `choose(modifiers)` is llm-compressor's own
    CalibrationPipeline.from_modifiers (the independent pipeline asks it once per modifier)."""
    from llmcompressor.pipelines.independent import IndependentPipeline  # heavy: imported when used
    from llmcompressor.pipelines.sequential import SequentialPipeline  # heavy: imported when used

    if isinstance(pipeline, SequentialPipeline):
        return 1
    if isinstance(pipeline, IndependentPipeline):
        return sum(isinstance(choose([modifier]), SequentialPipeline) for modifier in modifiers)
    return 0


@contextmanager
def following_llmcompressor(bar: Bar) -> Iterator[None]:
    """While the block runs oneshot, `bar` counts the subgraphs llm-compressor's sequential pipeline has
    finished, out of all it will run (module docstring). One oneshot per block; the wrappers are removed on exit."""
    import llmcompressor.pipelines.sequential.pipeline as sequential  # heavy: imported when used
    from llmcompressor.core.events import EventType  # heavy: imported when used
    from llmcompressor.core.session import CompressionSession  # heavy: imported when used
    from llmcompressor.pipelines.registry import CalibrationPipeline  # heavy: imported when used

    follower = _Follower(bar)
    original_event = CompressionSession.event
    original_trace = sequential.trace_subgraphs
    original_choice = CalibrationPipeline.__dict__["from_modifiers"]  # the classmethod object, restored as it is

    def event(session: Any, event_type: Any, *args: Any, **kwargs: Any) -> Any:
        state = original_event(session, event_type, *args, **kwargs)  # the modifiers have handled it
        if event_type == EventType.SEQUENTIAL_EPOCH_END:
            follower.epoch_end()
        elif event_type == EventType.CALIBRATION_END:
            follower.calibration_end()
        return state

    def trace_subgraphs(*args: Any, **kwargs: Any) -> Any:
        subgraphs = original_trace(*args, **kwargs)
        follower.traced(len(subgraphs))
        return subgraphs

    def from_modifiers(cls: Any, modifiers: list[Any], user: str | None = None) -> Any:
        pipeline = original_choice.__func__(cls, modifiers, user)
        follower.pipeline_chosen(sequential_passes(pipeline, modifiers, lambda chosen: original_choice.__func__(cls, chosen)))
        return pipeline

    with ExitStack() as restore:
        for owner, name, original, wrapper in (
            (CompressionSession, "event", original_event, event),
            (sequential, "trace_subgraphs", original_trace, trace_subgraphs),
            (CalibrationPipeline, "from_modifiers", original_choice, classmethod(from_modifiers)),
        ):
            restore.callback(setattr, owner, name, original)
            setattr(owner, name, wrapper)
        yield
