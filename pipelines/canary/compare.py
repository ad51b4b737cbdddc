"""One golden answer against an answer a server gave now: how far apart (mean coarse KL and the largest log-probability
shift along the shared path, where the greedy paths first part) and whether that is beyond the recorded tolerance.

Why a shift beside the KL: a model that is sure of its answer (the demo model's top-1 margins are 7 to 15 nats) puts
almost all its mass on one token, so the KL of another artifact's weights is tiny (measured: 1e-7 to 6e-5 nats/token for
the demo's w4a16 against its w8a8), while the log-probabilities of the runners-up move by whole nats."""

from __future__ import annotations

from pydantic import Field

from pipelines.canary.golden import GoldenPrompt, Tolerance
from pipelines.evaluation.divergence import coarse_kl
from pipelines.schema import StrictModel

NO_RUNNER_UP = 1e9  # a recorded row with one entry: the top token had no listed rival, its margin is unbounded


class Answer(StrictModel):
    """A server's greedy answer to one golden prompt: token ids and top-k log-probabilities per token."""

    ids: list[int]
    top_logprobs: list[dict[str, float]]


class Distance(StrictModel):
    id: str
    kl: float | None = Field(description="mean coarse KL(recorded || now) over the positions both paths share, nats/token")
    shift: float | None = Field(description="largest |recorded - now| log-probability of a recorded top-k token there, nats")
    diverged_at: int | None = Field(description="first position where the greedy answers differ (None: identical)")
    margin: float | None = Field(description="the recorded top-1 margin (nats) at that position")


class PromptCheck(Distance):
    disagrees: bool
    reason: str | None = None


def margin(row: dict[str, float]) -> float:
    """Top-1 minus top-2 log-probability of one recorded position."""
    values = sorted(row.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else NO_RUNNER_UP


def distance(prompt: GoldenPrompt, answer: Answer, top_k: int) -> Distance:
    """Positions up to and including the first divergence are compared (both were conditioned on the same tokens there);
    later ones follow different paths. An answer that stops early diverges where it stopped."""
    recorded, now = prompt.answer_ids, answer.ids
    diverged_at = next((i for i, (a, b) in enumerate(zip(recorded, now, strict=False)) if a != b), None)
    if diverged_at is None and len(recorded) != len(now):
        diverged_at = min(len(recorded), len(now))
    end = len(recorded) if diverged_at is None else diverged_at + 1
    pairs = [(r, n) for r, n in zip(prompt.top_logprobs[:end], answer.top_logprobs[:end], strict=False) if r and n]
    kl = sum(coarse_kl(r, n, top_k) for r, n in pairs) / len(pairs) if pairs else None
    shift = max((logprob_shift(r, n) for r, n in pairs), default=None)
    at_margin = None
    if diverged_at is not None:
        at_margin = margin(prompt.top_logprobs[diverged_at]) if diverged_at < len(prompt.top_logprobs) else NO_RUNNER_UP
    return Distance(id=prompt.id, kl=kl, shift=shift, diverged_at=diverged_at, margin=at_margin)


def logprob_shift(recorded: dict[str, float], now: dict[str, float]) -> float:
    """The largest move of a recorded top-k token's log-probability. A token no longer listed sits at or below the k-th
    listed value: its shift is at least the drop to that value (a lower bound, never a guess above the truth)."""
    floor = min(now.values())
    return max(abs(value - now[token]) if token in now else max(0.0, value - floor) for token, value in recorded.items())


def judge(found: Distance, tolerance: Tolerance) -> PromptCheck:
    reasons = []
    if found.kl is None:
        reasons.append("no comparable position")
    elif found.kl > tolerance.kl_bound:
        reasons.append(f"KL {found.kl:.3g} > {tolerance.kl_bound:.3g} nats/token")
    if found.shift is not None and found.shift > tolerance.shift_bound:
        reasons.append(f"a log-probability moved {found.shift:.3g} > {tolerance.shift_bound:.3g} nats")
    if found.diverged_at is not None and found.margin is not None and found.margin >= tolerance.margin_bound:
        reasons.append(f"token {found.diverged_at} differs where the recorded margin was {min(found.margin, 99):.3g} nats"
                       f" (>= {tolerance.margin_bound:.3g})")
    return PromptCheck(**found.model_dump(), disagrees=bool(reasons), reason="; ".join(reasons) or None)
