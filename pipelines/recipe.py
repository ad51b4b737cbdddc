"""The recipe schema: the product's own vocabulary for layer-wise quantization schemes.

A recipe says, per layer group, how weights and activations are quantized. It is validated here
(types, unknown keys, contradictions that need no model), then compiled to an llm-compressor recipe by
pipelines.quantize.compiler, which also checks it against a concrete model and against what vLLM can serve.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipelines.errors import InputError
from pipelines.files.hashing import sha256_text
from pipelines.files.yamlio import parse_yaml_model, read_user_text
from pipelines.paths import RECIPES_DIR
from pipelines.schema import FrozenModel

# Numeric bounds: far beyond any real recipe, so that a typo or a hostile file is refused at load.
MAX_GROUP_SIZE = 2**16
MAX_BLOCK_SIZE = 2**16
MAX_SAMPLES = 1_000_000
MAX_SEQ_LENGTH = 2**24
MAX_LAYER_INDEX = 100_000
MAX_SEED = 2**63 - 1
MAX_TAGS = 32
DEFAULT_AUTO_GROUP_CAP = 128  # `group_size: auto` means `group_size: {auto: 128}`
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
# A calibration dataset (recipe, --calibration, a job's `calibration:`) naming no data but the held-out
# prompts (calibration.jsonl) of the eval sets the run scores: pipelines.quantize.calibration.held_out_prompts.
FROM_EVAL_SETS = "from-eval-sets"
GROUP_SIZE_HELP = (
    "group_size is an even number of input columns per scale, `auto` (per layer: the largest power of two up to "
    f"{DEFAULT_AUTO_GROUP_CAP} that divides the layer's input size) or `{{auto: N}}` (the same, up to N, a power of two)"
)


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class AutoGroupSize(FrozenModel):
    """`group_size: auto` / `group_size: {auto: N}`: chosen per layer by the compiler (see group_size_for)."""

    auto: int = Field(default=DEFAULT_AUTO_GROUP_CAP, ge=2, le=MAX_GROUP_SIZE, description="the largest group size allowed")

    @field_validator("auto", mode="before")
    @classmethod
    def _integer(cls, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"the cap of `group_size: {{auto: N}}` is an integer, a power of two (got {value!r})")
        return value

    @field_validator("auto")
    @classmethod
    def _cap_is_a_power_of_two(cls, value: int) -> int:
        if not _power_of_two(value):
            raise ValueError(f"the cap of `group_size: {{auto: N}}` must be a power of two, e.g. 64 or 128 (got {value})")
        return value


def auto_group_sizes(in_features: int, cap: int) -> list[int]:
    """The group sizes `auto` may choose for a layer, largest first: powers of two from `cap` down to 2
    that divide `in_features`. Powers of two because every vLLM 4-bit kernel takes them (CPUWNA16 any even
    size; CUDA Marlin and Machete 32, 64, 128); another even divisor (96 for 576) serves on the CPU only."""
    sizes, size = [], 2
    while size <= cap:
        if in_features % size == 0:
            sizes.append(size)
        size *= 2
    return sorted(sizes, reverse=True)


NumberType = Literal["int", "float"]  # float: FP8 (E4M3), 8 bits only
DEFAULT_BLOCK = (128, 128)  # llm-compressor's FP8_BLOCK preset and DeepSeek-style checkpoints: 128 x 128 weight blocks


class WeightScheme(FrozenModel):
    bits: Literal[2, 3, 4, 8] = 8
    type: NumberType = Field(default="int", description="int, or float (FP8 E4M3: 8 bits, symmetric)")
    granularity: Literal["channel", "group", "tensor", "block"] = "channel"
    group_size: int | AutoGroupSize | None = Field(default=None, description=GROUP_SIZE_HELP)
    block: tuple[Annotated[int, Field(gt=0, le=MAX_GROUP_SIZE)], Annotated[int, Field(gt=0, le=MAX_GROUP_SIZE)]] | None = Field(
        default=None, description="granularity 'block' (FP8): [output rows, input columns] per scale; default [128, 128]")
    symmetric: bool = True

    @field_validator("group_size", mode="before")
    @classmethod
    def _auto_or_number(cls, value: object) -> object:
        if value is None or isinstance(value, AutoGroupSize):
            return value
        if value == "auto":
            return AutoGroupSize()
        if isinstance(value, dict) and set(value) == {"auto"}:
            return AutoGroupSize.model_validate(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{GROUP_SIZE_HELP}; got {value!r}")
        if not 0 < value <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size must be from 2 to {MAX_GROUP_SIZE} (got {value})")
        return value

    @model_validator(mode="after")
    def _float_is_fp8(self) -> WeightScheme:
        if self.type == "float" and self.bits != 8:
            raise ValueError(f"float weights are FP8 (E4M3): bits must be 8 (got {self.bits})")
        if self.type == "float" and not self.symmetric:
            raise ValueError("float (FP8) weights are symmetric: remove `symmetric: false`")
        if self.granularity == "block" and self.type != "float":
            raise ValueError("granularity 'block' is for float (FP8) weights: write `type: float`")
        if self.block is not None and self.granularity != "block":
            raise ValueError(f"block is only meaningful with granularity 'block', not {self.granularity!r}")
        return self

    @property
    def block_shape(self) -> tuple[int, int] | None:
        """[output rows, input columns] per scale of a block-wise scheme (None: not block-wise)."""
        return (self.block or DEFAULT_BLOCK) if self.granularity == "block" else None

    @model_validator(mode="after")
    def _group_size_matches_granularity(self) -> WeightScheme:
        if self.granularity == "group" and self.group_size is None:
            raise ValueError("granularity 'group' needs group_size")
        if self.granularity != "group" and self.group_size is not None:
            raise ValueError(f"group_size is only meaningful with granularity 'group', not {self.granularity!r}")
        if isinstance(self.group_size, int) and self.group_size % 2:
            raise ValueError(f"group_size must be even (got {self.group_size})")
        return self

    @property
    def auto_group(self) -> bool:
        return isinstance(self.group_size, AutoGroupSize)

    def group_size_for(self, in_features: int) -> int | None:
        """The group size this scheme gives a layer with `in_features` inputs (None: not grouped, or
        `auto` finds no size that divides it). A fixed size is returned as written, dividing or not."""
        if isinstance(self.group_size, AutoGroupSize):
            sizes = auto_group_sizes(in_features, self.group_size.auto)
            return sizes[0] if sizes else None
        return self.group_size

    def for_layer(self, in_features: int) -> WeightScheme:
        """This scheme with `auto` replaced by the layer's group size (unchanged when there is none)."""
        if not self.auto_group:
            return self
        size = self.group_size_for(in_features)
        return self if size is None else self.model_copy(update={"group_size": size})


