"""Quantize backends: each recipe compiled into GPTQModel's and bitsandbytes' own configuration or refused naming the
field; the backend tool's contract (imports nothing of ours; stage lines; a death reported by its cause and log)."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.errors import InputError, QuantizeError
from pipelines.hardware.targets import parse_target
from pipelines.quantize.backends import process as backend_process
from pipelines.quantize.backends.compile import compile_for_backend
from pipelines.quantize.backends.environment import backend_process_env, ensure_environment, pinned_versions
from pipelines.quantize.backends.specs import BACKENDS, BackendPlan
from pipelines.quantize.compiler import compile_recipe
from pipelines.quantize.layout import ModelLayout, layout_from_config
from pipelines.recipe import load_recipe, parse_recipe, with_backend

FILE = "recipes/t.yaml"
CALIBRATION = {"dataset": "calibration", "num_samples": 8, "max_seq_length": 64, "seed": 0}
W4_GPTQ = {"weights": {"bits": 4, "granularity": "group", "group_size": 128}}


@pytest.fixture(scope="module")
def layout(tiny_llama_config: dict) -> ModelLayout:
    return layout_from_config(tiny_llama_config)


def backend_plan(data: dict, layout: ModelLayout, target: str = "cpu:avx512bf16") -> BackendPlan:
    recipe = parse_recipe(yaml.safe_dump(data), FILE)
    return compile_for_backend(recipe, compile_recipe(recipe, layout, FILE, parse_target(target)).plan, FILE)


def refusal(data: dict, layout: ModelLayout, target: str = "cpu:avx512bf16") -> InputError:
    with pytest.raises(InputError) as caught:
        backend_plan(data, layout, target)
    assert caught.value.file == FILE and "cannot express" in caught.value.message
    return caught.value


def gptq(**top) -> dict:
    return {"name": "t", "backend": "gptqmodel", "algorithm": {"method": "gptq", "actorder": "weight"}, "calibration": CALIBRATION,
            "groups": {"attention": W4_GPTQ, "mlp": W4_GPTQ}, **top}


def test_a_gptq_recipe_becomes_one_gptqmodel_config_with_its_settings(layout: ModelLayout) -> None:
    plan = backend_plan(gptq(), layout)
    assert plan.config == {"bits": 4, "group_size": 128, "sym": True, "desc_act": False, "act_group_aware": True,
                           "damp_percent": 0.01, "dynamic": None, "offload_to_disk": False}


@pytest.mark.parametrize(("actorder", "aware"), [("weight", True), ("static", True), (None, False)])
def test_actorder_static_is_weight_as_in_the_recipe_vocabulary(layout: ModelLayout, actorder: str | None, aware: bool) -> None:
    """compressed-tensors (and so the llm-compressor backend) reads 'static' as an alias of 'weight': no g_idx either way."""
    algorithm = {"method": "gptq", **({"actorder": actorder} if actorder else {})}
    config = backend_plan(gptq(algorithm=algorithm), layout).config
    assert config["act_group_aware"] is aware and config["desc_act"] is False


def test_the_shipped_gptq_recipe_compiles_for_gptqmodel_with_its_auto_group_sizes(layout: ModelLayout) -> None:
    loaded = with_backend(load_recipe("gptq"), "gptqmodel")
    plan = compile_for_backend(loaded.recipe, compile_recipe(loaded.recipe, layout, loaded.path).plan, loaded.path)
    sizes = {info.in_features for info in layout.linears}
    expected = {size: max(g for g in (2 ** k for k in range(1, 8)) if size % g == 0) for size in sizes}
    groups = {plan.config["group_size"], *(entry["group_size"] for entry in (plan.config["dynamic"] or {}).values())}
    assert groups == set(expected.values())


def dynamic_override(dynamic: dict, layer_name: str) -> dict | bool | None:
    """How both GPTQModel and vLLM read `dynamic` (vllm gptq_utils.get_dynamic_override): the first pattern that
    re.match-es the module's name; `-:` False (left 16-bit), `+:` its settings, None: the base scheme."""
    for pattern, settings in dynamic.items():
        if re.match(pattern[2:] if pattern[:2] in ("-:", "+:") else pattern, layer_name):
            return False if pattern.startswith("-:") else settings
    return None


