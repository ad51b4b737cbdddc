"""What the shape probe predicts for a whole model: its Linear time per decode step and per prefill chunk, quantized
against 16-bit, and the throughput ratio of a workload.

The model's Linear time at `rows` rows is the sum over its vLLM Linears of (layers holding it) x (ms per call), for the
quantized model and for the 16-bit one; their ratio is the speed of the model's Linears. Everything else a server does
per step (attention over the KV cache, norms, rotary embeddings, sampling, the scheduler, HTTP) is not changed by
weight quantization, so the end-to-end ratio lies between 1 and this one: the direction carries over, the size shrinks
by the share of time spent outside the Linears.

A workload of P prompt tokens and O output tokens at concurrency C costs, in Linear time, P / PREFILL_ROWS prefill
chunks plus O / B decode steps at batch B = min(C, max_num_seqs) (decode times interpolated linearly in the batch
between the probed sizes); its throughput ratio is the 16-bit time over the quantized time, and its direction is
"faster" above 1 + NO_DIFFERENCE, "slower" below 1 - NO_DIFFERENCE, else no difference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, computed_field

from pipelines.artifact import CONFIG_NAME
from pipelines.hardware.host import HostProfile, LastLevelCache, host_profile, last_level_cache, serve_threads
from pipelines.hardware.kernels import KernelCase
from pipelines.hardware.shape_probe import PREFILL_ROWS, ShapeCase, ShapeFact, decode_rows, shape_facts
from pipelines.hardware.shapes import (
    DTYPE_BYTES,
    UNKNOWN_LLC_BYTES,
    CheckpointLinear,
    ShapeUse,
    VllmLinear,
    artifact_linear_cases,
    copies_for,
    nominal_bytes,
    recipe_cases,
    vllm_linears,
    working_set,
)
from pipelines.recipe import GroupScheme

NO_DIFFERENCE = 0.10  # within +-10% of 1: the load test's own band
Direction = Literal["faster", "slower", "no difference within ±10%"]


def direction_of(speed: float) -> Direction:
    if speed > 1 + NO_DIFFERENCE:
        return "faster"
    if speed < 1 - NO_DIFFERENCE:
        return "slower"
    return "no difference within ±10%"


class ShapeTiming(BaseModel):
    """One vLLM Linear of the model under its scheme: what the probe built and measured."""

    linear: VllmLinear
    layers: int = Field(description="decoder layers holding this Linear with this scheme")
    case_key: str | None = Field(description="the kernel case (None: kept in 16 bits)")
    scheme_label: str
    scheme: str | None = Field(default=None, description="vLLM's compressed-tensors scheme class")
    kernel: str | None = Field(default=None, description="the linear kernel vLLM chose")
    error: str | None = None
    copies: dict[str, int] = Field(description="copies timed per format (quant, base): the working set")
    fresh_ms: dict[str, float] = Field(default={}, description="ms of a first call at a row count never seen, per format")
    quant_ms: dict[int, float] = {}
    base_ms: dict[int, float] = {}

    def speed(self, rows: int) -> float | None:
        """16-bit time over quantized time at `rows` rows (above 1: the quantized Linear is faster)."""
        quant, base = self.quant_ms.get(rows), self.base_ms.get(rows)
        return base / quant if quant and base else None


class WorkloadPrediction(BaseModel):
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    decode_batch: int = Field(description="min(concurrency, max_num_seqs)")
    linear_time_ratio: float = Field(description="the model's Linear time, quantized over 16-bit")
    throughput_ratio: float = Field(description="16-bit Linear time over quantized: the predicted throughput ratio's far end")
    direction: Direction
    prefill_share: float = Field(description="share of the 16-bit Linear time spent on prompts")


class ShapePrediction(BaseModel):
    """The shape probe's prediction for one model under one recipe or artifact on this host."""

    model: str
    source: str = Field(description="the recipe or artifact the schemes come from")
    host_class: str
    cpu_model: str
    serve_dtype: str
    vllm_version: str
    threads: int = Field(description="threads the probe computed with: as vLLM's worker here")
    llc: LastLevelCache
    working_set: dict[str, int] = Field(description="bytes of the model's Linear weights per format (base, quant)")
    max_num_seqs: int
    decode_rows: list[int]
    prefill_rows: int
    shapes: list[ShapeTiming]
    probe_seconds: float = Field(description="seconds this prediction spent probing (0: from the cache)")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def error(self) -> str | None:
        """Why a shape could not be timed (then no prediction is made)."""
        return next((f"{shape.linear.name}: {shape.error}" for shape in self.shapes if shape.error), None)

    def linear_ms(self, rows: int, quantized: bool) -> float:
        """The model's Linear time at `rows` rows (a probed count, or a decode batch between two), in ms."""
        probed = sorted({*self.decode_rows, self.prefill_rows})
        if rows in probed:
            return sum(shape.layers * (shape.quant_ms if quantized else shape.base_ms)[rows] for shape in self.shapes)
        rows = min(max(rows, probed[0]), max(self.decode_rows))
        low = max(r for r in self.decode_rows if r <= rows)
        high = min(r for r in self.decode_rows if r >= rows)
        at_low, at_high = self.linear_ms(low, quantized), self.linear_ms(high, quantized)
        return at_low if high == low else at_low + (at_high - at_low) * (rows - low) / (high - low)

    def speed(self, rows: int) -> float | None:
        """The model's Linears at `rows` rows: 16-bit time over quantized time (None: a shape was not timed)."""
        return None if self.error else self.linear_ms(rows, False) / self.linear_ms(rows, True)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fresh_rows_ms(self) -> dict[str, float]:
        """The model's Linears meeting a row count for the first time (a new prompt-batch size), in ms per format:
        vLLM's oneDNN handlers build a primitive per row count, a cost the steady-state speeds leave out."""
        return {name: sum(shape.layers * shape.fresh_ms.get(name, 0.0) for shape in self.shapes) for name in ("base", "quant")}

    @computed_field  # type: ignore[prop-decorator]
    @property
    def decode_speeds(self) -> dict[int, float | None]:
        return {rows: self.speed(rows) for rows in self.decode_rows}

    @computed_field  # type: ignore[prop-decorator]
    @property
    def prefill_speed(self) -> float | None:
        return self.speed(self.prefill_rows)

    def workload(self, prompt_tokens: int, output_tokens: int, concurrency: int) -> WorkloadPrediction | None:
        """The predicted throughput ratio of a workload (None: a shape was not timed)."""
        if self.error or prompt_tokens < 0 or output_tokens < 0 or concurrency < 1 or prompt_tokens + output_tokens == 0:
            return None
        batch = min(concurrency, self.max_num_seqs)
        chunks, steps = prompt_tokens / self.prefill_rows, output_tokens / batch
        base_prefill = chunks * self.linear_ms(self.prefill_rows, False)
        base = base_prefill + steps * self.linear_ms(batch, False)
        quant = chunks * self.linear_ms(self.prefill_rows, True) + steps * self.linear_ms(batch, True)
        return WorkloadPrediction(prompt_tokens=prompt_tokens, output_tokens=output_tokens, concurrency=concurrency, decode_batch=batch,
                                  linear_time_ratio=quant / base, throughput_ratio=base / quant, direction=direction_of(base / quant),
                                  prefill_share=base_prefill / base)

    def throughput_ratio(self, prompt_tokens: int, output_tokens: int, concurrency: int) -> float | None:
        """Candidate over 16-bit throughput predicted for the Linears alone (the end-to-end ratio lies between 1 and it)."""
        found = self.workload(prompt_tokens, output_tokens, concurrency)
        return found.throughput_ratio if found else None

    def direction(self, prompt_tokens: int, output_tokens: int, concurrency: int) -> Direction | None:
        found = self.workload(prompt_tokens, output_tokens, concurrency)
        return found.direction if found else None


