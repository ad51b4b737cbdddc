"""The quantize step for real: llm-compressor on the demo model (or the tiny random Llama).

Artifacts go to the session's temporary artifacts root, never to the repository's artifacts/. That vLLM
loads and answers each shipped recipe's artifact is shown by the registry job, which serves and scores
all four (test_registry_job.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import INT4_WEIGHT_ONLY
from safetensors import safe_open

from pipelines.artifact import MANIFEST_NAME, artifact_file_hashes
from pipelines.errors import InputError
from pipelines.hardware.targets import parse_target
from pipelines.paths import EVAL_SETS_DIR, RECIPES_DIR
from pipelines.quantize.calibration import calibration_dataset, load_calibration_texts
from pipelines.quantize.oneshot import QuantizeResult, quantize_model

pytestmark = pytest.mark.integration

SHIPPED = ("w8a8", "w4a16", "gptq", "aggressive", "aggressive-w4a8")
WEIGHT_ONLY_INT4 = ("w4a16", "gptq", "aggressive")  # recipes vLLM's AVX2 library has no kernel for
ATTENTION, MLP = r"re:.*self_attn\.(q|k|v|o)_proj$", r"re:.*mlp\.(gate|up|down)_proj$"


@pytest.fixture(scope="module")
def recipes(tmp_path_factory: pytest.TempPathFactory, calibration_set_dir: Path) -> dict[str, str]:
    """Shipped recipes; when eval_sets/calibration does not exist yet, copies pointing at test calibration data."""
    if (EVAL_SETS_DIR / "calibration").is_dir():
        return {name: name for name in SHIPPED}
    folder = tmp_path_factory.mktemp("recipes")
    out = {}
    for name in SHIPPED:
        text = (RECIPES_DIR / f"{name}.yaml").read_text().replace("dataset: calibration", f"dataset: {calibration_set_dir}")
        (folder / f"{name}.yaml").write_text(text)
        out[name] = str(folder / f"{name}.yaml")
    return out


@pytest.fixture(scope="module")
def artifacts(workspace, recipes: dict[str, str], demo_or_tiny_model: Path):
    """quantize_model once per recipe, in the session's artifacts root: the CLI runs and the job reuse them."""
    root = workspace.artifacts
    done: dict[str, QuantizeResult] = {}

    def get(name: str) -> QuantizeResult:
        if name not in done:
            # for this host when it serves the recipe; else for one that does (AVX-512 with BF16: `cpu`)
            target = None if INT4_WEIGHT_ONLY or name not in WEIGHT_ONLY_INT4 else parse_target("cpu")
            done[name] = quantize_model(recipes[name], demo_or_tiny_model, artifacts_root=root, target=target)
        return done[name]

    return get


def quantization_config(artifact: Path) -> dict:
    return json.loads((artifact / "config.json").read_text())["quantization_config"]


def group_for(config: dict, target: str) -> dict:
    (group,) = [g for g in config["config_groups"].values() if target in g["targets"]]
    return group


