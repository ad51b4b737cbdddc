"""`quantize doctor`'s diagnosis: what each shipped recipe's schemes, KV caches and the repair ladder's rungs get on a serve
target. On this host (a local target) each is looked up in the kernel probe (kernels.py: the kernel vLLM chose or why none
could, its speed against 16-bit); for another machine the written rules (targets.py) answer and nothing is probed."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from pipelines.hardware.host import HostProfile, host_profile
from pipelines.hardware.kernels import PROBE_IN_FEATURES, SLOW_RATIO, STANDARD_KV_CASES, KernelCase, KernelFact, KvCase, kernel_facts
from pipelines.hardware.prediction import ShapePrediction
from pipelines.hardware.targets import ServeTarget, kv_cache_problem, serve_problem
from pipelines.recipe import GroupScheme, KvCache, load_recipe, shipped_recipes

Action = Literal["runs", "runs slowly", "refused"]


class SchemeRow(BaseModel):
    source: str  # "w8a8: mlp" or "ladder cpu.yaml: weight_only rung 3"
    scheme: str
    key: str
    served: bool
    kernel: str | None
    decode_ratio: float | None
    prefill_ratio: float | None
    action: Action
    why: str = ""


NEGATIVE_CONTROL_TAG = "negative-control"


class DoctorReport(BaseModel):
    target: str
    probed: bool
    host: HostProfile | None
    ladder: str
    rows: list[SchemeRow]
    negative_control: str | None = None  # the first shipped recipe tagged negative-control that runs here (make demo-reject)
    model: list[ShapePrediction] | None = None  # --model: the model's own shapes under each recipe

    def recipe_actions(self) -> dict[str, Action]:
        """Each shipped recipe's worst action (refused > runs slowly > runs)."""
        order: list[Action] = ["runs", "runs slowly", "refused"]
        worst: dict[str, Action] = {}
        for row in self.rows:
            if row.source.startswith("ladder"):
                continue
            name = row.source.split(":", 1)[0]
            worst[name] = max(worst.get(name, "runs"), row.action, key=order.index)
        return worst


def diagnose(target: ServeTarget, ladder: Path, ladder_schemes: list[tuple[str, GroupScheme]]) -> DoctorReport:
    """Every shipped recipe's schemes and KV caches, and `ladder_schemes` (the rungs of the `ladder` file) on `target`."""
    schemes = recipe_schemes() + ladder_schemes
    facts: dict[str, KernelFact] = {}
    host = None
    kv_caches = recipe_kv_caches()
    if target.local:
        host = host_profile()
        kv_cases = [KvCase(kv_cache_dtype=kv.vllm_dtype, head_size=KV_HEAD_SIZE) for _, kv in kv_caches if kv.quantized]
        facts = kernel_facts(host, [*(KernelCase.of(scheme) for _, scheme in schemes), *kv_cases])
    rows = [scheme_row(source, scheme, target, facts) for source, scheme in schemes]
    rows += [kv_row(source, kv, target, facts) for source, kv in kv_caches]
    report = DoctorReport(target=str(target), probed=target.local, host=host, ladder=str(ladder), rows=rows)
    actions = report.recipe_actions()
    controls = [name for name in shipped_recipes() if NEGATIVE_CONTROL_TAG in load_recipe(name).recipe.tags]
    report.negative_control = next((name for name in sorted(controls, key=len) if actions.get(name, "refused") != "refused"), None)
    return report


def concrete(scheme: GroupScheme) -> GroupScheme:
    """`group_size: auto` as the probe's layer gets it."""
    return scheme.model_copy(update={"weights": scheme.weights.for_layer(PROBE_IN_FEATURES)})


def recipe_schemes() -> list[tuple[str, GroupScheme]]:
    found = []
    for name in shipped_recipes():
        recipe = load_recipe(name).recipe
        for group in ("attention", "mlp"):
            scheme = getattr(recipe.groups, group)
            if scheme is not None:
                found.append((f"{name}: {group}", concrete(scheme)))
        for index, override in enumerate(recipe.overrides):
            for group in ("attention", "mlp"):
                scheme = getattr(override, group)
                if scheme is not None:
                    found.append((f"{name}: overrides.{index}.{group}", concrete(scheme)))
    return found


KV_HEAD_SIZE = STANDARD_KV_CASES[0].head_size  # the demo model's and SmolLM2's heads; a model's own is checked at validation


def recipe_kv_caches() -> list[tuple[str, KvCache]]:
    found = []
    for name in shipped_recipes():
        kv = load_recipe(name).recipe.kv_cache
        if kv.dtype != "auto":
            found.append((f"{name}: kv_cache", kv))
    return found


def kv_row(source: str, kv: KvCache, target: ServeTarget, facts: dict[str, KernelFact]) -> SchemeRow:
    case = KvCase(kv_cache_dtype=kv.vllm_dtype, head_size=KV_HEAD_SIZE)
    fact = facts.get(case.key)
    problem = kv_cache_problem(kv, target, KV_HEAD_SIZE)
    return SchemeRow(source=source, scheme=f"KV cache {kv.dtype} ({KV_HEAD_SIZE}-wide heads)", key=case.key, served=problem is None,
                     kernel=f"CPU attention ({fact.kernel})" if fact and fact.kernel else None, decode_ratio=None, prefill_ratio=None,
                     action="refused" if problem else "runs", why=problem.why if problem else "")


def scheme_row(source: str, scheme: GroupScheme, target: ServeTarget, facts: dict[str, KernelFact]) -> SchemeRow:
    case = KernelCase.of(scheme)
    fact = facts.get(case.key)
    problem = serve_problem(scheme, target)
    slowdown = fact.slowdown if fact else None
    action: Action = "refused" if problem else ("runs slowly" if slowdown is not None and slowdown >= SLOW_RATIO else "runs")
    return SchemeRow(
        source=source, scheme=case.label, key=case.key, served=problem is None, kernel=fact.kernel if fact else None,
        decode_ratio=fact.decode_ratio if fact else None, prefill_ratio=fact.prefill_ratio if fact else None,
        action=action, why=problem.why if problem else "",
    )
