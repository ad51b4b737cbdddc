"""The served spec of a registry version (pipelines/deploy/spec.py): the signed bundle, the measured arguments with their
evidence, the envelope; refusals of what cannot be deployed. The gate run is the product's own with vLLM, lm-eval and vLLM
bench serve faked (tests/unit/test_loadtest_runner.py), so the version carries a real gate.json with a load test."""

from __future__ import annotations

import pytest
from test_loadtest_runner import gate, servers, tool  # noqa: F401 (fixtures)

from pipelines.deploy.limits import limits
from pipelines.deploy.spec import served_spec
from pipelines.errors import InputError
from pipelines.registry.store import Registry
from pipelines.serve.vllm_series import FIRST_LATENCY_BUCKET_S


def promoted_spec(workspace, reference: str = "demo-llama@production"):
    outcome = gate(workspace)
    assert outcome.verdict == "promoted"
    registry = Registry(workspace.registry)
    version = registry.list("demo-llama")[-1]
    registry.set_alias("demo-llama", "production", version.version)
    return served_spec(reference, registry=registry), version


def test_the_spec_serves_the_signed_bundle_with_the_measured_arguments(tool, servers, workspace):
    spec, version = promoted_spec(workspace)
    assert spec.signed and spec.folder.name == f"v{version.version}" and (spec.folder / "model.sig").is_file()
    assert spec.served_name == "demo-llama" and spec.alias == "production" and spec.version == version.version
    tuning = version.gate.performance.tuning
    assert spec.args.max_num_seqs == tuning.measured_max_num_seqs == 16
    assert spec.args.max_model_len == 512 and spec.args.cpu_kv_cache_gib == 1 and spec.args.dtype == "bfloat16"
    assert "measured" in spec.args.sources["max_num_seqs"]
    assert spec.args.environment() == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_COMPUTE_NANS_IN_LOGITS": "1"}
    cli = spec.args.cli_args()
    assert cli[:4] == ["--dtype", "bfloat16", "--max-model-len", "512"] and cli[cli.index("--max-num-seqs") + 1] == "16"
    envelope = spec.require_envelope()
    candidate = version.gate.performance.figures("candidate").at(16)
    assert envelope.concurrency == 16 and envelope.level == candidate and envelope.figures.kv_capacity_tokens == 524_288
    ttft = next(limit for limit in limits(envelope) if limit.figure == "ttft_p95_s")
    assert ttft.limit == pytest.approx(max(min(2.0, candidate.ttft_ms.p95 * 1.5 / 1000), FIRST_LATENCY_BUCKET_S["ttft"]))
    settings = spec.args.serve_settings()
    assert (settings.max_num_seqs, settings.max_model_len, settings.cpu_kv_cache_gib) == (16, 512, 1)


def test_a_version_without_a_load_test_has_no_envelope_and_is_named(tool, servers, workspace):
    outcome = gate(workspace, loadtest=False)
    assert outcome.verdict == "promoted"
    spec = served_spec("demo-llama", registry=Registry(workspace.registry))
    assert spec.envelope is None and "not measured" in spec.notes[0]
    with pytest.raises(InputError, match=r"promoted without a load test"):
        spec.require_envelope()


@pytest.mark.parametrize("reference, message", [
    ("demo-llama@staging", "has no alias 'staging'"), ("nobody@production", "unknown model 'nobody'"),
    ("@production", "not NAME"), ("demo-llama@", "not a version number or an alias"), ("demo-llama@99", "has no version 99"),
])
def test_bad_references_are_named(tool, servers, workspace, reference, message):
    promoted_spec(workspace)
    with pytest.raises(InputError, match=message):
        served_spec(reference, registry=Registry(workspace.registry))


def test_a_tampered_bundle_is_not_deployed(tool, servers, workspace):
    spec, _ = promoted_spec(workspace)
    weights = spec.folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(InputError, match="differs from what was signed"):
        served_spec("demo-llama@production", registry=Registry(workspace.registry))