class ActivationScheme(FrozenModel):
    bits: Literal[8] = 8
    type: NumberType = Field(default="int", description="int, or float (FP8 E4M3, symmetric)")
    granularity: Literal["token", "tensor", "group"] = "token"
    group_size: int | None = Field(default=None, gt=0, le=MAX_GROUP_SIZE,
                                   description="granularity 'group' (FP8 block recipes): input columns per dynamic scale of each token")
    dynamic: bool = True
    symmetric: bool = True

    @model_validator(mode="after")
    def _static_needs_tensor(self) -> ActivationScheme:
        if not self.dynamic and self.granularity in ("token", "group"):
            raise ValueError(f"static (calibrated) activation scales cannot be per-{self.granularity}; use granularity 'tensor' or dynamic: true")
        if self.type == "float" and not self.symmetric:
            raise ValueError("float (FP8) activations are symmetric: remove `symmetric: false`")
        if (self.granularity == "group") != (self.group_size is not None):
            raise ValueError("granularity 'group' needs group_size, and group_size needs granularity 'group'")
        return self


Method = Literal["rtn", "gptq"]
# The toolkit that quantizes (pipelines.quantize.backends, docs/backends.md): llm-compressor in .venv, the others each in
# an environment of their own, run as a subprocess.
Backend = Literal["llm-compressor", "gptqmodel", "bitsandbytes"]
DEFAULT_BACKEND: Backend = "llm-compressor"
CALIBRATED_METHODS: frozenset[str] = frozenset({"gptq"})  # methods that read calibration data


