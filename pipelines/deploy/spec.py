"""A served spec: what serving one promoted, verified registry version takes, from its own evidence.

`served_spec("demo-llama@production")` resolves the reference in the registry, verifies the version (its artifact
against the manifest, its signed promotion bundle: signature, every file, evidence; pipelines.registry) and reads its
gate.json once:

- the folder to serve: the signed bundle (artifact + evidence + model.sig), which vLLM serves unchanged;
- the served model name (the model's name unless told otherwise: an alias moved back by a rollback keeps it);
- the vLLM arguments the version was measured with: --max-num-seqs from the load test's measured tuning
  (`performance.tuning.measured_max_num_seqs`), --max-model-len and the KV space from the servers the load test ran
  (`inputs.serve`: VLLM_CPU_KVCACHE_SPACE on a CPU, --gpu-memory-utilization re-planned by the planner on a GPU), and
  --dtype as this host serves (ServeSettings.served_dtype); each with the evidence it came from (`ServeArgs.sources`);
- the envelope (pipelines/deploy/envelope.py): the load test's own figures for the version at the deployed concurrency
  (TTFT / ITL / TPOT percentiles, throughput, failures, KV capacity, memory watermark) and the policy's SLOs, from which
  the limits `quantize watch` and the deployed alert rules hold production to are derived (pipelines/deploy/limits.py).
  A version promoted without a load test has no envelope (`ServedSpec.require_envelope` names it).

Used by `quantize deploy`, `quantize watch` and `quantize serve` (pipelines/fleet). Nothing here starts a process.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from pydantic import Field

from pipelines.deploy.envelope import Envelope, envelope_of
from pipelines.errors import InputError
from pipelines.hardware.targets import installed_target
from pipelines.loadtest.results import PerformanceReport
from pipelines.registry.reference import split_reference
from pipelines.registry.regates import require_gated_runtime
from pipelines.registry.store import Registry, Version, verify_version
from pipelines.schema import FrozenModel
from pipelines.serve.serving import MONITORING_ENVIRONMENT, ServeSettings


class ServeArgs(FrozenModel):
    """The vLLM arguments to serve a version with, and where each came from."""

    max_model_len: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    dtype: str
    enforce_eager: bool
    # On CPU, --gpu-memory-utilization is the share of host memory vLLM may take and the KV space is VLLM_CPU_KVCACHE_SPACE.
    gpu_memory_utilization: float = Field(gt=0, le=1)
    cpu_kv_cache_gib: int | None = Field(default=None, ge=1, description="VLLM_CPU_KVCACHE_SPACE on a CPU target; None on a GPU")
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    sources: dict[str, str] = Field(default_factory=dict, description="argument -> the evidence it came from")

    def serve_settings(self) -> ServeSettings:
        """The product's own server settings (pipelines.serve.serving.vllm_server) for these arguments."""
        return ServeSettings(
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs, dtype=self.dtype,
            enforce_eager=self.enforce_eager, memory_fraction=self.gpu_memory_utilization,
            cpu_kv_cache_gib=self.cpu_kv_cache_gib or ServeSettings().cpu_kv_cache_gib,
        )

    def cli_args(self) -> list[str]:
        """vLLM's command-line arguments (the KV space on a CPU is an environment variable: `environment`)."""
        batched = ["--max-num-batched-tokens", str(self.max_num_batched_tokens)] if self.max_num_batched_tokens is not None else []
        return self.serve_settings().vllm_args() + batched

    def described(self) -> list[tuple[str, str, str]]:
        """(argument, value, where it came from) for each argument with a recorded source."""
        return [(key, str(getattr(self, key)), source) for key, source in self.sources.items()]

    def environment(self) -> dict[str, str]:
        """vLLM's environment variables: the KV space on a CPU, the NaN check the alert rules read (MONITORING_ENVIRONMENT)."""
        kv = {"VLLM_CPU_KVCACHE_SPACE": str(self.cpu_kv_cache_gib)} if self.cpu_kv_cache_gib is not None else {}
        return {**kv, **MONITORING_ENVIRONMENT}


class ServedSpec(FrozenModel):
    """A registry version as it is served: the folder, the name, the measured arguments and the envelope."""

    reference: str = Field(description="as the user named it: NAME@ALIAS or NAME@VERSION")
    model: str
    version: int
    alias: str | None
    recipe: str
    folder: Path = Field(description="the signed promotion bundle (or, for a version promoted before signing, its artifact)")
    signed: bool
    served_name: str
    target: str = Field(description="the serve target of this host, which the arguments are for")
    args: ServeArgs
    envelope: Envelope | None
    notes: list[str] = Field(default_factory=list)

    def require_envelope(self) -> Envelope:
        if self.envelope is None:
            raise InputError(
                f"{self.model} v{self.version} was promoted without a load test, so it has no envelope to hold production "
                "to (gate.json has no `performance`); re-run its gate with the load test on", field="performance",
            )
        return self.envelope


