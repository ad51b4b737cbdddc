"""Each window's figures beside the limits of the envelope the version was promoted on (pipelines/deploy/limits.py, which
the deployed alert rules carry too), with a verdict per figure. A figure without data in the window (no request finished)
gets no verdict; it is never a breach. Nor is a figure of a window no server could have produced (pipelines/watch/plausible.py):
every figure of such a window is "invalid".
"""

from __future__ import annotations

from typing import Literal

from pipelines.deploy.limits import FigureLimit
from pipelines.watch.figures import Figures

Verdict = Literal["within", "breach", "no data", "invalid"]


class FigureVerdict(FigureLimit):
    value: float | None
    verdict: Verdict


def judge(figures: Figures, envelope_limits: list[FigureLimit], *, invalid: bool = False) -> list[FigureVerdict]:
    verdicts = []
    for limit in envelope_limits:
        value = getattr(figures, limit.figure)
        verdict: Verdict = "invalid" if invalid else "no data" if value is None else ("breach" if value > limit.limit + 1e-12 else "within")
        verdicts.append(FigureVerdict(**limit.model_dump(), value=value, verdict=verdict))
    return verdicts


def breached(verdicts: list[FigureVerdict]) -> list[str]:
    return [verdict.figure for verdict in verdicts if verdict.verdict == "breach"]
