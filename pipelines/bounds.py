"""Input bounds shared by every module that reads a size from a user: config.json, a policy, a plan, a job.

Far beyond any real deployment, small enough that a plan stays a fraction of a second (the weight count
loops over layers) and no product of them overflows a float or a C integer. One home, low in the import
graph: the compiler, the planner, the policy and the commands all import these, never copies of them.
"""

from __future__ import annotations

import math
from typing import Any

from pipelines.errors import InputError

KiB, MiB, GiB = 2**10, 2**20, 2**30
MAX_CONTEXT = 2**24  # tokens: 16.8 M (the largest published context is about 10 M)
MAX_CONCURRENCY = 1_000_000  # sequences at once: also the largest concurrency the planner searches
MAX_GPU_MEMORY_GIB = 2**20  # 1 PiB on one device
MAX_GPU_BANDWIDTH_GBS = 10**6  # 1 PB/s

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


def bounded_size(key: str, value: Any, source: str, *, low: int = 1) -> int:
    """A config size: an integer from `low` to its CONFIG_BOUNDS entry, else an InputError naming the key."""
    most = CONFIG_BOUNDS.get(key, 2**31 - 1)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= most:
        raise InputError(f"needs an integer from {low} to {most} (got {value!r})", file=source, field=key)
    return value


def check_config_bounds(config: dict, source: str = "config.json") -> None:
    """What any reader of a config.json checks before building from it (even a meta-device model, whose
    construction loops over the layers): every size named in CONFIG_BOUNDS that is given, here or in
    `text_config`, is an integer of at most its bound, and no number anywhere is NaN or infinite.

    Lenient on purpose (a size may be absent, null or 0): the planner's model_shape checks what it needs."""
    _check_finite_json(config, source, "")
    nested = config.get("text_config")
    for cfg in (config, nested if isinstance(nested, dict) else {}):
        for key in CONFIG_BOUNDS:
            value = cfg.get(key)
            if value is None or isinstance(value, bool):
                continue
            bounded_size(key, value, source, low=0)

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