def tensors(artifact: Path) -> dict:
    out = {}
    for path in sorted(artifact.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118 (a safetensors handle)
    return out


def assert_16_bit_embeddings_and_lm_head(artifact: Path) -> None:
    weights = tensors(artifact)
    import torch

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert weights[name].dtype == torch.bfloat16, name
    assert not any(name.startswith(("lm_head.", "model.embed_tokens.")) and name.endswith(("_scale", "_packed")) for name in weights)
    assert "lm_head" in quantization_config(artifact)["ignore"]


def test_w8a8_artifact_has_dynamic_attention_and_static_mlp(artifacts) -> None:
    result = artifacts("w8a8")
    config = quantization_config(result.artifact_dir)
    attention, mlp = group_for(config, ATTENTION), group_for(config, MLP)
    for group in (attention, mlp):
        assert (group["weights"]["num_bits"], group["weights"]["strategy"], group["weights"]["symmetric"]) == (8, "channel", True)
        assert group["input_activations"]["num_bits"] == 8
    assert (attention["input_activations"]["strategy"], attention["input_activations"]["dynamic"]) == ("token", True)
    assert (mlp["input_activations"]["strategy"], mlp["input_activations"]["dynamic"]) == ("tensor", False)
    weights = tensors(result.artifact_dir)
    assert "model.layers.0.mlp.up_proj.input_scale" in weights  # static: calibrated scale stored
    assert "model.layers.0.self_attn.q_proj.input_scale" not in weights  # dynamic: computed per token at run time
    assert_16_bit_embeddings_and_lm_head(result.artifact_dir)


@pytest.mark.parametrize(("name", "strategy", "group_size"), [("w4a16", "group", 128), ("gptq", "group", 128), ("aggressive", "channel", None)])
def test_4_bit_artifacts(artifacts, name: str, strategy: str, group_size: int | None) -> None:
    result = artifacts(name)
    config = quantization_config(result.artifact_dir)
    assert config["format"] == "pack-quantized"
    for target in (ATTENTION, MLP):
        group = group_for(config, target)
        assert (group["weights"]["num_bits"], group["weights"]["strategy"], group["weights"]["group_size"]) == (4, strategy, group_size)
        assert group["input_activations"] is None
    weights = tensors(result.artifact_dir)
    assert not any(name.endswith("g_idx") for name in weights)  # vLLM CPU's 4-bit kernel has no g_idx
    assert_16_bit_embeddings_and_lm_head(result.artifact_dir)


def test_the_w4a8_control_keeps_the_int4_weights_and_adds_dynamic_int8_activations(artifacts) -> None:
    config = quantization_config(artifacts("aggressive-w4a8").artifact_dir)
    assert config["format"] == "int-quantized"  # int4 codes one per int8: vLLM's W4A8 kernel reads them so
    for target in (ATTENTION, MLP):
        group = group_for(config, target)
        assert (group["weights"]["num_bits"], group["weights"]["strategy"]) == (4, "channel")
        activations = group["input_activations"]
        assert (activations["num_bits"], activations["strategy"], activations["dynamic"]) == (8, "token", True)
    assert_16_bit_embeddings_and_lm_head(artifacts("aggressive-w4a8").artifact_dir)


@pytest.mark.parametrize("name", SHIPPED)
def test_manifest_describes_the_artifact(artifacts, name: str) -> None:
    result = artifacts(name)
    manifest = result.manifest
    assert json.loads((result.artifact_dir / MANIFEST_NAME).read_text()) == manifest.model_dump(mode="json")
    assert manifest.artifact_files == artifact_file_hashes(result.artifact_dir)
    assert "model.safetensors" in manifest.artifact_files and MANIFEST_NAME not in manifest.artifact_files
    assert result.artifact_dir.name == f"{name}-{manifest.input_key[:12]}"
    assert 0.2 < manifest.weight_bytes.ratio < 0.7 and manifest.weight_bytes.before > manifest.weight_bytes.after
    assert manifest.host is not None and manifest.serve_target is not None
    assert manifest.layers["lm_head"] == "16-bit"
    assert set(manifest.versions) == {"torch", "transformers", "llmcompressor", "compressed-tensors"}
    assert manifest.compute.startswith(("cpu: ", "cuda: "))
    assert manifest.peak_memory.bytes > 0 and manifest.stages["quantize_s"] > 0
    assert (manifest.calibration is not None) == (name in ("w8a8", "gptq"))


def test_existing_artifact_is_reused_and_a_rerun_is_bit_identical(artifacts, recipes, demo_or_tiny_model: Path, tmp_path: Path) -> None:
    first = artifacts("w8a8")
    again = quantize_model(recipes["w8a8"], demo_or_tiny_model, artifacts_root=first.artifact_dir.parents[2])
    assert again.reused and again.artifact_dir == first.artifact_dir and again.manifest == first.manifest
    rerun = quantize_model(recipes["w8a8"], demo_or_tiny_model, artifacts_root=tmp_path, force=True)
    assert not rerun.reused
    assert rerun.manifest.compute == first.manifest.compute, "bit-identical holds on the same device and thread count"
    assert rerun.artifact_dir.name == first.artifact_dir.name
    assert rerun.manifest.artifact_files == first.manifest.artifact_files


def test_plain_oneshot_on_the_compiled_recipe_gives_the_same_weights(artifacts, demo_or_tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    result = artifacts("gptq")
    calibration = result.manifest.calibration
    texts = load_calibration_texts(calibration.dataset, calibration.num_samples, calibration.seed)
    dataset = calibration_dataset(AutoTokenizer.from_pretrained(demo_or_tiny_model), texts, calibration.max_seq_length)
    torch.manual_seed(calibration.seed)
    oneshot(
        model=str(demo_or_tiny_model), recipe=result.manifest.compiled_recipe, dataset=dataset,
        num_calibration_samples=len(dataset), shuffle_calibration_samples=False,
        max_seq_length=calibration.max_seq_length, output_dir=str(tmp_path / "direct"),
    )
    ours, theirs = tensors(result.artifact_dir), tensors(tmp_path / "direct")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def _copy_model(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize(
    ("damage", "file", "field"),
    [
        (lambda m: (m / "config.json").unlink(), "config.json", "model"),
        (lambda m: (m / "config.json").write_text("{"), "config.json", "line 1"),
        (lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:-100]), "model.safetensors", "safetensors"),
        (lambda m: (m / "model.safetensors").write_bytes(b"\xff" * 16), "model.safetensors", "safetensors"),
    ],
)
def test_bad_model_folders_fail_before_any_work(tiny_llama_dir: Path, tmp_path: Path, damage, file: str, field: str) -> None:
    model = _copy_model(tiny_llama_dir, tmp_path)
    damage(model)
    with pytest.raises(InputError) as caught:
        quantize_model("w4a16", model, artifacts_root=tmp_path / "artifacts", target=parse_target("cpu"))
    assert caught.value.file == str(model / file) and caught.value.field == field
    assert not (tmp_path / "artifacts").exists()


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="model folder does not exist"):
        quantize_model("w4a16", tmp_path / "absent", artifacts_root=tmp_path / "artifacts", target=parse_target("cpu"))