def served_spec(reference: str, *, registry: Registry | None = None, served_name: str | None = None,
                require_signature: bool = True, check_runtime: bool = True) -> ServedSpec:
    """The served spec of `reference` (NAME, NAME@VERSION or NAME@ALIAS; NAME alone: its newest promoted version),
    after verifying it. `require_signature=False` accepts a version promoted before signing (its artifact verified).
    `check_runtime`: refuse a runtime here the version was not gated or re-gated on (pipelines.registry.regates); False
    when the server is not on this machine."""
    model, wanted = split_reference(reference, field="NAME@ALIAS")
    registry = registry or Registry()
    version = registry.show(model, wanted) if wanted is not None else newest_promoted(registry, model)
    if version.status != "promoted":
        raise InputError(f"{model} v{version.version} is {version.status}; only a promoted version is deployed", file=registry.path,
                         field="status")
    verify_version(version)
    check = registry.verify_signature(version, required=require_signature)
    folder = check.bundle if check is not None else Path(version.artifact_path)
    # The runtime here against the ones the version was gated on (a bundle is needed: it holds the gated runtime).
    runtime_notes = require_gated_runtime(registry, version, check.bundle) if check is not None and check_runtime else []
    spec = spec_of(version, reference=reference, alias=wanted if isinstance(wanted, str) else None, folder=folder,
                   signed=check is not None, served_name=served_name)
    return spec.model_copy(update={"notes": spec.notes + runtime_notes})


def newest_promoted(registry: Registry, model: str) -> Version:
    promoted = [v for v in registry.list(model) if v.status == "promoted"]
    if not promoted:
        raise InputError(f"model {model!r} has no promoted version", file=registry.path, field="NAME")
    return promoted[-1]


def spec_of(version: Version, *, reference: str, alias: str | None, folder: Path, signed: bool, served_name: str | None) -> ServedSpec:
    """The spec of an already verified version (no file is read)."""
    gate = version.gate
    if gate is None:
        raise InputError(f"{version.model} v{version.version} has no gate evidence this quantgate reads", file=version.gate_path,
                         field="gate")
    target = str(installed_target())
    serve = ServeSettings.as_recorded(gate.inputs.get("serve"), version.gate_path or "gate.json")
    performance = gate.performance
    args, notes = _measured_args(serve, performance, target)
    return ServedSpec(
        reference=reference, model=version.model, version=version.version, alias=alias, recipe=version.recipe_name, folder=folder,
        signed=signed, served_name=served_name or version.model, target=target, args=args,
        envelope=envelope_of(performance, args.max_num_seqs, version.gate_path) if performance is not None else None,
        notes=notes + _host_notes(performance, target),
    )


def _measured_args(serve: ServeSettings, performance: PerformanceReport | None, target: str) -> tuple[ServeArgs, list[str]]:
    tuning = performance.tuning if performance is not None else None
    on_cpu = target.split(":")[0] == "cpu"
    sources = {"max_model_len": "the load test's servers (gate.json inputs.serve.max_model_len)",
               "dtype": f"what {target} serves (ServeSettings.served_dtype)"}
    notes = []
    max_num_seqs = tuning.measured_max_num_seqs if tuning is not None else None
    if max_num_seqs is not None:
        sources["max_num_seqs"] = f"measured: the largest swept concurrency that met the SLOs on {performance.target}"  # type: ignore[union-attr]
    else:
        max_num_seqs = serve.max_num_seqs
        sources["max_num_seqs"] = "the gate's servers (gate.json inputs.serve.max_num_seqs): no load-test level met the SLOs" \
            if tuning is not None else "the gate's servers (gate.json inputs.serve.max_num_seqs): no load test"
        notes.append(f"max_num_seqs {max_num_seqs} was not measured to meet the SLOs")
    utilization, batched = serve.memory_fraction, None
    if on_cpu:
        sources["gpu_memory_utilization"] = "the load test's servers (inputs.serve.memory_fraction: on a CPU, the share of host memory)"
        sources["cpu_kv_cache_gib"] = "the load test's servers (inputs.serve.cpu_kv_cache_gib, VLLM_CPU_KVCACHE_SPACE)"
    elif tuning is not None and tuning.gpu_memory_utilization is not None:
        utilization = tuning.gpu_memory_utilization
        sources["gpu_memory_utilization"] = f"performance.tuning: {tuning.basis}"
        batched = _batched_tokens(tuning.vllm_args)
    else:
        sources["gpu_memory_utilization"] = "the gate's servers (inputs.serve.memory_fraction)"
    args = ServeArgs(
        max_model_len=serve.max_model_len, max_num_seqs=max_num_seqs, dtype=serve.model_copy(update={"dtype": "host"}).served_dtype(),
        enforce_eager=serve.enforce_eager, gpu_memory_utilization=utilization,
        cpu_kv_cache_gib=serve.cpu_kv_cache_gib if on_cpu else None, max_num_batched_tokens=batched, sources=sources,
    )
    return args, notes


def _batched_tokens(vllm_args: str | None) -> int | None:
    words = (vllm_args or "").split()
    for flag, value in itertools.pairwise(words):
        if flag == "--max-num-batched-tokens" and value.isdigit():
            return int(value)
    return None


def _host_notes(performance: PerformanceReport | None, target: str) -> list[str]:
    if performance is None or performance.target == target:
        return []
    return [f"the load test ran on {performance.target} and this host is {target}: its figures say little about this host; "
            "re-run the load test here for an envelope to hold production to"]
