"""The memory planner: does a model, in 16-bit or quantized by a recipe, fit a GPU at a given context
length and concurrency, and how fast can one stream decode there?

Planning needs only config.json; weight bytes are measured exactly from safetensors headers when the
model's files are at hand. The formulas, their assumptions and their knobs are in docs/planner.md.
"""

from __future__ import annotations

import json
import math
import re
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field

from pipelines.compiler import LinearInfo, ModelLayout, cannot_apply
from pipelines.errors import InputError, from_validation_error
from pipelines.gate import FitCheck
from pipelines.recipe import GroupScheme, KeptGroup, Override, Recipe
from pipelines.yamlio import read_user_text

GiB = 1024**3
GPU_TABLE = Path(__file__).resolve().parent / "data" / "gpus.yaml"
SIXTEEN_BIT = "16-bit"
MAX_CONCURRENCY_SEARCHED = 1_000_000
# Input bounds: far beyond any real model or GPU, small enough that a plan stays a fraction of a second
# (the weight count loops over layers) and no product of them overflows a float or a C integer.
MAX_CONTEXT = 2**24  # tokens: 16.8 M (the largest published context is about 10 M)
MAX_CONCURRENCY = MAX_CONCURRENCY_SEARCHED
MAX_GPU_MEMORY_GIB = 2**20  # 1 PiB on one device
MAX_GPU_BANDWIDTH_GBS = 10**6  # 1 PB/s
MAX_BATCHED_TOKENS = 2**24
MAX_OVERHEAD_GIB = 2**20
MAX_CONFIG_BYTES = 4 * 1024 * 1024  # a config.json is a few kilobytes
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
CONFIG_BOUNDS = {  # the largest value config.json may give each size
    "hidden_size": 2**20,
    "num_hidden_layers": 10_000,
    "num_attention_heads": 2**16,
    "num_key_value_heads": 2**16,
    "head_dim": 2**16,
    "intermediate_size": 2**22,
    "moe_intermediate_size": 2**22,
    "shared_expert_intermediate_size": 2**22,
    "vocab_size": 2**24,
    "num_local_experts": 2**16,
    "num_experts": 2**16,
    "num_experts_per_tok": 2**16,
    "max_position_embeddings": MAX_CONTEXT,
    "sliding_window": MAX_CONTEXT,
    "sliding_window_pattern": 10_000,
    "max_window_layers": 10_000,
}
# Bytes per element of the KV cache for vLLM's --kv-cache-dtype values; "auto" follows the model dtype.
KV_CACHE_DTYPES: dict[str, int | None] = {
    "auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
_WEIGHT_SHAPE_BYTES = 16  # pack-quantized layers also store their original shape as int64[2]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- inputs: settings, GPUs -------------------------------------------------------------------------


class PlanSettings(_Model):
    """The estimate's knobs; the defaults and their reasons are in docs/planner.md."""

    overhead_fraction: float = Field(
        default=0.05, ge=0, lt=1, allow_inf_nan=False, description="allocator slack, as a fraction of weights + KV + activations",
    )
    fixed_overhead_bytes: int = Field(default=1 * GiB, ge=0, le=MAX_OVERHEAD_GIB * GiB, description="CUDA context, cuBLAS/NCCL workspaces, CUDA graphs")
    max_num_batched_tokens: int = Field(default=8192, gt=0, le=MAX_BATCHED_TOKENS, description="tokens in vLLM's profiling forward pass")
    activation_dtype_bytes: int = Field(default=2, gt=0)
    logits_buffers: int = Field(default=2, gt=0, description="float32 [max_num_seqs, vocab] buffers in the sampler")
    min_gpu_memory_utilization: float = Field(default=0.90, gt=0, le=1, allow_inf_nan=False, description="never recommend less than vLLM's default")
    max_gpu_memory_utilization: float = Field(default=0.95, gt=0, le=1, allow_inf_nan=False, description="the share of device memory a plan may use")

    def available_bytes(self, gpu: "GpuSpec") -> int:
        return int(gpu.memory_bytes * self.max_gpu_memory_utilization)


class GpuSpec(_Model):
    name: str
    memory_bytes: int = Field(gt=0)
    bandwidth_bytes_per_s: int | None = Field(default=None, gt=0)


class _GpuEntry(_Model):
    memory_gib: float = Field(gt=0)
    bandwidth_gbs: float = Field(gt=0)
    aliases: list[str] = []


class _GpuTable(_Model):
    gpus: dict[str, _GpuEntry]


def _normalized(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


@lru_cache(maxsize=1)
def _gpu_table() -> tuple[dict[str, GpuSpec], dict[str, str]]:
    """The shipped GPU table: specs by canonical name, and canonical names by normalized name or alias."""
    try:
        table = _GpuTable.model_validate(yaml.safe_load(GPU_TABLE.read_text()))
    except ValidationError as error:
        raise from_validation_error(error, GPU_TABLE) from None
    specs = {
        name: GpuSpec(name=name, memory_bytes=int(e.memory_gib * GiB), bandwidth_bytes_per_s=int(e.bandwidth_gbs * 1e9))
        for name, e in table.gpus.items()
    }
    aliases = {_normalized(alias): name for name, e in table.gpus.items() for alias in (name, *e.aliases)}
    return specs, aliases


def known_gpus() -> dict[str, GpuSpec]:
    """The GPUs in pipelines/data/gpus.yaml, by canonical name."""
    return _gpu_table()[0]


def gpu_spec(name: str | None = None, memory_gib: float | None = None, bandwidth_gbs: float | None = None) -> GpuSpec:
    """A GPU by table name, or by size (and bandwidth); a bandwidth given with a name overrides the table's."""
    if (name is None) == (memory_gib is None):
        raise InputError("give a GPU name or a memory size (not both)", field="gpu")
    for field, value, most in (("gpu_memory_gib", memory_gib, MAX_GPU_MEMORY_GIB), ("gpu_bandwidth_gbs", bandwidth_gbs, MAX_GPU_BANDWIDTH_GBS)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= most)):
            raise InputError(f"must be a positive number of at most {most:g} (got {value})", field=field)
    if name is not None and not isinstance(name, str):
        raise InputError(f"a GPU name is text (got {name!r})", field="gpu")
    bandwidth = int(bandwidth_gbs * 1e9) if bandwidth_gbs is not None else None
    if name is None:
        return GpuSpec(name=f"{memory_gib:g} GiB", memory_bytes=int(memory_gib * GiB), bandwidth_bytes_per_s=bandwidth)
    canonical = _gpu_table()[1].get(_normalized(name))
    if canonical is None:
        raise InputError(f"unknown GPU {name!r} (known: {', '.join(known_gpus())}; or give --gpu-memory-gib)", field="gpu")
    spec = known_gpus()[canonical]
    return spec.model_copy(update={"bandwidth_bytes_per_s": bandwidth}) if bandwidth else spec


# --- the model, from config.json ----------------------------------------------------------------------


class ModelShape(_Model):
    """What the planner needs from config.json."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    param_bytes: int = 2
    max_position: int | None
    windows: list[int | None] = Field(description="per layer: the sliding window in tokens, or None for full attention")
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    kv_cache_dtype: str | None = Field(default=None, description="from quantization_config.kv_cache_scheme")
    kv_cache_element_bytes: int | None = None
    quantized: bool = False

    @property
    def active_intermediate(self) -> int:
        """Intermediate width one token goes through (MoE: its routed experts plus any shared expert)."""
        if self.experts:
            return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate
        return self.intermediate


def load_config(config: dict | Path) -> tuple[dict, str]:
    """config.json as a dict, and where it came from (for error messages). A folder means its config.json."""
    if isinstance(config, dict):
        return config, "config.json"
    path = Path(config)
    try:
        if path.is_dir():
            path = path / "config.json"
    except (OSError, ValueError):
        pass  # read_user_text names the problem
    text = read_user_text(path, what="config", field="config", max_bytes=MAX_CONFIG_BYTES)
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise InputError(f"not valid JSON ({error})", file=path, field="config") from None
    except ValueError as error:
        raise InputError(f"not valid JSON ({error})", file=path, field="config") from None
    except RecursionError:
        raise InputError("not valid JSON (nested too deep)", file=path, field="config") from None
    if not isinstance(data, dict):
        raise InputError("config.json must hold a JSON object", file=path, field="(top level)")
    return data, str(path)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _bounded(key: str, value: Any, source: str, *, low: int = 1) -> int:
    """A config size: an integer from `low` to its CONFIG_BOUNDS entry, else an InputError naming the key."""
    most = CONFIG_BOUNDS.get(key, 2**31 - 1)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= most:
        raise InputError(f"needs an integer from {low} to {most} (got {value!r})", file=source, field=key)
    return value


def check_config_bounds(config: dict, source: str = "config.json") -> None:
    """What any reader of a config.json checks before building from it (even a meta-device model, whose
    construction loops over the layers): every size named in CONFIG_BOUNDS that is given, here or in
    `text_config`, is an integer of at most its bound, and no number anywhere is NaN or infinite.

    Lenient on purpose (a size may be absent, null or 0): model_shape checks what the planner needs."""
    _check_finite_json(config, source, "")
    nested = config.get("text_config")
    for cfg in (config, nested if isinstance(nested, dict) else {}):
        for key in CONFIG_BOUNDS:
            value = cfg.get(key)
            if value is None or isinstance(value, bool):
                continue
            _bounded(key, value, source, low=0)


def _check_finite_json(value: Any, source: str, where: str, depth: int = 0) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"must be a finite number (got {value})", file=source, field=where or "(top level)")
    if depth > 64:
        raise InputError("nested deeper than 64 levels", file=source, field=where)
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite_json(item, source, f"{where}.{key}" if where else str(key), depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_finite_json(item, source, f"{where}[{index}]", depth + 1)


def model_shape(config: dict, source: str = "config.json") -> ModelShape:
    """Validate config.json's fields and derive the shape. Multimodal configs plan their text model."""
    cfg = {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config
    if "kv_lora_rank" in cfg:
        raise InputError("multi-head latent attention (DeepSeek-style) is not supported", file=source, field="kv_lora_rank")

    def need(key: str, default: Any = None) -> int:
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            got = "missing" if key not in cfg else f"got {value!r}"
            raise InputError(f"needs a positive integer ({got})", file=source, field=key)
        return _bounded(key, value, source)

    hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
    kv_heads = need("num_key_value_heads", heads)
    if heads % kv_heads:
        message = f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        raise InputError(message, file=source, field="num_key_value_heads")
    if "head_dim" not in cfg and hidden % heads:
        message = f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); give head_dim"
        raise InputError(message, file=source, field="head_dim")
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    quantization = cfg.get("quantization_config") if isinstance(cfg.get("quantization_config"), dict) else None
    max_position = cfg.get("max_position_embeddings")
    if isinstance(max_position, int) and not isinstance(max_position, bool):
        _bounded("max_position_embeddings", max_position, source)
    else:
        max_position = None
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if experts and shared:
        _bounded("shared_expert_intermediate_size", shared, source)
    return ModelShape(
        name=str(cfg.get("_name_or_path") or Path(source).parent.name or "model"),
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=need("head_dim", hidden // heads),
        intermediate=need("intermediate_size"),
        vocab=need("vocab_size"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position=max_position,
        windows=_layer_windows(cfg, layers, source),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=cfg.get("model_type") in ("qwen2", "qwen2_moe"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        experts=need("num_local_experts" if "num_local_experts" in cfg else "num_experts") if experts else 0,
        experts_per_token=need("num_experts_per_tok") if experts else 0,
        expert_intermediate=need("moe_intermediate_size", cfg.get("intermediate_size")) if experts else 0,
        shared_expert_intermediate=shared if experts else 0,
        **_config_kv_cache(quantization, source),
        quantized=quantization is not None,
    )


def _layer_windows(cfg: dict, layers: int, source: str) -> list[int | None]:
    """Which layers attend through a sliding window (they keep at most `window` tokens of KV cache)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise InputError(f"needs one entry per layer ({layers})", file=source, field="layer_types")
        sliding = [kind == "sliding_attention" for kind in types]
    elif not window or ("use_sliding_window" in cfg and not cfg["use_sliding_window"]):
        return [None] * layers
    elif "use_sliding_window" in cfg:  # Qwen2 family: the layers from max_window_layers on slide
        start = _bounded("max_window_layers", cfg.get("max_window_layers") or 0, source, low=0)
        sliding = [index >= start for index in range(layers)]
    elif cfg.get("sliding_window_pattern"):  # Gemma 3: every pattern-th layer is global
        pattern = _bounded("sliding_window_pattern", cfg["sliding_window_pattern"], source)
        sliding = [(index + 1) % pattern != 0 for index in range(layers)]
    elif cfg.get("model_type") == "gemma2":  # alternating, sliding first
        sliding = [index % 2 == 0 for index in range(layers)]
    else:  # Mistral: every layer
        sliding = [True] * layers
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise InputError(f"sliding layers need a positive integer window (got {window!r})", file=source, field="sliding_window")
    if any(sliding):
        _bounded("sliding_window", window, source)
    return [window if slides else None for slides in sliding]


def _config_kv_cache(quantization: dict | None, source: str = "config.json") -> dict[str, Any]:
    """A quantized KV cache from compressed-tensors' kv_cache_scheme (e.g. {num_bits: 8, type: float})."""
    scheme = (quantization or {}).get("kv_cache_scheme")
    if not isinstance(scheme, dict):
        return {}
    bits = scheme.get("num_bits", 8)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 64:
        raise InputError(f"needs an integer from 1 to 64 (got {bits!r})", file=source, field="quantization_config.kv_cache_scheme.num_bits")
    kind = "fp" if scheme.get("type", "float") == "float" else "int"
    return {"kv_cache_dtype": f"{kind}{bits}", "kv_cache_element_bytes": max(1, math.ceil(bits / 8))}


# --- weights ---------------------------------------------------------------------------------------


class _Linear(NamedTuple):
    name: str
    group: Literal["attention", "mlp"]
    out: int
    inp: int
    bias: bool
    count: int = 1  # identical copies (MoE experts)
    expert: bool = False


class WeightBreakdown(_Model):
    total_bytes: int
    embedding_bytes: int = Field(description="the input embedding table (a lookup reads one row per token)")
    expert_bytes: int = Field(default=0, description="all routed experts (a token reads only its top-k)")

    def read_per_token(self, shape: ModelShape) -> int:
        """Bytes of weights one decode step reads from memory."""
        skipped_experts = self.expert_bytes * (1 - shape.experts_per_token / shape.experts) if shape.experts else 0
        embedding = 0 if shape.tied_embeddings else self.embedding_bytes
        return int(self.total_bytes - embedding - skipped_experts)


def _decoder_linears(shape: ModelShape, layer: int) -> list[_Linear]:
    prefix = f"model.layers.{layer}"
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv_bias = shape.attention_bias or shape.qkv_bias
    linears = [
        _Linear(f"{prefix}.self_attn.q_proj", "attention", q_width, shape.hidden, qkv_bias),
        _Linear(f"{prefix}.self_attn.k_proj", "attention", kv_width, shape.hidden, qkv_bias),
        _Linear(f"{prefix}.self_attn.v_proj", "attention", kv_width, shape.hidden, qkv_bias),
        _Linear(f"{prefix}.self_attn.o_proj", "attention", shape.hidden, q_width, shape.attention_bias),
    ]
    if not shape.experts:
        return linears + _mlp(f"{prefix}.mlp", shape.hidden, shape.intermediate, shape.mlp_bias)
    linears += _mlp(f"{prefix}.mlp.experts", shape.hidden, shape.expert_intermediate, False, shape.experts, True)
    if shape.shared_expert_intermediate:
        linears += _mlp(f"{prefix}.mlp.shared_expert", shape.hidden, shape.shared_expert_intermediate, False)
    return linears


def _mlp(prefix: str, hidden: int, width: int, bias: bool, count: int = 1, expert: bool = False) -> list[_Linear]:
    return [
        _Linear(f"{prefix}.gate_proj", "mlp", width, hidden, bias, count, expert),
        _Linear(f"{prefix}.up_proj", "mlp", width, hidden, bias, count, expert),
        _Linear(f"{prefix}.down_proj", "mlp", hidden, width, bias, count, expert),
    ]


def _selects(override: Override, layer: int, layers: int, name: str) -> bool:
    if override.layers is not None and layer not in {index % layers for index in override.layers}:
        return False
    if override.match is not None:
        try:
            return re.search(override.match, name) is not None
        except re.error as error:
            raise InputError(f"bad regular expression: {error}", field="overrides.match") from None
    return True


def _scheme_for(recipe: Recipe | None, layer: int, layers: int, linear: _Linear) -> GroupScheme | None:
    """The scheme a recipe gives one Linear: its group's, then each selecting override in order (later wins)."""
    if recipe is None:
        return None
    scheme = getattr(recipe.groups, linear.group)
    for override in recipe.overrides:
        if _selects(override, layer, layers, linear.name):
            scheme = None if override.keep else (getattr(override, linear.group) or scheme)
    return scheme


def linear_bytes(out: int, inp: int, scheme: GroupScheme | None, param_bytes: int = 2) -> int:
    """Bytes a Linear's weight takes in a compressed-tensors checkpoint (bias excluded).

    With quantized activations the format is int-quantized (one int8 per weight); weight-only schemes
    are pack-quantized (32 values in `bits` int32 words per row, plus the int64[2] original shape).
    Scales are in the model dtype; zero points of asymmetric schemes are int8 or, when packed, int32.
    """
    if scheme is None:
        return out * inp * param_bytes
    weights = scheme.weights
    # `group_size: auto` is the layer's own size; where none divides (the recipe does not apply), the cap.
    group_size = weights.group_size_for(inp) or (weights.group_size.auto if weights.auto_group else weights.group_size)
    groups = {"tensor": 0, "channel": 1, "group": math.ceil(inp / (group_size or 1))}[weights.granularity]
    scales = out * groups if groups else 1
    if scheme.activations is None:  # pack-quantized; zero points packed into int32 along the output dim
        stored = out * math.ceil(inp / 32) * weights.bits * 4 + _WEIGHT_SHAPE_BYTES
        zero_points = math.ceil(out / 32) * weights.bits * 4 * groups if groups else 1
    else:  # int-quantized; int8 zero points beside the scales
        stored, zero_points = out * inp, scales
    activations = scheme.activations
    static_input = 0 if activations is None or activations.dynamic else param_bytes + (0 if activations.symmetric else 1)
    return stored + scales * param_bytes + (0 if weights.symmetric else zero_points) + static_input


def _kept_bytes(group: KeptGroup, out: int, inp: int, param_bytes: int) -> int:
    scheme = GroupScheme(weights=group.weights) if group.quantize and group.weights else None
    return linear_bytes(out, inp, scheme, param_bytes)


def predict_weight_bytes(shape: ModelShape, recipe: Recipe | None) -> WeightBreakdown:
    """Weight bytes of the checkpoint `recipe` would produce (None: the 16-bit model), from the shape alone."""
    pb = shape.param_bytes
    embeddings = recipe.groups.embeddings if recipe else KeptGroup()
    lm_head = recipe.groups.lm_head if recipe else KeptGroup()
    embedding = _kept_bytes(embeddings, shape.vocab, shape.hidden, pb)
    total = embedding + (0 if shape.tied_embeddings else _kept_bytes(lm_head, shape.vocab, shape.hidden, pb))
    total += (2 * shape.layers + 1) * shape.hidden * pb  # RMS norms: two per layer and a final one
    total += shape.layers * shape.experts * shape.hidden * pb  # MoE routers stay 16-bit
    experts = 0
    for layer in range(shape.layers):
        for linear in _decoder_linears(shape, layer):
            scheme = _scheme_for(recipe, layer, shape.layers, linear)
            size = linear.count * (linear_bytes(linear.out, linear.inp, scheme, pb) + (linear.out * pb if linear.bias else 0))
            total += size
            experts += size if linear.expert else 0
    return WeightBreakdown(total_bytes=total, embedding_bytes=embedding, expert_bytes=experts)


def safetensors_bytes(model_dir: Path) -> int:
    """Exact tensor bytes of a checkpoint: the sum of nbytes over every safetensors header, weights unread."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InputError("no *.safetensors files", file=model_dir, field="artifact")
    return sum(_header_bytes(path) for path in files)


def _header_bytes(path: Path) -> int:
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > MAX_SAFETENSORS_HEADER:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(handle.read(length))
        offsets = [entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"]
        return sum(end - start for start, end in offsets)
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, MemoryError, OverflowError, RecursionError, OSError):
        raise InputError("not a readable safetensors header", file=path, field="header") from None


# --- KV cache ----------------------------------------------------------------------------------------


def _kv_layer_bytes_per_token(shape: ModelShape, element_bytes: int) -> int:
    return 2 * shape.kv_heads * shape.head_dim * element_bytes  # K and V


def kv_cache_bytes_per_token(shape: ModelShape, element_bytes: int) -> int:
    """2 x layers x KV heads x head_dim x bytes: one token's K and V in every layer."""
    return shape.layers * _kv_layer_bytes_per_token(shape, element_bytes)


def kv_cache_bytes_for_context(shape: ModelShape, element_bytes: int, context: int) -> int:
    """KV cache one sequence of `context` tokens holds; a sliding-window layer keeps at most its window."""
    tokens = sum(min(context, window) if window else context for window in shape.windows)
    return tokens * _kv_layer_bytes_per_token(shape, element_bytes)


def kv_element_bytes(shape: ModelShape, kv_cache_dtype: str = "auto") -> tuple[str, int]:
    """The KV cache dtype and its bytes: an explicit --kv-cache-dtype, else the config's kv_cache_scheme,
    else the model dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        known = ", ".join(KV_CACHE_DTYPES)
        raise InputError(f"unknown KV cache dtype {kv_cache_dtype!r} (known: {known})", field="kv_cache_dtype")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype, KV_CACHE_DTYPES[kv_cache_dtype]
    if shape.kv_cache_dtype and shape.kv_cache_element_bytes:
        return shape.kv_cache_dtype, shape.kv_cache_element_bytes
    return "auto", shape.param_bytes


def kv_capacity_tokens(
    config: dict | Path,
    kv_space_bytes: int,
    *,
    block_size: int = 16,
    max_model_len: int | None = None,
    kv_cache_dtype: str = "auto",
) -> int:
    """Tokens of KV cache `kv_space_bytes` holds, counted the way vLLM logs "KV cache size: N tokens".

    vLLM cuts the space into blocks of `block_size` tokens across all layers; with `max_model_len` it
    reports (blocks / blocks one max-length request needs) x max_model_len. Exact for full-attention
    models; for sliding-window layers the per-request blocks are approximated by the window.
    """
    shape = model_shape(*load_config(config))
    for field, value in (("kv_space_bytes", kv_space_bytes), ("block_size", block_size), ("max_model_len", max_model_len or 1)):
        if value <= 0:
            raise InputError(f"must be positive (got {value})", field=field)
    _, element = kv_element_bytes(shape, kv_cache_dtype)
    page_per_layer = block_size * _kv_layer_bytes_per_token(shape, element)
    blocks = kv_space_bytes // (page_per_layer * shape.layers)
    if max_model_len is None:
        return blocks * block_size
    per_request = sum(math.ceil(min(max_model_len, w or max_model_len) / block_size) for w in shape.windows)
    return int(blocks * shape.layers / per_request * max_model_len)


# --- the plan ---------------------------------------------------------------------------------------


class RecommendedArgs(_Model):
    # Read back from gate.json, its JSON carries the computed vllm_args too: that key is not an input.
    model_config = ConfigDict(extra="ignore")

    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str | None = None

    @computed_field
    @property
    def vllm_args(self) -> str:
        args = (
            f"--gpu-memory-utilization {self.gpu_memory_utilization:.2f} --max-model-len {self.max_model_len} "
            f"--max-num-seqs {self.max_num_seqs} --max-num-batched-tokens {self.max_num_batched_tokens}"
        )
        return args + (f" --kv-cache-dtype {self.kv_cache_dtype}" if self.kv_cache_dtype else "")


class PlanRow(_Model):
    scheme: str
    does_not_apply: str | None = Field(
        default=None, description="why the recipe cannot quantize this model (the compiler's refusal); then fits is false",
    )
    weights_source: Literal["measured", "predicted"]
    kv_cache_dtype: str
    weights_bytes: int
    kv_cache_bytes_per_token: int
    kv_cache_bytes: int = Field(description="worst case: max_model_len x concurrency, sliding windows honored")
    activation_bytes: int
    overhead_bytes: int
    total_bytes: int
    available_bytes: int
    fits: bool
    max_concurrency: int = Field(description="at max_model_len")
    max_context: int = Field(description="at the given concurrency, capped at the model's max_position_embeddings")
    recommended: RecommendedArgs | None
    decode_tokens_per_s: float | None = Field(description="one stream, bandwidth-bound, at max_model_len")


class Plan(_Model):
    model: str
    config: str
    gpu: GpuSpec
    max_model_len: int
    concurrency: int
    settings: PlanSettings
    rows: list[PlanRow]


class _Scheme(NamedTuple):
    label: str
    weights: WeightBreakdown
    source: Literal["measured", "predicted"]
    kv_dtype: str
    kv_bytes: int
    does_not_apply: str | None = None


class _Memory(NamedTuple):
    weights: int
    kv: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.overhead


def activation_bytes(shape: ModelShape, settings: PlanSettings, max_num_seqs: int) -> int:
    """Peak transient memory of vLLM's profiling run: max_num_batched_tokens tokens through one layer
    (residual + hidden + gate/up + activated: 2 x hidden + 3 x intermediate values per token), plus the
    sampler's float32 logits buffers for max_num_seqs sequences."""
    per_token = 2 * shape.hidden + 3 * shape.active_intermediate
    forward = settings.max_num_batched_tokens * per_token * settings.activation_dtype_bytes
    return forward + settings.logits_buffers * max_num_seqs * shape.vocab * 4


def _memory(shape: ModelShape, scheme: _Scheme, settings: PlanSettings, context: int, concurrency: int) -> _Memory:
    kv = concurrency * kv_cache_bytes_for_context(shape, scheme.kv_bytes, context)
    activations = activation_bytes(shape, settings, concurrency)
    planned = scheme.weights.total_bytes + kv + activations
    overhead = settings.fixed_overhead_bytes + math.ceil(settings.overhead_fraction * planned)
    return _Memory(scheme.weights.total_bytes, kv, activations, overhead)


def _largest(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, limit] with fits(n), for a fits() that turns false and stays false; 0 if none."""
    if limit < 1 or not fits(1):
        return 0
    good, step = 1, 1
    while good + step <= limit and fits(good + step):
        good, step = good + step, step * 2
    bad = min(good + step, limit + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _row(shape: ModelShape, scheme: _Scheme, gpu: GpuSpec, settings: PlanSettings, context: int, concurrency: int) -> PlanRow:
    available = settings.available_bytes(gpu)

    def fits(ctx: int, seqs: int) -> bool:
        return _memory(shape, scheme, settings, ctx, seqs).total <= available

    memory = _memory(shape, scheme, settings, context, concurrency)
    context_limit = shape.max_position or 2**31 - 1
    max_concurrency = _largest(lambda seqs: fits(context, seqs), MAX_CONCURRENCY_SEARCHED)
    max_context = _largest(lambda ctx: fits(ctx, concurrency), context_limit)
    applies = scheme.does_not_apply is None
    return PlanRow(
        scheme=scheme.label,
        does_not_apply=scheme.does_not_apply,
        weights_source=scheme.source,
        kv_cache_dtype=scheme.kv_dtype,
        weights_bytes=memory.weights,
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(shape, scheme.kv_bytes),
        kv_cache_bytes=memory.kv,
        activation_bytes=memory.activations,
        overhead_bytes=memory.overhead,
        total_bytes=memory.total,
        available_bytes=available,
        fits=applies and memory.total <= available,
        max_concurrency=max_concurrency,
        max_context=max_context,
        recommended=_recommend(shape, scheme, gpu, settings, context, concurrency, max_concurrency, fits) if applies else None,
        decode_tokens_per_s=_decode_ceiling(shape, scheme, gpu, context),
    )


def _recommend(
    shape: ModelShape, scheme: _Scheme, gpu: GpuSpec, settings: PlanSettings,
    context: int, concurrency: int, max_concurrency: int, fits: Callable[[int, int], bool],
) -> RecommendedArgs | None:
    """vLLM arguments for the request, or the nearest that fits: fewer sequences first, then a shorter context."""
    if max_concurrency >= 1:
        context, seqs = context, min(concurrency, max_concurrency)
    else:
        longest = _largest(lambda ctx: fits(ctx, 1), context)
        if longest < 1:
            return None
        context, seqs = (longest // 256 * 256 or longest), 1
    needed = math.ceil(_memory(shape, scheme, settings, context, seqs).total / gpu.memory_bytes * 100 - 1e-9) / 100
    utilization = min(settings.max_gpu_memory_utilization, max(settings.min_gpu_memory_utilization, needed))
    return RecommendedArgs(
        gpu_memory_utilization=utilization, max_model_len=context, max_num_seqs=seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_dtype=None if scheme.kv_dtype == "auto" else scheme.kv_dtype,
    )


def _decode_ceiling(shape: ModelShape, scheme: _Scheme, gpu: GpuSpec, context: int) -> float | None:
    """Memory bandwidth / bytes one decode step reads (weights + this stream's KV at `context`)."""
    if gpu.bandwidth_bytes_per_s is None:
        return None
    read = scheme.weights.read_per_token(shape) + kv_cache_bytes_for_context(shape, scheme.kv_bytes, context)
    return round(gpu.bandwidth_bytes_per_s / read, 1)


def _schemes(
    shape: ModelShape, recipes: list[Recipe | None], artifact_dir: Path | None, kv_cache_dtype: str,
) -> list[_Scheme]:
    """One scheme per recipe (None: 16-bit), predicted; an artifact's measured bytes replace the 16-bit
    row when the artifact is unquantized, otherwise the artifact gets its own row."""
    kv_dtype, kv_bytes = kv_element_bytes(shape, kv_cache_dtype)
    schemes = [
        _Scheme(
            recipe.name if recipe else SIXTEEN_BIT, predict_weight_bytes(shape, recipe), "predicted", kv_dtype, kv_bytes,
            recipe_problem(shape, recipe) if recipe else None,
        )
        for recipe in recipes
    ]
    if artifact_dir is None:
        return schemes
    artifact_shape = model_shape(*load_config(artifact_dir)) if (Path(artifact_dir) / "config.json").is_file() else shape
    predicted = predict_weight_bytes(shape, None)
    measured = predicted.model_copy(update={"total_bytes": safetensors_bytes(Path(artifact_dir))})
    kv_dtype, kv_bytes = kv_element_bytes(artifact_shape, kv_cache_dtype)
    label = Path(artifact_dir).name if artifact_shape.quantized else SIXTEEN_BIT
    row = _Scheme(label, measured, "measured", kv_dtype, kv_bytes)
    if label == SIXTEEN_BIT and any(s.label == SIXTEEN_BIT for s in schemes):
        return [row if s.label == SIXTEEN_BIT else s for s in schemes]
    return schemes + [row]


def shape_layout(shape: ModelShape) -> ModelLayout:
    """The compiler's view of the model, built from the shape alone (no torch): the Linear layers the
    planner counts, named as Llama-style checkpoints name them; MoE experts count once per layer."""
    linears = [
        LinearInfo(name=linear.name, in_features=linear.inp, out_features=linear.out, kind=linear.group, layer=layer)
        for layer in range(shape.layers)
        for linear in _decoder_linears(shape, layer)
    ]
    lm_head = LinearInfo(name="lm_head", in_features=shape.hidden, out_features=shape.vocab)
    return ModelLayout(
        architecture=shape.name, num_layers=shape.layers, linears=linears, embeddings=["model.embed_tokens"],
        lm_head="lm_head", lm_head_linear=lm_head,
    )


def recipe_problem(shape: ModelShape, recipe: Recipe) -> str | None:
    """Why `recipe` cannot quantize this model (the compiler's own checks: group sizes, vLLM's kernel
    shapes, fused shards, overrides that select nothing), or None when it applies."""
    return cannot_apply(recipe, shape_layout(shape), f"recipe {recipe.name}")


def plan(
    config: dict | Path,
    recipes: list[Recipe | None],
    gpu: GpuSpec,
    max_model_len: int,
    concurrency: int,
    artifact_dir: Path | None = None,
    *,
    settings: PlanSettings | None = None,
    kv_cache_dtype: str = "auto",
) -> Plan:
    """The memory plan: one row per recipe (None for 16-bit), plus the artifact's measured row if given."""
    settings = settings or PlanSettings()
    data, source = load_config(config)
    shape = model_shape(data, source)
    _check_sizes(shape, max_model_len, concurrency, source)
    if not recipes and artifact_dir is None:
        raise InputError("nothing to plan: give a recipe, None for 16-bit, or an artifact", field="recipes")
    rows = [
        _row(shape, scheme, gpu, settings, max_model_len, concurrency)
        for scheme in _schemes(shape, recipes, artifact_dir, kv_cache_dtype)
    ]
    return Plan(
        model=shape.name, config=source, gpu=gpu, max_model_len=max_model_len,
        concurrency=concurrency, settings=settings, rows=rows,
    )


def _check_sizes(shape: ModelShape, max_model_len: int, concurrency: int, source: str) -> None:
    for field, value, most in (("max_model_len", max_model_len, MAX_CONTEXT), ("concurrency", concurrency, MAX_CONCURRENCY)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"must be a positive integer (got {value!r})", field=field)
        if value > most:
            raise InputError(f"must be at most {most} (got {value})", field=field)
    if shape.max_position is not None and max_model_len > shape.max_position:
        raise InputError(
            f"{max_model_len} is longer than the model's max_position_embeddings ({shape.max_position}) in {source}",
            field="max_model_len",
        )


def check_fit(
    config: dict | Path,
    recipe: Recipe | None,
    gpu: GpuSpec,
    max_model_len: int,
    concurrency: int,
    artifact_dir: Path | None = None,
    *,
    settings: PlanSettings | None = None,
    kv_cache_dtype: str = "auto",
) -> FitCheck:
    """Does this recipe's model (the artifact's measured files when given) fit `gpu`, for the gate."""
    result = plan(
        config, [recipe], gpu, max_model_len, concurrency, artifact_dir, settings=settings, kv_cache_dtype=kv_cache_dtype,
    )
    return fit_of(result)


def fit_of(result: Plan) -> FitCheck:
    """The fit the gate checks: the artifact's measured row when the plan has one, else its first row."""
    row = next((r for r in result.rows if r.weights_source == "measured"), result.rows[0])
    return FitCheck(fits=row.fits, required_bytes=row.total_bytes, available_bytes=row.available_bytes, gpu=result.gpu.name)
