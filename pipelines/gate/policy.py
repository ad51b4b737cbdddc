"""The gate policy: thresholds per eval set, with overrides per recipe and per eval set.

A policy file (policies/default.yaml) has `defaults` (every rule, explicitly), optional `recipes:` and
`eval_sets:` overrides that name only the rules they change, and an optional `fit` requirement that the
planner evaluates. Precedence for one (recipe, eval set): eval-set override > recipe override > defaults.
An override that sets a threshold to null disables that rule; a rule it leaves out is inherited.

A `recipes:` key is matched against the recipe's identity (RecipeIdentity): its name first, then the
`base` it declares, then its `tags` in the order the recipe lists them; the first key that matches is the
recipe's override (one override, never a merge of several), so a user's variant of w4a16 that says
`base: w4a16` keeps w4a16's rules unless the policy names the variant itself.

What the rules guarantee (docs/gate-json.md, "Known error rates"): the tolerance rules (`ni_margin` in points,
`rel_margin` for metrics in their own unit, `max_rel_drop`) read the one-sided `confidence` bound of the
worsening, so a candidate whose true worsening is exactly the tolerance passes at most 1 - confidence of the
time; `max_abs_drop` reads the point estimate and guarantees nothing of its own; `max_kl` has no error rate
and only warns unless `max_kl_action: reject`. `check_attainable` refuses, at load, a policy that a selected
set cannot meet even with a candidate identical to its baseline.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal, Protocol

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pipelines.bounds import MAX_CONCURRENCY, MAX_CONTEXT, MAX_GPU_MEMORY_GIB
from pipelines.errors import InputError
from pipelines.evaluation.metrics import MetricSpec
from pipelines.files.yamlio import load_yaml_model
from pipelines.loadtest.config import PerformanceOverrides, PerformancePolicy
from pipelines.paths import REPO_ROOT
from pipelines.planner.gpus import gpu_spec, known_gpus
from pipelines.recipe import RecipeIdentity
from pipelines.schema import FrozenModel

POLICIES_DIR = REPO_ROOT / "policies"
DEFAULT_POLICY = POLICIES_DIR / "default.yaml"

# Bounds: finite everywhere; sizes far beyond any real deployment refused at load, before any work
# (context, concurrency and GPU memory: pipelines.bounds, shared with the planner).
MAX_POINTS = 1e6  # drops and margins: points of a [0, 1] metric, or a BLEU / perplexity unit
MAX_NATS = 1e6
MAX_ITEMS = 10**9

Points = Annotated[float, Field(ge=0, le=MAX_POINTS, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Nats = Annotated[float, Field(ge=0, le=MAX_NATS, allow_inf_nan=False)]
Margin = Annotated[float, Field(gt=0, le=MAX_POINTS, allow_inf_nan=False)]
RelMargin = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=MAX_ITEMS)]
Confidence = Annotated[float, Field(ge=0.5, le=0.9999, allow_inf_nan=False)]
KLAction = Literal["warn", "reject"]
# Score the 16-bit baseline twice (pipelines.gate.noise): true, false, or auto (pass/fail sets only, where a runtime flip
# moves a whole item; averaged and corpus metrics move by fractions the second scoring rarely pays for).
NoiseFloorSetting = Literal[True, False, "auto"]
DamageShare = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
DEFAULT_CONFIDENCE = 0.95
DEFAULT_DAMAGE_SHARE = 0.02


class SetPolicy(FrozenModel):
    """The rules one eval set is judged by. Points are percentage points of a [0, 1] metric.

    The tolerance rules read the one-sided `confidence` bound of the worsening (the change in the metric's bad
    direction): a true worsening of exactly the tolerance passes at most 1 - confidence of the time. Absolute
    rules (ni_margin, max_abs_drop) are in points and apply to metrics in points only; a metric in its own unit
    (perplexities, bits_per_byte, bleu, chrf, ter) is judged relatively (rel_margin, max_rel_drop)."""

    max_abs_drop: Points | None = Field(description="largest allowed worsening of the point estimate, in points (no error rate of its own)")
    max_rel_drop: Fraction | None = Field(
        description="largest allowed worsening as a fraction of the baseline score, read on the confidence bound (any metric)"
    )
    non_inferiority: bool = Field(description="apply the tolerance: the confidence bound of the worsening must stay within ni_margin / rel_margin")
    ni_margin: Margin = Field(description="the tolerance T in points: the true worsening accepted (metrics in points)")
    max_flip_rate: Fraction | None = Field(description="largest fraction of items that may go right->wrong (read on its lower confidence bound)")
    max_kl: Nats | None = Field(description="mean per-token KL(baseline || candidate) above which to warn (or reject), nats/token")
    min_items: Count = Field(description="fewer items than this gives a warning, not a rejection")
    confidence: Confidence = Field(default=DEFAULT_CONFIDENCE, description="one-sided confidence of every bound the rules read")
    rel_margin: RelMargin | None = Field(
        default=None, description="the tolerance for metrics in their own unit, as a fraction of the baseline score",
    )
    max_kl_action: KLAction = Field(default="warn", description="warn: max_kl only warns (it has no error rate); reject: it rejects")
    damage_share: DamageShare = Field(
        default=DEFAULT_DAMAGE_SHARE,
        description="corpus metrics (perplexities, bits_per_byte, bleu, chrf, ter, f1...): the tolerance's guarantee holds for "
                    "every worsening whose concentration share (the smallest fraction of items carrying more than half of it) "
                    "is at least damage_share, whatever the severities (pipelines.gate.concentrated); a set needs 173 items at "
                    "0.02 (115 at 0.03, 68 at 0.05; at 95%)",
    )
    noise_floor: NoiseFloorSetting = Field(
        default="auto",
        description="score the 16-bit baseline twice: the A/A flips reported, the candidate compared with the mean of both "
                    "passes, a tolerance under the measured floor refused (docs/guarantees.md); auto: pass/fail sets only",
    )

    def noise_floor_for(self, kind: str) -> bool:
        """Whether a set of this metric kind (binary, continuous, corpus) gets the second baseline scoring."""
        return kind == "binary" if self.noise_floor == "auto" else bool(self.noise_floor)


class RuleOverrides(FrozenModel):
    """Any subset of SetPolicy's rules. Thresholds may be null (rule off); the other fields may not."""

    max_abs_drop: Points | None = None
    max_rel_drop: Fraction | None = None
    non_inferiority: bool | None = None
    ni_margin: Margin | None = None
    max_flip_rate: Fraction | None = None
    max_kl: Nats | None = None
    min_items: Count | None = None
    confidence: Confidence | None = None
    rel_margin: RelMargin | None = None
    max_kl_action: KLAction | None = None
    damage_share: DamageShare | None = None
    noise_floor: NoiseFloorSetting | None = None

    @field_validator("non_inferiority", "ni_margin", "min_items", "confidence", "max_kl_action", "damage_share", "noise_floor")
    @classmethod
    def _not_null(cls, value: object) -> object:
        if value is None:
            raise ValueError("cannot be null; leave it out to inherit it (only thresholds can be turned off)")
        return value

    def explicit(self) -> dict[str, object]:
        """The rules this override names (an explicit null included)."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class FitRequirement(FrozenModel):
    """The deployment the artifact must fit: a named GPU or a memory budget, a context length, a concurrency."""

    gpu: str | None = Field(default=None, max_length=100, description="a GPU name the planner knows, e.g. H100-80GB")
    memory_gib: float | None = Field(
        default=None, gt=0, le=MAX_GPU_MEMORY_GIB, allow_inf_nan=False, description="device memory budget in GiB",
    )
    max_model_len: int = Field(gt=0, le=MAX_CONTEXT, description="tokens of context per sequence")
    concurrency: int = Field(default=1, gt=0, le=MAX_CONCURRENCY, description="sequences served at once")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        """Refused at load, before any quantizing or serving: the gate's fit check needs the GPU's size."""
        if value is None:
            return value
        try:
            gpu_spec(value)
        except InputError:
            known = ", ".join(known_gpus())
            raise PydanticCustomError(
                "unknown_gpu", "unknown GPU (known: {known}; or give memory_gib instead of gpu)", {"known": known},
            ) from None
        return value

    @model_validator(mode="after")
    def _one_target(self) -> FitRequirement:
        if (self.gpu is None) == (self.memory_gib is None):
            raise ValueError("give exactly one of `gpu` or `memory_gib`")
        return self


class RecipeOverrides(RuleOverrides):
    fit: FitRequirement | None = None
    performance: PerformanceOverrides | None = None  # the load test's block, fields named here win (docs/loadtest.md)


MAX_SCORING_TIME_S = 7 * 24 * 3600.0


class Policy(FrozenModel):
    schema_version: Literal[1] = 1
    description: str = ""
    defaults: SetPolicy
    recipes: dict[str, RecipeOverrides] = Field(default_factory=dict)
    eval_sets: dict[str, RuleOverrides] = Field(default_factory=dict)
    fit: FitRequirement | None = None
    performance: PerformancePolicy = PerformancePolicy()
    runtime_change: Literal["refuse", "warn"] = Field(
        default="refuse",
        description="a promoted version served on a runtime it was not gated on (another vLLM, torch, host class or kernel): "
                    "refuse until `quantize regate` passes there, or only warn (docs/registry.md, \"Re-gating\")",
    )
    max_scoring_time_s: float | None = Field(
        default=None, gt=0, le=MAX_SCORING_TIME_S, allow_inf_nan=False,
        description="refuse (exit 2, before it is scored) a candidate whose probed kernels make its estimated scoring time "
                    "longer than this (docs/hardware.md); unset: the estimate is shown, never enforced",
    )

    def recipe_key(self, recipe: str | RecipeIdentity | None) -> str | None:
        """The `recipes:` key that applies to a recipe (a name, or its identity): name > base > tags. None: no recipe."""
        if recipe is None:
            return None
        return next((key for key in RecipeIdentity.of(recipe).keys() if key in self.recipes), None)  # noqa: SIM118 (RecipeIdentity.keys)

    def recipe_override(self, recipe: str | RecipeIdentity | None) -> RecipeOverrides | None:
        key = self.recipe_key(recipe)
        return None if key is None else self.recipes[key]

    def rule_source(self, recipe: str | RecipeIdentity | None, eval_set: str, rule: str) -> str:
        """The dotted policy field a set's rule comes from: `eval_sets.SET.RULE`, `recipes.KEY.RULE` or `defaults.RULE`."""
        if rule in self.eval_sets.get(eval_set, RuleOverrides()).model_fields_set:
            return f"eval_sets.{eval_set}.{rule}"
        key = self.recipe_key(recipe)
        if key is not None and rule in self.recipes[key].model_fields_set:
            return f"recipes.{key}.{rule}"
        return f"defaults.{rule}"

    def for_set(self, recipe: str | RecipeIdentity | None, eval_set: str) -> SetPolicy:
        """Rules for one eval set under one recipe: eval-set override > recipe override > defaults.

        `recipe` is a name or a RecipeIdentity (name, base, tags): see recipe_key for which override applies;
        None (not known yet) applies no recipe override."""
        rules = self.defaults.model_dump()
        recipe_rules = (self.recipe_override(recipe) or RecipeOverrides()).explicit()
        recipe_rules.pop("fit", None)
        recipe_rules.pop("performance", None)
        rules.update(recipe_rules)
        rules.update(self.eval_sets.get(eval_set, RuleOverrides()).explicit())
        return SetPolicy.model_validate(rules)

    def fit_for(self, recipe: str | RecipeIdentity) -> FitRequirement | None:
        """The fit requirement for a recipe: its override's `fit` if it names one, else the top-level one."""
        override = self.recipe_override(recipe)
        if override is not None and "fit" in override.model_fields_set:
            return override.fit
        return self.fit

    def performance_for(self, recipe: str | RecipeIdentity) -> PerformancePolicy:
        """The load test's block for a recipe: its override's `performance` fields over the top-level block."""
        override = self.recipe_override(recipe)
        return self.performance.merged(override.performance if override is not None else None)