# ------------------------------------------------------------------------------------ entry points


def predict_for_artifact(linears: Sequence[CheckpointLinear], artifact_dir: Path, max_num_seqs: int, *,
                         profile: HostProfile | None = None, probe_missing: bool = True) -> ShapePrediction:
    """The prediction for a compressed-tensors artifact: `linears` are its checkpoint Linears (the planner's
    `decoder_linears` for every layer of its shape), their schemes read from its config.json. `probe_missing=False`:
    from the cache only (a shape never probed here leaves the prediction without a figure)."""
    cases = artifact_linear_cases(Path(artifact_dir) / CONFIG_NAME, [linear.name for linear in linears])
    return predict(vllm_linears(linears, cases), max_num_seqs, model=Path(artifact_dir).name, source=str(artifact_dir), profile=profile,
                   probe_missing=probe_missing)


def predict_for_recipe(linears: Sequence[CheckpointLinear], schemes: Mapping[str, GroupScheme | None], max_num_seqs: int, *,
                       model: str, recipe: str, profile: HostProfile | None = None) -> ShapePrediction:
    """The prediction for a model under a recipe: `schemes` by checkpoint Linear name (the planner's `linear_schemes`)."""
    return predict(vllm_linears(linears, recipe_cases(linears, schemes)), max_num_seqs, model=model, source=recipe, profile=profile)