class GroupScheme(FrozenModel):
    """How one layer group is quantized. `activations: null` means 16-bit activations (weight-only).
    `algorithm` chooses how these weights are rounded (round-to-nearest or GPTQ) for this group alone;
    unset, the recipe's `algorithm.method` applies (the compiler resolves it per module)."""

    weights: WeightScheme
    activations: ActivationScheme | None = None
    algorithm: Method | None = Field(default=None, description="'rtn' or 'gptq' for this group; unset: the recipe's algorithm.method")

    @property
    def needs_calibration(self) -> bool:
        """GPTQ reads calibration data, and so do static (calibrated) activation scales."""
        static = self.activations is not None and not self.activations.dynamic
        return static or self.algorithm in CALIBRATED_METHODS

    def with_method(self, method: Method) -> GroupScheme:
        """This scheme with its algorithm made concrete (`method` when it names none)."""
        return self if self.algorithm is not None else self.model_copy(update={"algorithm": method})


class KeptGroup(FrozenModel):
    """Embeddings / lm_head: floating point unless the recipe says `quantize: true` explicitly."""

    quantize: bool = False
    weights: WeightScheme | None = None

    @model_validator(mode="after")
    def _explicit(self) -> KeptGroup:
        if self.weights is not None and not self.quantize:
            raise ValueError("weights given but quantize is not true: say `quantize: true` to quantize this group")
        if self.quantize and self.weights is None:
            raise ValueError("quantize: true needs a weights scheme")
        return self


class Groups(FrozenModel):
    attention: GroupScheme | None = None
    mlp: GroupScheme | None = None
    embeddings: KeptGroup = KeptGroup()
    lm_head: KeptGroup = KeptGroup()


class Override(FrozenModel):
    """Re-schemes attention / MLP Linear layers selected by decoder-layer index and/or name regex.

    `layers` (negative counts from the end) and `match` (searched in the module name) are ANDed;
    later overrides win over earlier ones.
    """

    layers: list[Annotated[int, Field(ge=-MAX_LAYER_INDEX, le=MAX_LAYER_INDEX)]] | None = Field(
        default=None, min_length=1, max_length=MAX_LAYER_INDEX)
    match: str | None = Field(default=None, max_length=1000, description="regular expression searched in the module name")
    keep: bool = Field(default=False, description="keep the matched Linear layers in 16-bit")
    attention: GroupScheme | None = None
    mlp: GroupScheme | None = None

    @field_validator("match")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as error:
                raise ValueError(f"not a regular expression: {error}") from None
        return value

    @model_validator(mode="after")
    def _selects_and_acts(self) -> Override:
        if self.layers is None and self.match is None:
            raise ValueError("an override needs `layers` or `match`")
        if not self.keep and self.attention is None and self.mlp is None:
            raise ValueError("an override needs `keep: true` or a scheme for attention / mlp")
        if self.keep and (self.attention is not None or self.mlp is not None):
            raise ValueError("`keep: true` keeps layers in 16-bit; it cannot also give them a scheme")
        return self


class Algorithm(FrozenModel):
    method: Method = "rtn"
    block_size: int = Field(default=128, gt=0, le=MAX_BLOCK_SIZE)
    dampening_frac: float = Field(default=0.01, ge=0, lt=1)
    actorder: Literal["weight", "static"] | None = Field(
        default=None, description="GPTQ column order by activation size ('static' is an alias of 'weight')"
    )

    @field_validator("actorder", mode="before")
    @classmethod
    def _no_group_order(cls, value: object) -> object:
        if value in ("group", "dynamic", True):
            raise ValueError(
                "actorder 'group' (a g_idx per weight) was removed in compressed-tensors 0.19 and vLLM CPU "
                "has no kernel for it; use 'weight' (or 'static') or leave it out"
            )
        return value

    @model_validator(mode="after")
    def _gptq_knobs_need_gptq(self) -> Algorithm:
        knobs = self.model_fields_set & {"block_size", "dampening_frac", "actorder"}
        if self.method == "rtn" and knobs:
            raise ValueError(f"{', '.join(sorted(knobs))} only apply to method 'gptq'")
        return self