def resolve_policy_path(name_or_path: str | Path) -> Path:
    """A shipped policy name (`default`) or a path to a YAML file."""
    candidate = Path(name_or_path)
    try:
        exists = candidate.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte: reading it says why
        exists = False
    if candidate.suffix in (".yaml", ".yml") or exists:
        return candidate
    return POLICIES_DIR / f"{candidate}.yaml"


def load_policy(name_or_path: str | Path = DEFAULT_POLICY) -> Policy:
    """Parse and validate a policy file; unknown keys and bad values raise InputError naming file and field."""
    path = resolve_policy_path(name_or_path)
    return load_yaml_model(path, Policy, "policy")


class SizedSet(Protocol):
    """What the load-time check reads of an eval set (pipelines.evaluation.evalsets.EvalSet has it)."""

    @property
    def name(self) -> str: ...
    @property
    def num_items(self) -> int: ...
    @property
    def metric(self) -> MetricSpec: ...


def relative_rule_in_force(rules: SetPolicy) -> bool:
    """Whether a relative tolerance applies: rel_margin (with non_inferiority on) or max_rel_drop."""
    return (rules.non_inferiority and rules.rel_margin is not None) or rules.max_rel_drop is not None


def unattainable(policy: Policy, recipe: str | RecipeIdentity | None, eval_set: SizedSet) -> tuple[str, str] | None:
    """(message, policy field) when the set cannot pass under its rules even with a candidate identical to its
    baseline, or is left without a rule in its unit; None when it can.

    An identical candidate's bound is what its kind's method gives n unchanged items (pipelines.gate.identical), a
    fraction of one item's reach: the points tolerance (ni_margin) of a metric in points is checked against it, and the
    relative tolerances of a corpus metric in its own unit (perplexities, bits_per_byte, bleu, chrf, ter: the reach is
    the score itself, so the check needs no baseline). A corpus set also needs the items its damage_share asks for
    (unseen_damage). Relative tolerances of a metric in points depend on the baseline score and are checked by
    the gate itself (its reasons and warnings say the n needed)."""
    rules = policy.for_set(recipe, eval_set.name)
    spec, n, name = eval_set.metric, eval_set.num_items, eval_set.name
    if spec.in_points:
        if not rules.non_inferiority:
            return None
        return _identical_refusal(policy, recipe, eval_set, rules, "ni_margin", rules.ni_margin / spec.scale) or _damage_refusal(
            policy, recipe, eval_set, rules)
    if not relative_rule_in_force(rules):
        field = policy.rule_source(recipe, name, "rel_margin")
        return (
            f"eval set {name} ({n} items): metric {spec.name} is in its own unit, not points, so ni_margin and "
            f"max_abs_drop do not apply to it, and no relative tolerance does: set rel_margin (a fraction of the "
            f"baseline score) or max_rel_drop", field,
        )
    if spec.kind != "corpus":
        return None  # averaged per item: its reach is the values' spread, known once scored
    for rule, fraction in (("rel_margin", rules.rel_margin if rules.non_inferiority else None), ("max_rel_drop", rules.max_rel_drop)):
        found = None if fraction is None else _identical_refusal(policy, recipe, eval_set, rules, rule, fraction)
        if found is not None:
            return found
    return _damage_refusal(policy, recipe, eval_set, rules)


