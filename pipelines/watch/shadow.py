"""Quality drift (`quantize watch --shadow SAMPLE.jsonl`): production prompts replayed against the deployed version and its
16-bit baseline, paired, with the gate's own statistics.

SAMPLE.jsonl is the user's export, one object per line: {"prompt": "..."} and, when the right answer is known,
"expected": "...", and the application's "stop" sequences when it sends some (read by the bounded reader,
pipelines/files/jsonl.py; at most `max_items` prompts). Both models are served by the product's own vllm_server (the
version's verified bundle with its measured arguments; the baseline from the folder its gate.json names, checked against
the hash the gate recorded), one after the other, and asked for the same greedy completions (temperature 0, MAX_TOKENS).
Per prompt:

- agreement: the two answers are the same text. Reported as the disagreement rate with its one-sided Clopper-Pearson
  upper bound at the policy's confidence (pipelines/gate/stats.py exact_lower_bound on the agreements);
- flips, with `expected`: exact match of each answer, right->wrong and wrong->right, McNemar's exact p, the one-sided bound
  of the worsening from Tango's score interval and the Clopper-Pearson lower bound of the right->wrong rate, read against
  the tolerance (ni_margin) and max_flip_rate of the rules the version was gated under;
- KL: the top-20 coarse-grained KL(baseline || deployed) along the baseline's greedy path (pipelines/evaluation/divergence.py),
  a lower bound of the full KL, warned about (never a verdict) above the rules' max_kl, as the gate does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import httpx
from pydantic import Field, ValidationError

from pipelines.deploy.spec import ServedSpec
from pipelines.errors import InputError, ServeError, from_validation_error
from pipelines.evaluation.divergence import KL_METHOD, baseline_references, candidate_topk, item_kl
from pipelines.files.hashing import folder_hash
from pipelines.files.jsonl import display_path, iter_jsonl
from pipelines.gate import stats
from pipelines.gate.schema import GateReport
from pipelines.schema import FrozenModel
from pipelines.serve.serving import RunningServer, ServeSettings, vllm_server

MAX_TOKENS = 32
MAX_PROMPT_CHARS = 100_000
_CONCURRENCY = 8


class SampleItem(FrozenModel):
    """One line of SAMPLE.jsonl."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    expected: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS, description="the right answer, when known")
    stop: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(default_factory=list, max_length=4,
                                                                            description="stop sequences, as the application sends them")


def read_sample(path: Path, max_items: int) -> list[SampleItem]:
    """The sample's items, at most `max_items`; a bad line is one InputError naming the file, the line and the field."""
    where = display_path(path)
    items: list[SampleItem] = []
    for number, line in iter_jsonl(path):
        try:
            items.append(SampleItem.model_validate(line))
        except ValidationError as error:
            problem = from_validation_error(error, where)
            raise InputError(problem.message, file=where, field=f"line {number}: {problem.field}") from None
        if len(items) >= max_items:
            break
    if not items:
        raise InputError("no prompt to replay", file=where, field="--shadow")
    return items


def shadow_report(spec: ServedSpec, gate: GateReport, sample: Path, *, max_items: int, logs: Path) -> dict[str, Any]:
    """Serve the 16-bit baseline, then the deployed version (server logs in `logs`), and compare their answers."""
    items = read_sample(sample, max_items)
    baseline_dir = _baseline_dir(gate)
    settings = spec.args.serve_settings()
    prompts, expected = [item.prompt for item in items], [item.expected for item in items]
    with vllm_server(baseline_dir, log_path=logs / "baseline-server.log", settings=settings, served_name="baseline") as server:
        baseline_answers = _answers(server, items, settings)
        references = baseline_references(server, list(enumerate(prompts)))
    with vllm_server(spec.folder, log_path=logs / "deployed-server.log", settings=settings, served_name=spec.served_name) as server:
        deployed_answers = _answers(server, items, settings)
        topk = candidate_topk(server, references)
    return paired_statistics(gate, prompts, expected, baseline_answers, deployed_answers,
                             [item_kl(r, c) for r, c in zip(references, topk, strict=True)], sample)


