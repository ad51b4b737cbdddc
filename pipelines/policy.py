"""The gate policy: thresholds per eval set, with overrides per recipe and per eval set.

A policy file (policies/default.yaml) has `defaults` (every rule, explicitly), optional `recipes:` and
`eval_sets:` overrides that name only the rules they change, and an optional `fit` requirement that the
planner evaluates. Precedence for one (recipe, eval set): eval-set override > recipe override > defaults.
An override that sets a threshold to null disables that rule; a rule it leaves out is inherited.

A `recipes:` key is matched against the recipe's identity (RecipeIdentity): its name first, then the
`base` it declares, then its `tags` in the order the recipe lists them; the first key that matches is the
recipe's override (one override, never a merge of several), so a user's variant of w4a16 that says
`base: w4a16` keeps w4a16's rules unless the policy names the variant itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pipelines.bounds import MAX_CONCURRENCY, MAX_CONTEXT, MAX_GPU_MEMORY_GIB
from pipelines.errors import InputError
from pipelines.loadtest.config import PerformanceOverrides, PerformancePolicy
from pipelines.paths import REPO_ROOT
from pipelines.planner.gpus import gpu_spec, known_gpus
from pipelines.recipe import RecipeIdentity
from pipelines.schema import FrozenModel
from pipelines.yamlio import load_yaml_model

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
Count = Annotated[int, Field(ge=1, le=MAX_ITEMS)]


class SetPolicy(FrozenModel):
    """The rules one eval set is judged by. Points are percentage points of a [0, 1] metric."""

    max_abs_drop: Points | None = Field(description="largest allowed drop of the point estimate, in points")
    max_rel_drop: Fraction | None = Field(description="largest allowed drop as a fraction of the baseline score")
    non_inferiority: bool = Field(description="require the 95% CI lower bound of the delta to stay above -ni_margin")
    ni_margin: Margin = Field(description="non-inferiority margin, in points")
    max_flip_rate: Fraction | None = Field(description="largest fraction of items that may go right->wrong")
    max_kl: Nats | None = Field(description="largest mean per-token KL(baseline || candidate), nats/token")
    min_items: Count = Field(description="fewer items than this gives a warning, not a rejection")


class RuleOverrides(FrozenModel):
    """Any subset of SetPolicy's rules. Thresholds may be null (rule off); the other fields may not."""

    max_abs_drop: Points | None = None
    max_rel_drop: Fraction | None = None
    non_inferiority: bool | None = None
    ni_margin: Margin | None = None
    max_flip_rate: Fraction | None = None
    max_kl: Nats | None = None
    min_items: Count | None = None

    @field_validator("non_inferiority", "ni_margin", "min_items")
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


class Policy(FrozenModel):
    schema_version: Literal[1] = 1
    description: str = ""
    defaults: SetPolicy
    recipes: dict[str, RecipeOverrides] = Field(default_factory=dict)
    eval_sets: dict[str, RuleOverrides] = Field(default_factory=dict)
    fit: FitRequirement | None = None
    performance: PerformancePolicy = PerformancePolicy()

    def recipe_key(self, recipe: str | RecipeIdentity) -> str | None:
        """The `recipes:` key that applies to a recipe (a name, or its identity): name > base > tags."""
        return next((key for key in RecipeIdentity.of(recipe).keys() if key in self.recipes), None)  # noqa: SIM118 (RecipeIdentity.keys)

    def recipe_override(self, recipe: str | RecipeIdentity) -> RecipeOverrides | None:
        key = self.recipe_key(recipe)
        return None if key is None else self.recipes[key]

    def for_set(self, recipe: str | RecipeIdentity, eval_set: str) -> SetPolicy:
        """Rules for one eval set under one recipe: eval-set override > recipe override > defaults.

        `recipe` is a name or a RecipeIdentity (name, base, tags): see recipe_key for which override applies."""
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


def load_gate_policy(path: Path | None) -> tuple[Policy, Path]:
    """The policy a run is judged by (the default one when `path` is None) and the file it came from."""
    policy_path = path or DEFAULT_POLICY
    return load_policy(policy_path), policy_path