def predict(uses: list[ShapeUse], max_num_seqs: int, *, model: str, source: str, profile: HostProfile | None = None,
            probe_missing: bool = True) -> ShapePrediction:
    """Probe (or read from the cache) every shape of `uses` at the decode batches up to `max_num_seqs` and one
    prefill chunk, and add them up."""
    profile = profile or host_profile()
    dtype, threads, llc = profile.serve_dtype, serve_threads(), last_level_cache()
    dtype_bytes = DTYPE_BYTES.get(dtype, 2)
    totals = working_set(uses, dtype_bytes)
    rows = (*decode_rows(max_num_seqs), PREFILL_ROWS)
    cases = [_shape_case(use, totals, llc.bytes or UNKNOWN_LLC_BYTES, dtype_bytes, rows) for use in uses]
    facts, seconds = shape_facts(profile, cases, dtype=dtype, threads=threads, probe_missing=probe_missing)
    return ShapePrediction(
        model=model, source=source, host_class=profile.host_class, cpu_model=profile.cpu_model, serve_dtype=dtype,
        vllm_version=profile.vllm_version, threads=threads, llc=llc, working_set={"base": totals[0], "quant": totals[1]},
        max_num_seqs=max_num_seqs, decode_rows=list(rows[:-1]), prefill_rows=PREFILL_ROWS,
        shapes=[_timing(use, case, facts.get(case.key)) for use, case in zip(uses, cases, strict=True)], probe_seconds=seconds,
    )


def _shape_case(use: ShapeUse, totals: tuple[int, int], llc_bytes: int, dtype_bytes: int, rows: tuple[int, ...]) -> ShapeCase:
    base_copy, quant_copy = nominal_bytes(use.linear, None, dtype_bytes), nominal_bytes(use.linear, use.case, dtype_bytes)
    return ShapeCase(linear=use.linear, case=use.case, rows=rows, copies_base=copies_for(totals[0], base_copy, llc_bytes),
                     copies_quant=copies_for(totals[1], quant_copy, llc_bytes))


def _timing(use: ShapeUse, case: ShapeCase, fact: ShapeFact | None) -> ShapeTiming:
    label = use.case.label if isinstance(use.case, KernelCase) else "16-bit (kept)"
    fact = fact or ShapeFact(key=case.key, error="not probed (the probe returned no result for it)")
    return ShapeTiming(
        linear=use.linear, layers=use.layers, case_key=use.case.key if use.case else None, scheme_label=label, scheme=fact.scheme,
        kernel=fact.kernel if use.case else "16-bit", error=fact.error, copies={"quant": case.copies_quant, "base": case.copies_base},
        fresh_ms=fact.fresh_ms, quant_ms={int(k): v for k, v in fact.quant_ms.items()},
        base_ms={int(k): v for k, v in fact.base_ms.items()},
    )
