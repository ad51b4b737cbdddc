"""SmoothQuant mappings come from the model's own forward and are checked to be an identity before calibration.

Every family of tests/families.py, with random norm weights (not ones, not zeros: a wrong mapping must change
the outputs measurably): the trace names the norm the projections read (Gemma: pre_feedforward_layernorm for
gate/up, not post_attention_layernorm), and SmoothQuant alone through llm-compressor's oneshot leaves the
float32 logits unchanged. A Gemma-style wrong mapping is refused before calibration, naming the layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from families import FAMILIES, make_family_model, tokenizer_texts

from pipelines.errors import InputError
from pipelines.quantize import smoothing
from pipelines.quantize.calibration import calibration_dataset

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

QKV = "self_attn.k_proj, self_attn.q_proj, self_attn.v_proj"
GATE_UP = "mlp.gate_proj, mlp.up_proj"
LLAMA_LIKE = [f"input_layernorm -> {QKV} (every layer)", f"post_attention_layernorm -> {GATE_UP} (every layer)"]
EXPECTED = {
    "llama": LLAMA_LIKE, "mistral": LLAMA_LIKE, "qwen2": LLAMA_LIKE, "qwen3": LLAMA_LIKE,
    "gemma2": [f"input_layernorm -> {QKV} (every layer)", f"pre_feedforward_layernorm -> {GATE_UP} (every layer)"],
    "gemma3": [f"input_layernorm -> {QKV} (every layer)", f"pre_feedforward_layernorm -> {GATE_UP} (every layer)"],
    "phi3": ["input_layernorm -> self_attn.qkv_proj (every layer)", "post_attention_layernorm -> mlp.gate_up_proj (every layer)"],
}
GEMMA_STYLE_WRONG = [[[r"re:.*\.mlp\.gate_proj$", r"re:.*\.mlp\.up_proj$"], r"re:.*\.post_attention_layernorm$"]]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny matrices: one thread is faster, and far faster on a loaded machine (two threads spin on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny `family` model on disk, its norm weights random (Gemma's around 0, as it adds 1; others around 1)."""
    from transformers import AutoModelForCausalLM

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            folder = make_family_model(family, tmp_path_factory.mktemp(family))
            model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for module in model.modules():
                    weight = getattr(module, "weight", None)
                    if isinstance(weight, torch.nn.Parameter) and weight.ndim == 1:
                        centre = 0.0 if family.startswith("gemma") else 1.0
                        weight.copy_(centre + 0.3 * torch.randn(weight.shape, generator=generator))
            model.save_pretrained(folder)
            built[family] = folder
        return built[family]

    return get