def test_kept_and_differing_modules_become_gptqmodel_dynamic_overrides(layout: ModelLayout) -> None:
    overrides = [{"layers": [0], "keep": True}, {"layers": [1], "mlp": {"weights": {"bits": 4, "granularity": "channel"}}}]
    dynamic = backend_plan(gptq(overrides=overrides), layout).config["dynamic"]
    assert dynamic_override(dynamic, "model.layers.0.self_attn.q_proj") is False
    assert dynamic_override(dynamic, "model.layers.0.self_attn.o_proj") is False
    assert dynamic_override(dynamic, "model.layers.1.mlp.down_proj") == {"bits": 4, "group_size": -1, "sym": True}
    assert dynamic_override(dynamic, "model.layers.1.self_attn.q_proj") is None  # layer 1's attention is the base scheme
    assert dynamic_override(dynamic, "model.layers.10.self_attn.q_proj") is None


def test_gptqmodel_overrides_also_match_the_layers_vllm_fuses(layout: ModelLayout) -> None:
    """GPTQModel names q_proj, k_proj, v_proj (gate_proj, up_proj); vLLM matches `dynamic` against the one Linear it
    fuses them into, qkv_proj (gate_up_proj): an override only the first matched would be served with the base scheme."""
    overrides = [{"layers": [0], "keep": True}, {"layers": [1], "mlp": {"weights": {"bits": 4, "granularity": "channel"}}}]
    dynamic = backend_plan(gptq(overrides=overrides), layout).config["dynamic"]
    assert dynamic_override(dynamic, "model.layers.0.self_attn.qkv_proj") is False
    assert dynamic_override(dynamic, "model.layers.0.mlp.gate_up_proj") is False
    assert dynamic_override(dynamic, "model.layers.1.mlp.gate_up_proj") == {"bits": 4, "group_size": -1, "sym": True}
    assert dynamic_override(dynamic, "model.layers.1.self_attn.qkv_proj") is None
    mlp_only = backend_plan({**gptq(), "groups": {"mlp": W4_GPTQ}}, layout).config["dynamic"]
    assert dynamic_override(mlp_only, "model.layers.2.self_attn.qkv_proj") is False
    assert dynamic_override(mlp_only, "model.layers.2.mlp.gate_up_proj") is None


@pytest.mark.parametrize(("change", "field"), [
    ({"algorithm": {"method": "rtn"}, "calibration": None}, "algorithm.method"),
    ({"groups": {"attention": {**W4_GPTQ, "activations": {"dynamic": True}}, "mlp": W4_GPTQ}}, "groups.attention.activations"),
    ({"kv_cache": "fp8"}, "kv_cache"),
    ({"groups": {"attention": W4_GPTQ, "mlp": {**W4_GPTQ, "algorithm": "rtn"}}}, "groups.mlp.algorithm"),
    # vLLM's AutoGPTQConfig serves (4, sym) and (8, sym) only, while the compressed-tensors kernel rules pass asymmetric int4
    ({"groups": {"attention": W4_GPTQ, "mlp": {"weights": {**W4_GPTQ["weights"], "symmetric": False}}}}, "groups.mlp.weights.symmetric"),
    ({"overrides": [{"layers": [1], "attention": {"weights": {**W4_GPTQ["weights"], "symmetric": False}}}]},
     "overrides.0.attention.weights.symmetric"),
])
def test_what_gptqmodel_cannot_express_is_refused_naming_the_field(layout: ModelLayout, change: dict, field: str) -> None:
    data = {key: value for key, value in {**gptq(), **change}.items() if value is not None}
    assert refusal(data, layout).field == field


