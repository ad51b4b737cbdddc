"""Fallback ladders: per scheme family, the schemes a module may move to, least precise first.

A ladder file (recipes/ladders/<target kind>.yaml, i.e. cpu.yaml or cuda.yaml; `--ladder FILE`) has one ladder
per family: `weight_only` for modules whose activations stay 16-bit, `w8a8` for modules with int8 activations,
`fp8` for modules with FP8 weights; and `kv_cache`, the KV cache's precisions least precise first (`auto`, the dtype
the model is served in, last): a repair moves a quantized KV cache one rung up before any module (it costs no weight
bytes), checked against the target's attention like a recipe's `kv_cache`.
A rung is a scheme in the recipe vocabulary (pipelines.recipe.GroupScheme) or `16-bit`. Loading checks every
rung against the serve target's kernels (pipelines.hardware.targets.serve_problem): a rung no kernel serves is refused,
naming file and rung.
For one module (a Unit), the rungs above its current scheme that its shapes allow are its options; the
others are listed with the compiler's reason (a group size that does not divide the layer, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipelines.errors import InputError
from pipelines.files.yamlio import parse_yaml_model, read_user_text
from pipelines.hardware.targets import ServeTarget, kv_cache_problem, serve_problem
from pipelines.paths import RECIPES_DIR
from pipelines.quantize.calibration import resolve_calibration_data
from pipelines.quantize.compiler import SIXTEEN_BIT, ModuleScheme, check_plan, concrete_schemes, scheme_summary
from pipelines.recipe import Calibration, GroupScheme, KvCache, Recipe
from pipelines.repair.pricing import unit_bytes
from pipelines.repair.units import Unit
from pipelines.schema import FrozenModel

LADDERS_DIR = RECIPES_DIR / "ladders"
MAX_RUNGS = 32
FamilyName = Literal["weight_only", "w8a8", "fp8"]


class Family(FrozenModel):
    description: str = ""
    rungs: list[GroupScheme | None] = Field(min_length=2, max_length=MAX_RUNGS, description=f"schemes, or {SIXTEEN_BIT!r}, least precise first")

    @field_validator("rungs", mode="before")
    @classmethod
    def _sixteen_bit(cls, value: object) -> object:
        if not isinstance(value, list):
            return value
        for index, rung in enumerate(value):
            if isinstance(rung, str) and rung != SIXTEEN_BIT:
                raise ValueError(f"rung {index}: {rung!r} is not a rung; write {SIXTEEN_BIT!r} or a scheme (weights, activations)")
        return [None if rung == SIXTEEN_BIT else rung for rung in value]

    @field_validator("rungs")
    @classmethod
    def _ordered(cls, value: list[GroupScheme | None]) -> list[GroupScheme | None]:
        value = [rung.with_method("rtn") if rung is not None else None for rung in value]  # a rung names its algorithm; unset: RTN
        if None in value[:-1]:
            raise ValueError(f"{SIXTEEN_BIT!r} can only be the last rung (nothing is more precise)")
        seen = [rung for index, rung in enumerate(value) if rung in value[:index]]
        if seen:
            raise ValueError(f"rung {scheme_summary(seen[0])!r} is given twice")
        return value


class Families(FrozenModel):
    weight_only: Family | None = Field(default=None, description="modules with int weights and 16-bit activations (W4A16 and the like)")
    w8a8: Family | None = Field(default=None, description="modules with int8 activations")
    fp8: Family | None = Field(default=None, description="modules with FP8 weights")


class KvRungs(FrozenModel):
    description: str = ""
    rungs: list[str] = Field(min_length=2, max_length=MAX_RUNGS, description="KV cache dtypes, least precise first; `auto` last")

    @field_validator("rungs")
    @classmethod
    def _known_and_ordered(cls, value: list[str]) -> list[str]:
        names = [KvCache(dtype=rung).dtype for rung in value]  # each a KV dtype the recipe vocabulary takes (aliases resolved)
        if names[-1] != "auto" or "auto" in names[:-1]:
            raise ValueError("`auto` (the dtype the model is served in) is the last KV rung, once: nothing is more precise")
        if len(set(names)) < len(names):
            raise ValueError("a KV rung is given twice")
        return names


class Ladder(FrozenModel):
    schema_version: Literal[1] = 1
    description: str = ""
    families: Families
    kv_cache: KvRungs | None = Field(default=None, description="the KV cache's precisions, least precise first")

    def family_of(self, scheme: GroupScheme) -> tuple[FamilyName, Family | None]:
        name: FamilyName = "fp8" if scheme.weights.type == "float" else "weight_only" if scheme.activations is None else "w8a8"
        return name, getattr(self.families, name)

    def kv_rungs_above(self, current: KvCache) -> list[str]:
        """The KV precisions above `current` on this ladder: after it when it is a rung, else every rung storing more bits
        (`auto` always: the serve dtype is at least 16 bits)."""
        if self.kv_cache is None or current.dtype == "auto":
            return []
        rungs = self.kv_cache.rungs
        if current.dtype in rungs:
            return rungs[rungs.index(current.dtype) + 1:]
        return [rung for rung in rungs if rung == "auto" or (KvCache(dtype=rung).bits or 0) > (current.bits or 0)]


class LoadedLadder(BaseModel):
    model_config = ConfigDict(frozen=True)

    ladder: Ladder
    path: Path
    text: str
    target: str


def default_ladder_path(target: ServeTarget) -> Path:
    """The shipped ladder for a serve target: recipes/ladders/<kind>-<class>.yaml where the class has its own
    (cpu-avx2.yaml: no 4-bit kernel there), else <kind>.yaml (cpu.yaml, cuda.yaml)."""
    own = LADDERS_DIR / f"{target.kind}-{target.isa}.yaml" if target.isa else None
    return own if own is not None and own.is_file() else LADDERS_DIR / f"{target.kind}.yaml"


def load_ladder(path: Path | str | None, target: ServeTarget, *, calibrated: bool = True) -> LoadedLadder:
    """Parse, validate and check a ladder file against `target`'s kernels (None: the target's shipped ladder);
    an InputError naming the file and the field otherwise. `calibrated`: whether calibration data is available
    to the repair; a given ladder whose rung needs it (GPTQ, static activation scales) is refused when it is not,
    while the shipped ladder's such rungs are skipped per module with that reason (unit_ladder)."""
    shipped = path is None
    path = Path(path) if path is not None else default_ladder_path(target)
    text = read_user_text(path, what="ladder", field="--ladder")
    ladder = parse_yaml_model(text, path, Ladder, "ladder")
    check_kernels(ladder, path, target)
    if not calibrated and not shipped:
        check_calibration(ladder, path)
    return LoadedLadder(ladder=ladder, path=path, text=text, target=str(target))