def load(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    dataset = calibration_dataset(tokenizer, tokenizer_texts(smoothing.CHECK_SAMPLES), 64)
    return AutoModelForCausalLM.from_pretrained(folder, dtype="auto"), dataset


def first_tokens(dataset: Any) -> Any:
    return torch.tensor([dataset[0]["input_ids"][: smoothing.TRACE_TOKENS]])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trace_names_the_norm_each_projection_group_reads_and_smoothing_stays_an_identity(family_dir, family: str) -> None:
    model, dataset = load(family_dir(family))
    derived = smoothing.derive_mappings(model, first_tokens(dataset))
    assert smoothing.describe(model, derived.mappings) == EXPECTED[family]
    assert all(regex.endswith("$") for balance, smooth in derived.mappings for regex in [*balance, smooth])
    assert len(derived.pairs) == 2 * model.config.num_hidden_layers
    assert "mlp.down_proj: no module of the layer outputs what they read (every layer)" in derived.skipped_lines(model.config.num_hidden_layers)
    check = smoothing.check_identity(model, derived.mappings, dataset, strength=0.8, max_seq_length=64)
    assert check.passed and check.max_relative_difference < 1e-5, check


def test_a_gemma_style_wrong_mapping_is_refused_before_calibration(family_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """post_attention_layernorm -> gate/up (llm-compressor's registry mapping for Gemma 2/3) put where the
    derived mapping goes: quantize refuses it with one line naming the layers, before any calibration."""
    import llmcompressor

    from pipelines.quantize.oneshot import quantize_model

    folder = family_dir("gemma3")
    monkeypatch.setattr(smoothing, "derive_mappings", lambda model, ids: smoothing.Derivation(GEMMA_STYLE_WRONG, []))
    recipes: list[str] = []
    real_oneshot = llmcompressor.oneshot

    def recording_oneshot(**kwargs: Any) -> Any:
        recipes.append(kwargs["recipe"])
        return real_oneshot(**kwargs)

    monkeypatch.setattr(llmcompressor, "oneshot", recording_oneshot)
    (tmp_path / "artifacts").mkdir()
    with pytest.raises(InputError) as caught:
        quantize_model("w8a8", folder, artifacts_root=tmp_path / "artifacts")
    error = caught.value
    assert error.exit_code == 2 and error.field == "smoothquant" and "\n" not in error.one_line()
    assert f"post_attention_layernorm -> {GATE_UP} (every layer) changes logits by" in error.message
    assert "refused before calibration" in error.message
    assert recipes and all("GPTQModifier" not in recipe and "QuantizationModifier" not in recipe for recipe in recipes)
    assert list((tmp_path / "artifacts").iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_llm_compressors_own_mapping_for_gemma_fails_the_trace_and_the_check(family_dir, family: str) -> None:
    model, dataset = load(family_dir(family))
    derived = smoothing.derive_mappings(model, first_tokens(dataset))
    library = smoothing.library_mappings(model)
    assert f"post_attention_layernorm -> {GATE_UP} (every layer)" in (smoothing.library_differs(model, derived) or "")
    check = smoothing.check_identity(model, library, dataset, strength=0.8, max_seq_length=64)
    assert not check.passed and check.max_relative_difference > 0.1


def test_llm_compressors_own_mapping_for_llama_is_the_traced_one(family_dir) -> None:
    model, dataset = load(family_dir("llama"))
    assert smoothing.library_differs(model, smoothing.derive_mappings(model, first_tokens(dataset))) is None


class OffsetNorm(torch.nn.Module):
    """x * (1 + w), like Gemma's RMSNorm, but a class llm-compressor does not know to convert."""

    def __init__(self, weight: Any, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone() - 1)
        self.eps = eps

    def forward(self, x: Any) -> Any:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1 + self.weight.float())).type_as(x)


def test_a_norm_that_cannot_absorb_the_scale_is_not_smoothed(family_dir) -> None:
    """Decided by trying llm-compressor's transform on the module, not by its name: Gemma's x * (1 + w) norm
    absorbs it (oneshot converts that class while it calibrates), an unknown offset norm does not."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(2, 3, 32)
    for norm in (LlamaRMSNorm(32), Gemma3RMSNorm(32)):
        norm.weight.data = torch.rand(32) + 0.5
        assert smoothing.absorbs_scale(norm, x)
    assert not smoothing.absorbs_scale(OffsetNorm(torch.rand(32) + 0.5), x)

    model, dataset = load(family_dir("llama"))
    for layer in model.model.layers:
        layer.post_attention_layernorm = OffsetNorm(layer.post_attention_layernorm.weight)
    derived = smoothing.derive_mappings(model, first_tokens(dataset))
    assert smoothing.describe(model, derived.mappings) == [f"input_layernorm -> {QKV} (every layer)"]
    assert any(line.startswith("mlp.gate_proj, mlp.up_proj: post_attention_layernorm outputs what they read, but dividing")
               for line in derived.skipped_lines(model.config.num_hidden_layers))


def test_the_compiled_recipe_says_where_the_mappings_come_from_and_quantize_fills_them_in(family_dir) -> None:
    import yaml

    from pipelines.quantize.compiler import compile_file

    compiled = compile_file("w8a8", family_dir("gemma3"))
    modifier = compiled.llmcompressor["quant_stage"]["quant_modifiers"]["SmoothQuantModifier"]
    assert "derived at quantize time from the model's forward" in modifier["mappings"]
    filled = yaml.safe_load(smoothing.with_mappings(compiled.llmcompressor, [(["re:.*\\.mlp\\.up_proj$"], "re:.*\\.pre_feedforward_layernorm$")]))
    assert filled["quant_stage"]["quant_modifiers"]["SmoothQuantModifier"] == {
        "smoothing_strength": modifier["smoothing_strength"], "mappings": [[["re:.*\\.mlp\\.up_proj$"], "re:.*\\.pre_feedforward_layernorm$"]],
    }
    assert list(filled["quant_stage"]["quant_modifiers"]) == ["SmoothQuantModifier", "GPTQModifier"]


SMOOTH_RTN = """\
name: smooth-int8
algorithm: {method: rtn}
smoothquant: {strength: 0.8}
calibration: {dataset: calibration, num_samples: 8, max_seq_length: 64}
groups:
  attention:
    weights: {bits: 8, granularity: channel, symmetric: true}
    activations: {bits: 8, granularity: token, dynamic: true}
  mlp:
    weights: {bits: 8, granularity: channel, symmetric: true}
    activations: {bits: 8, granularity: token, dynamic: true}
"""


@pytest.mark.slow
def test_quantize_smooths_gemma_by_the_traced_mapping_and_the_manifest_records_it(family_dir, tmp_path: Path) -> None:
    import yaml

    from pipelines.quantize.oneshot import quantize_model

    recipe = tmp_path / "smooth-int8.yaml"
    recipe.write_text(SMOOTH_RTN)
    manifest = quantize_model(str(recipe), family_dir("gemma3"), artifacts_root=tmp_path / "artifacts").manifest
    assert manifest.smoothing is not None
    assert manifest.smoothing.layers == EXPECTED["gemma3"]
    assert manifest.smoothing.max_relative_difference < 1e-5 and manifest.smoothing.check_samples == smoothing.CHECK_SAMPLES
    run = yaml.safe_load(manifest.compiled_recipe)["quant_stage"]["quant_modifiers"]["SmoothQuantModifier"]
    assert run["mappings"] == [[list(balance), smooth] for balance, smooth in manifest.smoothing.mappings]
    assert any("pre_feedforward_layernorm" in smooth for _, smooth in run["mappings"])
