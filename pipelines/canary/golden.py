"""The golden set a promoted version carries (evidence/canary.json, inside its signed bundle): prompts drawn from the
business eval sets, the promoted model's greedy answers with their per-token top-k log-probabilities, the generation
settings, and the tolerance measured from what the same weights do against themselves (pipelines.canary.build).

Prompts and answers are token ids: the probe sends the ids (no tokenizer on the way) and compares ids, so a server with
another tokenizer or other weights cannot agree by rendering the same text."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from pipelines.bounds import MiB
from pipelines.errors import InputError, from_validation_error
from pipelines.files.jsonio import read_json_object
from pipelines.schema import FrozenModel

GOLDEN_FILE = "canary.json"
EVIDENCE_DIR = "evidence"  # pipelines.registry.evidence.EVIDENCE_DIR (that module copies the run's evidence folder whole)
MAX_GOLDEN_BYTES = 8 * MiB
MAX_PROMPTS = 256
MAX_ANSWER_TOKENS = 256
MAX_TOP_K = 20  # vLLM's default --max-logprobs


class GenerationSettings(FrozenModel):
    """How every golden answer was generated, and how the probe asks again: greedy, seeded, top-k log-probabilities."""

    max_tokens: int = Field(gt=0, le=MAX_ANSWER_TOKENS)
    top_k: int = Field(gt=0, le=MAX_TOP_K, description="log-probabilities listed per generated token")
    temperature: float = Field(default=0.0, ge=0, le=0, description="greedy")
    seed: int = Field(ge=0)
    concurrency: int = Field(gt=0, le=MAX_PROMPTS, description="requests the probe keeps in flight")


class GoldenPrompt(FrozenModel):
    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    eval_set: str
    doc_id: int = Field(ge=0)
    text: str = Field(description="the prompt as lm-eval rendered it (for people; the probe sends prompt_ids)")
    prompt_ids: list[int] = Field(min_length=1)
    answer_ids: list[int] = Field(min_length=1, max_length=MAX_ANSWER_TOKENS)
    answer_text: str
    top_logprobs: list[dict[str, float]] = Field(description="per answer token: vLLM's top-k, keyed 'token_id:N'")


class SelfCheck(FrozenModel):
    """One pass of the golden prompts against the weights that answered them, compared with the recorded answers."""

    name: str = Field(description="alone: one request at a time; load: every prompt at once among filler requests")
    concurrency: int = Field(ge=1)
    max_kl: float = Field(ge=0, description="largest per-prompt mean KL(recorded || this pass), nats/token")
    max_shift: float = Field(ge=0, description="largest log-probability shift of a recorded top-k token, nats")
    diverged: int = Field(ge=0, description="prompts whose greedy answer took another token somewhere")
    max_divergence_margin: float = Field(ge=0, description="largest recorded top-1 margin (nats) where a pass diverged; 0 if none")
    wall_s: float = Field(ge=0)


class Tolerance(FrozenModel):
    """When one golden prompt disagrees, and how many may. A prompt disagrees when, over the compared positions, its mean KL
    exceeds kl_bound or a recorded top-k token's log-probability moved more than shift_bound, or when its greedy answer
    first diverges at a position whose recorded top-1 margin is at least margin_bound (a near tie may flip under batch
    noise; a confident token may not)."""

    kl_bound: float = Field(gt=0)
    shift_bound: float = Field(gt=0)
    margin_bound: float = Field(gt=0)
    max_disagreeing: int = Field(ge=0)
    rule: str
    self_checks: list[SelfCheck] = Field(min_length=1)


class GoldenSet(FrozenModel):
    format: Literal[1] = 1
    created_at: str
    seed: int = Field(ge=0)
    eval_sets: list[str] = Field(min_length=1)
    settings: GenerationSettings
    prompts: list[GoldenPrompt] = Field(min_length=1, max_length=MAX_PROMPTS)
    tolerance: Tolerance
    build_s: float = Field(ge=0)


def golden_path(bundle_dir: Path) -> Path:
    return Path(bundle_dir) / EVIDENCE_DIR / GOLDEN_FILE


def load_golden(bundle_dir: Path) -> GoldenSet | None:
    """The bundle's golden set; None when the bundle predates canaries (no evidence/canary.json). A malformed one is an
    InputError naming the file and field. The file's integrity is the bundle signature's job (verify the bundle first)."""
    path = golden_path(bundle_dir)
    if not path.exists():
        return None
    return read_golden(path)


def read_golden(path: Path) -> GoldenSet:
    data, _ = read_json_object(path, what="golden set", max_bytes=MAX_GOLDEN_BYTES)
    try:
        golden = GoldenSet.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error, path) from None
    ids = [prompt.id for prompt in golden.prompts]
    if len(set(ids)) != len(ids):
        raise InputError("two golden prompts share an id", file=path, field="prompts.id")
    for index, prompt in enumerate(golden.prompts):
        if len(prompt.top_logprobs) != len(prompt.answer_ids):
            raise InputError(f"{len(prompt.top_logprobs)} log-probability rows for {len(prompt.answer_ids)} answer tokens", file=path,
                             field=f"prompts.{index}.top_logprobs")
    return golden