def check_kernels(ladder: Ladder, path: Path | str, target: ServeTarget) -> None:
    """Every rung must be a scheme vLLM serves on `target`: refused at validation, not after minutes of quantizing. A KV rung
    the target's attention cannot store is skipped per model instead (kv_options: it also depends on the head size)."""
    for name in Families.model_fields:
        family = getattr(ladder.families, name)
        for index, rung in enumerate(family.rungs if family else []):
            problem = serve_problem(rung, target) if rung is not None else None
            if problem:
                field = f"families.{name}.rungs.{index}" + (f".{problem.field}" if problem.field else "")
                raise InputError(f"no vLLM kernel serves this rung on {target}: {problem.why}", file=path, field=field)


def check_calibration(ladder: Ladder, path: Path | str) -> None:
    """With no calibration data for the repair, a rung that needs it cannot be quantized: refused, naming the rung."""
    for name in Families.model_fields:
        family = getattr(ladder.families, name)
        for index, rung in enumerate(family.rungs if family else []):
            if rung is not None and rung.needs_calibration:
                field = f"families.{name}.rungs.{index}." + ("algorithm" if rung.algorithm != "rtn" else "activations.dynamic")
                raise InputError(f"{scheme_summary(rung)} needs calibration data and this repair has none "
                                 f"({NO_CALIBRATION})", file=path, field=field)


NO_CALIBRATION = "the recipe calibrates nothing, no --calibration was given and no calibration set is installed"