@pytest.mark.parametrize("target", ["cpu:avx512bf16", "cuda:8.0"])
def test_overrides_that_keep_every_linear_are_refused_not_a_crash(layout: ModelLayout, target: str) -> None:
    keep_all = [{"layers": list(range(layout.num_layers)), "keep": True}]
    assert refusal(gptq(overrides=keep_all), layout, target).field == "overrides"
    w8 = {"bits": 8, "granularity": "channel"}
    rtn = {"name": "t", "backend": "bitsandbytes", "groups": {"attention": {"weights": w8}, "mlp": {"weights": w8}}, "overrides": keep_all}
    assert refusal(rtn, layout, target).field == "overrides"


def bnb(weights: dict, **top) -> dict:
    return {"name": "t", "backend": "bitsandbytes", "groups": {"attention": {"weights": weights}, "mlp": {"weights": weights}}, **top}


# bitsandbytes checkpoints serve on CUDA only (vLLM's CPU build has no such method): compiled for a GPU target
GPU = "cuda:8.0"


def test_bitsandbytes_takes_int8_per_channel_and_4_bit_groups_of_64(layout: ModelLayout) -> None:
    int8 = backend_plan(bnb({"bits": 8, "granularity": "channel"}), layout, GPU).config
    assert int8 == {"load_in_8bit": True, "skip_modules": ["lm_head"]}
    nf4 = backend_plan(bnb({"bits": 4, "granularity": "group", "group_size": 64}), layout, GPU).config
    assert nf4["load_in_4bit"] and nf4["bnb_4bit_quant_type"] == "nf4"


def test_bitsandbytes_refuses_gptq_other_groups_and_mixed_schemes(layout: ModelLayout) -> None:
    assert refusal({**gptq(), "backend": "bitsandbytes"}, layout, GPU).field == "algorithm.method"
    w4 = {"bits": 4, "granularity": "group", "group_size": 64}
    one_group_gptq = {**bnb(w4), "calibration": CALIBRATION, "groups": {"attention": {"weights": w4}, "mlp": {"weights": w4, "algorithm": "gptq"}}}
    assert refusal(one_group_gptq, layout, GPU).field == "groups.mlp.algorithm"  # the recipe's own method is rtn
    assert refusal(bnb({"bits": 4, "granularity": "group", "group_size": 128}), layout, GPU).field == "groups.attention.weights"
    mixed = bnb({"bits": 8, "granularity": "channel"}, overrides=[{"layers": [0], "mlp": {"weights": {"bits": 4, "granularity": "channel"}}}])
    assert refusal(mixed, layout, GPU).field == "overrides"


def test_an_unknown_backend_is_refused_naming_the_field() -> None:
    with pytest.raises(InputError) as caught:
        parse_recipe(yaml.safe_dump({"name": "t", "backend": "autogptq", "groups": {"mlp": W4_GPTQ}}), FILE)
    assert caught.value.field == "backend"


def test_with_backend_renames_and_keeps_the_policy_base() -> None:
    loaded = with_backend(load_recipe("gptq"), "gptqmodel")
    assert (loaded.name, loaded.recipe.base, loaded.recipe.backend) == ("gptq-gptqmodel", "gptq", "gptqmodel")
    assert loaded.recipe.groups == load_recipe("gptq").recipe.groups
    assert with_backend(load_recipe("gptq"), "llm-compressor") == load_recipe("gptq")


def test_the_backend_tool_imports_nothing_of_ours() -> None:
    tree = ast.parse(backend_process.TOOL_SCRIPT.read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert names and not [name for name in names if name.split(".")[0] == "pipelines"]
    assert backend_process.MARKER == "QUANTGATE-BACKEND "
    assert f'MARKER = "{backend_process.MARKER}"' in backend_process.TOOL_SCRIPT.read_text()


def test_the_gptqmodel_environment_is_pinned_and_told_its_worker_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pins = pinned_versions(BACKENDS["gptqmodel"])
    assert set(pins) == {"gptqmodel", "torch", "transformers"} and pins["gptqmodel"] == "7.7.0"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    env = backend_process_env(BACKENDS["gptqmodel"], tmp_path)
    assert env["GPTQMODEL_CPU_WORKERS"] == "2" and env["HF_HUB_OFFLINE"] == "1" and env["TMPDIR"] == str(tmp_path)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert "GPTQMODEL_CPU_WORKERS" not in backend_process_env(BACKENDS["gptqmodel"], tmp_path)


def fake_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """The process contract driven by a stand-in tool on this Python (the real GPTQModel runs in the integration tests)."""
    script = tmp_path / "tool.py"
    script.write_text(f"import json, sys\nMARKER = {backend_process.MARKER!r}\n{body}\n")
    monkeypatch.setattr(backend_process, "TOOL_SCRIPT", script)
    monkeypatch.setattr(backend_process, "ensure_environment", lambda spec, log: Path(sys.executable))
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))