def paired_statistics(gate: GateReport, prompts: list[str], expected: list[str | None], baseline: list[str], deployed: list[str],
                      kl: list[float | None], sample: Path) -> dict[str, Any]:
    """The gate's statistics on the paired answers, with the gate's guarantee language (`lines`)."""
    rules = gate.gate.sets[0].rules if gate.gate.sets else None
    confidence = rules.confidence if rules is not None else stats.CONFIDENCE
    n = len(prompts)
    agree = sum(b.strip() == d.strip() for b, d in zip(baseline, deployed, strict=True))
    disagreement_bound = 1.0 - stats.exact_lower_bound(agree, n, confidence=confidence)
    kl_stats = stats.kl_summary(kl)
    result: dict[str, Any] = {
        "sample": str(sample), "prompts": n, "max_tokens": MAX_TOKENS, "agreement": agree / n, "disagreements": n - agree,
        "disagreement_upper_bound": disagreement_bound, "confidence": confidence,
        "kl_mean": kl_stats.mean if kl_stats else None, "kl_max": kl_stats.max if kl_stats else None, "kl_method": KL_METHOD,
    }
    lines = [f"{n - agree} of {n} production prompts answered differently from the 16-bit baseline ({100 * (n - agree) / n:.1f}%); "
             f"at {confidence:.0%} confidence the deployed version changes at most {100 * disagreement_bound:.1f}% of such answers "
             "(one-sided Clopper-Pearson bound)"]
    labelled = [i for i, answer in enumerate(expected) if answer is not None]
    if labelled:
        result.update(_flips(labelled, expected, baseline, deployed, rules, confidence, lines))
    if kl_stats is not None:
        over = rules is not None and rules.max_kl is not None and kl_stats.mean > rules.max_kl
        lines.append(f"mean KL {kl_stats.mean:.3g} nats/token over {kl_stats.items} prompts (a lower bound of the full KL)"
                     + (f": above max_kl {rules.max_kl} (a warning, as in the gate)" if over and rules is not None else ""))
    result["lines"] = lines
    return result


def _flips(labelled: list[int], expected: list[str | None], baseline: list[str], deployed: list[str], rules, confidence: float,
           lines: list[str]) -> dict[str, Any]:
    right_base = [float(baseline[i].strip() == (expected[i] or "").strip()) for i in labelled]
    right_deployed = [float(deployed[i].strip() == (expected[i] or "").strip()) for i in labelled]
    changed = stats.flips(right_base, right_deployed)
    n = changed.n
    low = stats.tango_lower_bound(changed.right_to_wrong, changed.wrong_to_right, n, confidence=confidence)
    worsening_bound = max(0.0, -low) * 100
    flip_bound = stats.exact_lower_bound(changed.right_to_wrong, n, confidence=confidence)
    margin = rules.ni_margin if rules is not None else None
    shown = margin is not None and worsening_bound <= margin
    lines.append(
        f"on the {n} prompts with an expected answer: baseline {100 * sum(right_base) / n:.1f}%, deployed {100 * sum(right_deployed) / n:.1f}%, "
        f"{changed.right_to_wrong} right->wrong and {changed.wrong_to_right} wrong->right (McNemar p "
        f"{stats.mcnemar_exact_p(changed.right_to_wrong, changed.wrong_to_right):.3g}); the drop may be as large as {worsening_bound:.2f} points "
        f"({confidence:.0%} one-sided bound)" + (f": within ni_margin {margin} (non-inferiority shown)" if shown else
                                                  f": over ni_margin {margin} (non-inferiority not shown)" if margin is not None else ""))
    if rules is not None and rules.max_flip_rate is not None:
        state = "over" if flip_bound > rules.max_flip_rate else "within"
        lines.append(f"right->wrong rate {changed.right_to_wrong / n:.3f}, {confidence:.0%} lower bound {flip_bound:.3f}: {state} "
                     f"max_flip_rate {rules.max_flip_rate}")
    return {"labelled": n, "baseline_accuracy": sum(right_base) / n, "deployed_accuracy": sum(right_deployed) / n,
            "flips_right_to_wrong": changed.right_to_wrong, "flips_wrong_to_right": changed.wrong_to_right,
            "worsening_bound_points": worsening_bound, "flip_rate_lower_bound": flip_bound, "ni_margin": margin,
            "non_inferiority_shown": shown}


def _baseline_dir(gate: GateReport) -> Path:
    recorded = gate.inputs.get("baseline") if isinstance(gate.inputs.get("baseline"), dict) else None
    if not recorded or not recorded.get("path"):
        raise InputError("the version's gate evidence names no 16-bit baseline to replay against", field="inputs.baseline")
    folder = Path(recorded["path"])
    if not folder.is_dir():
        raise InputError("the 16-bit baseline the version was gated against is not here", file=folder, field="inputs.baseline.path")
    if recorded.get("sha256") and folder_hash(folder) != recorded["sha256"]:
        raise InputError("the 16-bit baseline changed since the version was gated (its hash differs)", file=folder,
                         field="inputs.baseline.sha256")
    return folder


def _answers(server: RunningServer, items: list[SampleItem], settings: ServeSettings) -> list[str]:
    async def one(client: httpx.AsyncClient, semaphore: asyncio.Semaphore, item: SampleItem) -> str:
        async with semaphore:
            response = await client.post(f"{server.base_url}/completions", headers=server.auth_headers, json={
                "model": server.served_name, "prompt": item.prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                **({"stop": item.stop} if item.stop else {})})
        if response.status_code != 200:
            server.check_engine()
            raise ServeError(f"/v1/completions answered HTTP {response.status_code}: {response.text[:200]}", file=server.log_path)
        return str(response.json()["choices"][0]["text"])

    async def run() -> list[str]:
        semaphore = asyncio.Semaphore(_CONCURRENCY)
        async with httpx.AsyncClient(timeout=settings.request_timeout_s) as client:
            return list(await asyncio.gather(*(one(client, semaphore, item) for item in items)))

    return asyncio.run(run())