def test_a_failure_mid_quantization_leaves_nothing(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(inputs, out_dir: Path) -> float:
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("oneshot died")

    monkeypatch.setattr("pipelines.quantize.oneshot.run_oneshot", crash)
    (tmp_path / "artifacts").mkdir()
    with pytest.raises(RuntimeError, match="oneshot died"):
        quantize_model("w4a16", tiny_llama_dir, artifacts_root=tmp_path / "artifacts", target=parse_target("cpu"))
    assert list((tmp_path / "artifacts").iterdir()) == []


def test_a_recipe_mixing_rtn_and_gptq_quantizes_in_one_run_and_vllm_serves_it(demo_or_tiny_model: Path, calibration_set_dir: Path,
                                                                               tmp_path: Path) -> None:
    """The repair's proposals mix algorithms by module (RTN groups, GPTQ overrides): one llm-compressor run with a
    QuantizationModifier and a GPTQModifier, and the artifact loads and answers in vLLM (tests/unit/quantize/test_mixed_algorithms.py
    checks the weights themselves)."""
    from vllm_util import complete

    from pipelines.serve.serving import vllm_server

    # int4 weight-only where vLLM has the kernel; int8 W8A8 on AVX2 hosts (no 4-bit weight-only kernel there)
    scheme = "weights: {bits: 4, granularity: group, group_size: 32, symmetric: true}" if INT4_WEIGHT_ONLY else \
        "weights: {bits: 8, granularity: channel, symmetric: true}, activations: {bits: 8, granularity: token, dynamic: true}"
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text(
        f"name: mixed\nalgorithm: {{method: rtn}}\ncalibration: {{dataset: {calibration_set_dir / 'data.jsonl'}, num_samples: 8, "
        f"max_seq_length: 64, seed: 0}}\ngroups:\n  attention: {{{scheme}}}\n  mlp: {{{scheme}}}\n"
        f"overrides:\n  - layers: [0]\n    attention: {{{scheme}, algorithm: gptq}}\n    mlp: {{{scheme}, algorithm: gptq}}\n"
    )
    result = quantize_model(str(recipe), demo_or_tiny_model, artifacts_root=tmp_path / "artifacts")
    manifest = json.loads((result.artifact_dir / MANIFEST_NAME).read_text())
    assert "GPTQModifier" in manifest["compiled_recipe"] and "QuantizationModifier" in manifest["compiled_recipe"]
    with vllm_server(result.artifact_dir, log_path=tmp_path / "server.log", served_name="mixed") as server:
        answer = complete(server, "Ticket 7: order", max_tokens=4)
    assert answer["usage"]["completion_tokens"] >= 1 and answer["choices"][0]["finish_reason"] in ("length", "stop")