def calibration_available(recipe: Recipe, source: str | None) -> bool:
    """Whether a proposal of `recipe` can calibrate (GPTQ rungs, static scales): the run names data (--calibration),
    the recipe calibrates, or the recipe default's calibration set (`calibration.dataset`) is installed."""
    if source is not None or recipe.calibration is not None:
        return True
    try:
        resolve_calibration_data(Calibration().dataset)
    except InputError:
        return False
    return True


# --------------------------------------------------------------------------------- one unit


class RungOption(FrozenModel):
    """A scheme a unit may move to (concrete for its layers: `auto` group sizes resolved); None: 16-bit."""

    scheme: GroupScheme | None
    position: int = Field(description="index of the rung in its family's ladder")

    @property
    def label(self) -> str:
        return scheme_summary(self.scheme)


class UnitLadder(FrozenModel):
    unit: str
    family: FamilyName | None
    current: str
    on_ladder: bool = Field(description="the unit's scheme is one of the ladder's rungs")
    options: list[RungOption] = Field(description="the rungs above the current scheme that apply, in ladder order")
    skipped: list[str] = Field(default=[], description="rungs above the current one that cannot apply to this unit, and why")


def concrete_rung(rung: GroupScheme | None, unit: Unit) -> GroupScheme | None:
    if rung is None or not rung.weights.auto_group:
        return rung
    return rung.model_copy(update={"weights": rung.weights.for_layer(unit.in_features)})


def rung_problem(rung: GroupScheme | None, unit: Unit, target: ServeTarget, calibrated: bool = True) -> str | None:
    """Why this rung cannot apply to this unit (the compiler's own checks on its shards), or None."""
    if rung is None:
        return None
    if rung.needs_calibration and not calibrated:
        return f"needs calibration data and there is none ({NO_CALIBRATION})"
    plan = {info.name: ModuleScheme(module=info, scheme=rung, source="rung") for info in unit.modules}
    try:
        check_plan(concrete_schemes(plan, "ladder"), "ladder", target)
    except InputError as error:
        return error.message
    return None


def unit_ladder(unit: Unit, ladder: Ladder, target: ServeTarget, calibrated: bool = True) -> UnitLadder:
    """The rungs `unit` may move to: above its current scheme on its family's ladder, and applicable to its shapes.

    A scheme that is not one of the ladder's rungs is placed by bytes: the rungs that store more qualify, and those
    that store as much with wider weights (int8 W8A8 above W4A8, whose int4 weights are stored one per int8)."""
    assert unit.scheme is not None, "16-bit units have nowhere to move"
    name, family = ladder.family_of(unit.scheme)
    if family is None:
        return UnitLadder(unit=unit.name, family=None, current=scheme_summary(unit.scheme), on_ladder=False, options=[],
                          skipped=[f"the ladder file has no {name!r} family"])
    rungs = [concrete_rung(rung, unit) for rung in family.rungs]
    on_ladder = unit.scheme in rungs
    if on_ladder:
        above = list(enumerate(rungs))[rungs.index(unit.scheme) + 1:]
    else:
        current, bits = unit_bytes(unit, unit.scheme), unit.scheme.weights.bits
        above = [(index, rung) for index, rung in enumerate(rungs)
                 if rung is None or (unit_bytes(unit, rung), rung.weights.bits) > (current, bits)]
    options, skipped = [], []
    for position, rung in above:
        problem = rung_problem(rung, unit, target, calibrated)
        if problem:
            skipped.append(f"{scheme_summary(rung)}: {problem}")
        else:
            options.append(RungOption(scheme=rung, position=position))
    return UnitLadder(unit=unit.name, family=name, current=scheme_summary(unit.scheme), on_ladder=on_ladder, options=options, skipped=skipped)


def kv_options(ladder: Ladder, current: KvCache, target: ServeTarget, head_dim: int | None) -> tuple[list[str], list[str]]:
    """The KV precisions a repair may move the KV cache to (above `current`, stored by `target`'s attention for heads
    of `head_dim`), and those skipped with the reason."""
    options, skipped = [], []
    for dtype in ladder.kv_rungs_above(current):
        found = kv_cache_problem(KvCache(dtype=dtype), target, head_dim)
        if found:
            skipped.append(f"kv_cache {dtype}: {found.why}")
        else:
            options.append(dtype)
    return options, skipped