class SmoothQuant(FrozenModel):
    strength: float = Field(default=0.8, gt=0, lt=1)


class Calibration(FrozenModel):
    dataset: str = Field(
        default="calibration", max_length=4096,
        description=f"a set under eval_sets/, a folder with data.jsonl, a JSONL path with a 'text' field, or {FROM_EVAL_SETS!r} "
                    "(the held-out prompts of the scored eval sets; docs/calibration.md). --calibration replaces it per run",
    )
    num_samples: int = Field(default=64, gt=0, le=MAX_SAMPLES)
    max_seq_length: int = Field(default=256, gt=0, le=MAX_SEQ_LENGTH)
    seed: int = Field(default=0, ge=-MAX_SEED, le=MAX_SEED)


# vLLM 0.32's --kv-cache-dtype values (vllm/config/cache.py CacheDType), each with its bits per stored element where the
# product counts and serves it; None: vLLM knows it but its layout (scales per token and head, mixed K/V bits, NVFP4
# blocks) is not counted by the planner, so a recipe cannot choose it yet. `auto`: the dtype the model is served in.
VLLM_KV_CACHE_DTYPES: dict[str, int | None] = {
    "auto": None, "bfloat16": 16, "float16": 16, "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8,
    **dict.fromkeys(("fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                     "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head",
                     "nvfp4", "nvfp4_4over6")),
}
KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "16-bit": "auto"}
# Quantized KV dtypes a recipe may choose (the planner counts them; llm-compressor calibrates the FP8 E4M3 ones).
KV_QUANTIZED = ("fp8", "fp8_e4m3", "fp8_e5m2")
KV_CALIBRATABLE = ("fp8", "fp8_e4m3")  # llm-compressor's kv_cache_scheme: FP8 E4M3 per-tensor scales, vLLM's only kind
KV_HELP = "auto (the dtype the model is served in), bf16 / bfloat16, float16, fp8, fp8_e4m3 or fp8_e5m2"


class KvCache(FrozenModel):
    """The KV cache's precision. `kv_cache: fp8` is short for `{dtype: fp8, scales: dynamic}`.

    scales `calibrated`: llm-compressor measures per-tensor FP8 scales for every attention layer's K and V on the
    calibration set (its kv_cache_scheme) and stores them in the checkpoint, which vLLM loads. `dynamic`: none are
    stored and vLLM uses its own when serving (in vLLM 0.32 a scale of 1.0 for fp8: it no longer computes them from
    the first batch). Served as vLLM's --kv-cache-dtype."""

    dtype: str = Field(default="auto", max_length=64, description=KV_HELP)
    scales: Literal["dynamic", "calibrated"] = "dynamic"

    @field_validator("dtype", mode="before")
    @classmethod
    def _known(cls, value: object) -> object:
        if not isinstance(value, str):
            raise ValueError(f"kv_cache dtype is a string: {KV_HELP} (got {value!r})")
        name = KV_ALIASES.get(value.strip().lower(), value.strip().lower())
        if name not in VLLM_KV_CACHE_DTYPES:
            raise ValueError(f"{value!r} is not a KV cache dtype vLLM 0.32 knows; give {KV_HELP}")
        if name != "auto" and VLLM_KV_CACHE_DTYPES[name] is None:
            raise ValueError(f"{name!r} is a vLLM KV cache dtype the product does not count or serve yet (its scales per token "
                             f"and head or mixed bits are not in the planner); give {KV_HELP}")
        return name

    @model_validator(mode="after")
    def _calibrated_is_fp8(self) -> KvCache:
        if self.scales == "calibrated" and self.dtype not in KV_CALIBRATABLE:
            raise ValueError(f"calibrated KV scales are FP8 E4M3 (llm-compressor's kv_cache_scheme, vLLM's only kind): dtype must be "
                             f"{' or '.join(KV_CALIBRATABLE)}, not {self.dtype!r}")
        return self

    @property
    def quantized(self) -> bool:
        return self.dtype in KV_QUANTIZED

    @property
    def bits(self) -> int | None:
        """Bits per stored K or V value; None for `auto` (the serve dtype's)."""
        return VLLM_KV_CACHE_DTYPES[self.dtype]

    @property
    def vllm_dtype(self) -> str:
        """vLLM's --kv-cache-dtype for it."""
        return self.dtype