def test_a_backend_run_reports_its_stages_and_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    fake_tool(tmp_path, monkeypatch, "job = json.load(open(sys.argv[1]))\n"
              "print(MARKER + json.dumps({'stage': 'quantizing', 'samples': len(open(job['calibration']['texts_file']).readlines())}))\n"
              "print(MARKER + json.dumps({'stage': 'done', 'seconds': 1.5, 'versions': {'gptqmodel': '7.7.0'}, 'peak_bytes': 123}))")
    run = backend_process.run_backend(BACKENDS["gptqmodel"], BackendPlan(backend="gptqmodel", config={}), tmp_path, tmp_path / "out",
                                      texts=["a", "b", "c"], max_seq_length=16, seed=0)
    assert (run.seconds, run.versions, run.peak_bytes) == (1.5, {"gptqmodel": "7.7.0"}, 123)
    assert "gptqmodel: quantizing (3 calibration samples)" in capsys.readouterr().err
    assert not list((tmp_path / "artifacts" / "logs").glob("gptqmodel-*/"))  # its scratch folder is gone


def test_a_backend_that_dies_is_reported_by_its_cause_and_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tool(tmp_path, monkeypatch, "print('loading...')\nraise RuntimeError(\"Virtual pool 'model_loader:cpu' requests 2 workers\")")
    with pytest.raises(QuantizeError) as caught:
        backend_process.run_backend(BACKENDS["gptqmodel"], BackendPlan(backend="gptqmodel", config={}), tmp_path, tmp_path / "out",
                                    texts=[], max_seq_length=0, seed=0)
    assert "gptqmodel failed (exit code 1): RuntimeError: Virtual pool 'model_loader:cpu' requests 2 workers" in caught.value.message
    assert caught.value.file is not None and Path(caught.value.file).is_file()


def test_an_environment_that_fails_to_build_is_one_line_naming_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup_env.sh").write_text("echo 'ERROR: No matching distribution found for gptqmodel==7.7.0'\nexit 2\n")
    monkeypatch.setenv("QUANTGATE_ROOT", str(tmp_path))
    log = tmp_path / "setup.log"
    with pytest.raises(InputError) as caught:
        ensure_environment(BACKENDS["gptqmodel"], log)
    assert caught.value.field == "backend" and caught.value.file == str(log)
    assert "exit code 2" in caught.value.message and "No matching distribution found for gptqmodel==7.7.0" in caught.value.message


def test_recipe_validate_makes_the_backend_checks_quantize_makes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from pipelines.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**gptq(), "kv_cache": "fp8"}))
    assert main(["recipe", "validate", str(recipe), "--target", "cpu:avx512bf16"]) == 2
    assert "kv_cache: backend gptqmodel cannot express this" in capsys.readouterr().err
    recipe.write_text(yaml.safe_dump(bnb({"bits": 4, "granularity": "group", "group_size": 64})))
    assert main(["recipe", "validate", str(recipe), "--target", "cpu:avx512bf16"]) == 2
    assert "backend: backend bitsandbytes writes bitsandbytes checkpoints, which vLLM cannot serve here" in capsys.readouterr().err
    recipe.write_text(yaml.safe_dump(gptq()))
    assert main(["recipe", "validate", str(recipe), "--target", "cpu:avx512bf16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "gptqmodel" and result["backend_config"]["bits"] == 4