def _damage_refusal(policy: Policy, recipe: str | RecipeIdentity | None, eval_set: SizedSet, rules: SetPolicy) -> tuple[str, str] | None:
    unseen = unseen_damage(eval_set.metric, eval_set.num_items, rules)
    return None if unseen is None else (f"eval set {eval_set.name}: {unseen}", policy.rule_source(recipe, eval_set.name, "damage_share"))


def _identical_refusal(
    policy: Policy, recipe: str | RecipeIdentity | None, eval_set: SizedSet, rules: SetPolicy, rule: str, fraction: float,
) -> tuple[str, str] | None:
    from pipelines.gate import identical  # scipy: only when sets are checked

    spec, n = eval_set.metric, eval_set.num_items
    floor = identical.identical_bound(spec.kind, n, min(fraction, 1.0), rules.confidence)
    if floor <= fraction + 1e-12:
        return None
    needed = identical.identical_items_needed(spec.kind, fraction, rules.confidence)
    needs = "no number of items can" if needed is None else f"it needs at least {needed} items"
    if spec.in_points:
        limit, shown = f"{rule} {getattr(rules, rule):g} {spec.unit}", f"{spec.scale * floor:.2f} {spec.unit}"
    else:
        limit, shown = f"relative worsening under {rule} {fraction:g}", f"{floor:.3f} of the baseline"
    return (
        f"eval set {eval_set.name}: {n} items cannot show a {'worsening under ' if spec.in_points else ''}{limit} at "
        f"{rules.confidence:.0%} confidence even against an identical model (its bound is at least {shown}); {needs}",
        policy.rule_source(recipe, eval_set.name, rule),
    )