def _kv_short_form(value: object) -> object:
    """`kv_cache: fp8` (a dtype alone) is `{dtype: fp8}`."""
    return value if isinstance(value, dict | KvCache) else {"dtype": value}


class RecipeIdentity(FrozenModel):
    """What policy `recipes:` keys match: the recipe's name, then its base, then its tags (in order)."""

    name: str
    base: str | None = None
    tags: tuple[str, ...] = ()

    @classmethod
    def of(cls, recipe: str | RecipeIdentity) -> RecipeIdentity:
        return recipe if isinstance(recipe, RecipeIdentity) else cls(name=recipe)

    def keys(self) -> list[str]:
        """The policy keys that may match, in precedence order, without repeats."""
        ordered = [self.name, *([self.base] if self.base else []), *self.tags]
        return list(dict.fromkeys(ordered))


class Recipe(FrozenModel):
    name: str = Field(pattern=NAME_PATTERN, max_length=64)
    description: str = ""
    base: str | None = Field(
        default=None, pattern=NAME_PATTERN, max_length=64,
        description="the recipe family this one varies (e.g. w4a16): gate policy overrides for it apply when none names this recipe",
    )
    tags: list[Annotated[str, Field(pattern=NAME_PATTERN, max_length=64)]] = Field(
        default=[], max_length=MAX_TAGS, description="labels gate policy overrides can match (after the name and the base)",
    )
    backend: Backend = Field(
        default=DEFAULT_BACKEND,
        description="the toolkit that quantizes: llm-compressor (the default), gptqmodel or bitsandbytes (docs/backends.md)",
    )
    algorithm: Algorithm = Algorithm()
    smoothquant: SmoothQuant | None = None
    calibration: Calibration | None = None
    groups: Groups = Groups()
    overrides: list[Override] = Field(default=[], max_length=10_000)
    kv_cache: KvCache = Field(default=KvCache(), description=f"the KV cache's precision: {KV_HELP}, or {{dtype, scales: dynamic|calibrated}}")

    @field_validator("kv_cache", mode="before")
    @classmethod
    def _kv_cache_short_form(cls, value: object) -> object:
        return _kv_short_form(value)

    @field_validator("tags")
    @classmethod
    def _distinct_tags(cls, value: list[str]) -> list[str]:
        repeated = sorted({tag for tag in value if value.count(tag) > 1})
        if repeated:
            raise ValueError(f"tag {repeated[0]!r} is given twice")
        return value

    @model_validator(mode="after")
    def _something_to_do(self) -> Recipe:
        groups = self.groups
        if not (groups.attention or groups.mlp or groups.embeddings.quantize or groups.lm_head.quantize or self.kv_cache.dtype != "auto"):
            raise ValueError("the recipe quantizes nothing: give groups.attention and/or groups.mlp a scheme, or a `kv_cache:` precision")
        return self

    @model_validator(mode="after")
    def _calibration_when_needed(self) -> Recipe:
        if self.needs_calibration and self.calibration is None:
            raise ValueError("this recipe needs calibration data (GPTQ, SmoothQuant, static activations or calibrated KV scales): "
                             "add `calibration:`")
        if not self.needs_calibration and self.calibration is not None:
            raise ValueError(
                "calibration given but nothing uses it (RTN weights, dynamic activations, no SmoothQuant): remove `calibration:`"
            )
        return self

    @property
    def needs_calibration(self) -> bool:
        schemes = [self.groups.attention, self.groups.mlp] + [s for o in self.overrides for s in (o.attention, o.mlp)]
        calibrated = any(s is not None and s.needs_calibration for s in schemes)
        kv = self.kv_cache.scales == "calibrated"
        return self.algorithm.method in CALIBRATED_METHODS or self.smoothquant is not None or calibrated or kv

    @property
    def quantizes_weights(self) -> bool:
        """Whether any Linear is quantized (a recipe may change only the KV cache's precision)."""
        groups = self.groups
        schemes = [groups.attention, groups.mlp] + [s for o in self.overrides for s in (o.attention, o.mlp)]
        return any(s is not None for s in schemes) or groups.embeddings.quantize or groups.lm_head.quantize

    @property
    def identity(self) -> RecipeIdentity:
        """What gate policy overrides are matched by: the name, then the base, then the tags."""
        return RecipeIdentity(name=self.name, base=self.base, tags=tuple(self.tags))