def damage_share_applies(spec: MetricSpec, rules: SetPolicy) -> bool:
    """A corpus metric under a tolerance (relative, or ni_margin for one in points): the concentrated-damage rule reads it."""
    return spec.kind == "corpus" and (relative_rule_in_force(rules) or (spec.in_points and rules.non_inferiority))


def documents_for_damage_share(rules: SetPolicy) -> int:
    """The fewest items with which an identical candidate passes the concentrated-damage rule at this damage_share
    (pipelines.gate.concentrated.items_needed): 173 at 0.02, 115 at 0.03, 68 at 0.05 (95%)."""
    from pipelines.gate import concentrated  # numpy: only when sets are checked

    return concentrated.items_needed(rules.damage_share, rules.confidence)


def unseen_damage(spec: MetricSpec, n: int, rules: SetPolicy) -> str | None:
    """Why a corpus set is too small for its damage_share (None when it is not, or the rule does not apply): even a
    candidate identical to its baseline fails the concentrated-damage rule below documents_for_damage_share items."""
    if not damage_share_applies(spec, rules):
        return None
    needed = documents_for_damage_share(rules)
    if n >= needed:
        return None
    share = rules.damage_share
    return (
        f"{n} items cannot rule out a worsening concentrated in {share:.0%} of items (damage_share {share:g}) at "
        f"{rules.confidence:.0%} confidence even against an identical model; it needs at least {needed} items"
    )


def check_attainable(
    policy: Policy, eval_sets: Iterable[SizedSet], recipe: str | RecipeIdentity | None = None, *, file: str | Path | None = None,
) -> None:
    """InputError (exit 2, one line naming the file, the policy field, the set, its n and the n needed) for the first
    selected set the policy's numbers cannot be met by (`unattainable`). Before any quantizing or serving."""
    for eval_set in eval_sets:
        found = unattainable(policy, recipe, eval_set)
        if found is not None:
            message, field = found
            raise InputError(message, file=file, field=field)


def load_gate_policy(path: Path | None) -> tuple[Policy, Path]:
    """The policy a run is judged by (the default one when `path` is None) and the file it came from. Callers
    check it against the sets they selected with check_attainable, once those are known."""
    policy_path = path or DEFAULT_POLICY
    return load_policy(policy_path), policy_path