def identity_from_text(text: str | None, name: str) -> RecipeIdentity:
    """The identity of a recipe as written (a manifest's `recipe_text`), named `name` (the run's recipe
    name, which may differ: `--recipe-name`). Text that no longer parses gives the name alone."""
    if text:
        try:
            recipe = parse_recipe(text, "manifest.json: recipe_text")
        except InputError:
            return RecipeIdentity(name=name)
        return recipe.identity.model_copy(update={"name": name})
    return RecipeIdentity(name=name)


def resolve_recipe_path(name_or_path: str) -> Path:
    """A shipped recipe name (`w8a8`) or a path to a YAML file."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or _exists(candidate):
        return candidate
    return RECIPES_DIR / f"{name_or_path}.yaml"


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte: not a file; reading it says why
        return False


def shipped_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


class LoadedRecipe(BaseModel):
    """A recipe as loaded from its file: parsed once, then passed along with where it came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: Recipe
    path: Path
    text: str = Field(description="the file's text as written (what a job's ledger key and a manifest record)")

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def sha256(self) -> str:
        return sha256_text(self.text)


def load_recipe(name_or_path: str | LoadedRecipe) -> LoadedRecipe:
    """Parse and validate a recipe (a shipped name or a YAML path); one already loaded is returned as it is."""
    if isinstance(name_or_path, LoadedRecipe):
        return name_or_path
    path = resolve_recipe_path(name_or_path)
    if not _exists(path) or not path.is_file():
        raise InputError(f"no such recipe (shipped recipes: {', '.join(shipped_recipes())})", file=path, field="recipe")
    text = read_user_text(path, what="recipe", field="recipe")  # bounded, UTF-8 (BOM accepted)
    return LoadedRecipe(recipe=parse_recipe(text, path), path=path, text=text)


def parse_recipe(text: str, path: Path | str) -> Recipe:
    return parse_yaml_model(text, path, Recipe, "recipe")


def with_backend(loaded: LoadedRecipe, backend: Backend) -> LoadedRecipe:
    """The same layer-wise intent quantized by `backend` (the bake-off's rows). A recipe already on `backend` is returned
    as it is; otherwise it is renamed NAME-BACKEND with NAME as its base (unless it has one), so its gate policy still
    applies and its artifacts, runs and manifests never pass for the original's."""
    if loaded.recipe.backend == backend:
        return loaded
    data = yaml.safe_load(loaded.text)  # the file as written (validated when it was loaded): a mapping
    data.update(name=f"{loaded.name}-{backend}"[:64], base=loaded.recipe.base or loaded.name, backend=backend)
    text = yaml.safe_dump(data, sort_keys=False, width=120)
    return LoadedRecipe(recipe=parse_recipe(text, loaded.path), path=loaded.path, text=text)
