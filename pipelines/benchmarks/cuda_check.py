"""What a CUDA host tells the product without vLLM: its class, what each shipped recipe costs to quantize there and
how close the artifact stays to 16-bit, torch's own GEMMs by format, and the repair's sensitivity pass on the GPU.

    python -m pipelines.benchmarks.cuda_check [--model models/demo-llama] [--recipes w8a8,fp8,...] [--out DIR]

Written for the GPU machine a session may be lent (the device tool): it has torch and transformers but no vLLM, so
vLLM's own kernel selection (the probe, pipelines/hardware/serve_probe.py) cannot run there. What runs instead:
1. host: the probe's host facts from this torch (`serve_probe.host_facts`, the code the serve environment runs), the
   class and serve dtype the product derives from them, and the target `installed_target()` picks without a serve
   environment (nvidia-smi's compute capability, judged by the written rules in pipelines/hardware/targets.py).
2. recipes: each shipped recipe through the quantize step (`quantize_model`: refused with its reason, or quantized
   by llm-compressor), its time, weight bytes and peak GPU memory; the artifact loaded back by transformers
   (compressed-tensors decompresses it) and compared with the 16-bit model on 32 texts of the shipped calibration set:
   teacher-forced next-token KL (nats, full vocabulary, float32) and top-1 agreement. transformers' forward with
   decompressed weights, not vLLM's kernels: a check of the artifact's numbers, not of its serving speed.
   `--shaped-layers N` adds a random-weight model at a real model's widths (a 7B's by default), built on the machine.
3. kernels: torch's GEMMs on this GPU at decode- and prefill-like row counts, by format: bf16, FP8 (torch._scaled_mm
   with one scale per tensor, and per row x per column) and int8 (torch._int_mm). vLLM falls back to these where its
   CUTLASS / Marlin kernels do not apply; they are a floor for what the formats buy, not vLLM's figures.
4. sensitivity: the repair's sensitivity pass (`SensitivityModel.measure`, pipelines/repair/sensitivity.py) for one
   recipe and the target's ladder, with its wall time per phase; the simulator runs on the GPU when torch sees one.

Prints markdown tables and writes everything as one JSON document (`--out DIR/cuda_check.json`). Not a test: the
figures are the machine's.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pipelines.artifact import check_model_dir
from pipelines.errors import QuantGateError
from pipelines.files.atomic import write_json_atomic
from pipelines.paths import DEMO_EVAL_SETS, DEMO_MODEL_DIR
from pipelines.recipe import Calibration, load_recipe
from pipelines.settings import current as current_settings

RECIPES = "w8a8,w4a16,gptq,fp8,fp8-block,fp8-w8a16,fp8-kv,aggressive"
COMPARE_TEXTS = 32
# (rows, in_features, out_features): decode- and prefill-like rows on a 7B model's attention and MLP shapes.
GEMM_SHAPES = ((32, 4096, 4096), (32, 4096, 14336), (2048, 4096, 4096), (2048, 4096, 14336), (2048, 14336, 4096))


def host_section() -> dict[str, Any]:
    import torch  # heavy: imported when used

    from pipelines.hardware import serve_probe
    from pipelines.hardware.host import HostFacts, classify, serve_dtype_for
    from pipelines.hardware.targets import installed_target

    facts = HostFacts.model_validate(serve_probe.host_facts(torch))
    host_class, library = classify(facts)
    dtype, why = serve_dtype_for(host_class, facts)
    return {"facts": facts.model_dump(mode="json"), "host_class": host_class, "library": library, "serve_dtype": dtype,
            "serve_dtype_why": why, "installed_target": str(installed_target()), "torch": torch.__version__,
            "cuda_runtime": torch.version.cuda}


def _eval_sets(names: list[str]) -> list:
    from pipelines.evaluation.evalsets import validate_eval_set

    return [validate_eval_set(current_settings().eval_sets_dir / name) for name in names]


def compare_texts(eval_sets: list) -> list[str]:
    from pipelines.quantize.calibration import calibration_inputs

    texts, _ = calibration_inputs(Calibration(num_samples=COMPARE_TEXTS, seed=0), eval_sets=eval_sets)
    return texts


class Reference:
    """The 16-bit model's next-token log-probabilities on the comparison texts, kept on the device."""

    def __init__(self, model_dir: Path, texts: list[str]):
        import torch  # heavy: imported when used
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pipelines.repair.simulate import compute_device

        self.device = compute_device()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.encoded = [torch.tensor([tokenizer(text, truncation=True, max_length=512)["input_ids"]], device=self.device) for text in texts]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(self.device)
        self.logp = self.log_probs(model)
        del model

    def log_probs(self, model) -> list:
        import torch  # heavy: imported when used

        with torch.no_grad():
            return [torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1) for ids in self.encoded]

    def compare(self, artifact_dir: Path) -> dict[str, float]:
        """Mean per-token KL(16-bit || artifact) and top-1 agreement, the artifact decompressed by transformers."""
        import torch  # heavy: imported when used
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        from pipelines.repair.simulate import kl_per_position

        # Loaded where it runs: a model decompressed on the CPU and then moved keeps some tensors behind (seen on the H200).
        model = AutoModelForCausalLM.from_pretrained(artifact_dir, dtype=torch.bfloat16, device_map=str(self.device),
                                                     quantization_config=CompressedTensorsConfig(run_compressed=False))
        logq = self.log_probs(model.eval())
        kl = [float(kl_per_position(p, q).mean()) for p, q in zip(self.logp, logq, strict=True)]
        agree = [float((p.argmax(-1) == q.argmax(-1)).float().mean()) for p, q in zip(self.logp, logq, strict=True)]
        return {"kl_mean": sum(kl) / len(kl), "top1_agreement": sum(agree) / len(agree), "texts": len(kl)}


def recipe_section(recipe: str, model_dir: Path, artifacts: Path, reference: Reference, eval_sets: list) -> dict[str, Any]:
    import torch  # heavy: imported when used

    from pipelines.quantize.oneshot import quantize_model

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        result = quantize_model(recipe, model_dir, artifacts_root=artifacts, force=True, eval_sets=eval_sets)
    except QuantGateError as error:
        return {"recipe": recipe, "status": "refused", "reason": error.one_line(), "wall_s": round(time.perf_counter() - started, 2)}
    manifest = result.manifest
    row: dict[str, Any] = {
        "recipe": recipe, "status": "quantized", "wall_s": round(time.perf_counter() - started, 2),
        "quantize_s": manifest.stages.get("quantize_s"), "weight_bytes": manifest.weight_bytes.model_dump(),
        "serve_target": manifest.serve_target, "compute": manifest.compute,
        "kv_cache": manifest.kv_cache.model_dump(mode="json") if manifest.kv_cache else None,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
    }
    row["versus_16_bit"] = _guarded(lambda: reference.compare(result.artifact_dir))
    return row


def _guarded(step: Callable[[], Any]) -> Any:
    try:
        return step()
    except Exception as error:  # a benchmark records what failed and goes on to the next figure
        return {"error": f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"}


def _cuda_ms(torch, call: Callable[[], Any], repeats: int = 20) -> float:
    """Milliseconds per call by CUDA events, after three warm-up calls, to 4 decimals."""
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / repeats, 4)


def _gemm_calls(torch, m: int, k: int, n: int) -> dict[str, Callable[[], Any]]:
    """One (rows x in) @ (in x out) product per format, on random operands; every scale is 1."""
    a, b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    ai, bi = a.clamp(-127, 127).to(torch.int8), b.clamp(-127, 127).to(torch.int8)
    one = torch.ones((), device="cuda")
    row_scale, col_scale = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    return {
        "bf16": lambda: a @ b.t(),
        "fp8_per_tensor": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "fp8_per_row": lambda: torch._scaled_mm(a8, b8.t(), scale_a=row_scale, scale_b=col_scale, out_dtype=torch.bfloat16),
        "int8": lambda: torch._int_mm(ai, bi.t()),
    }


def gemm_section() -> list[dict[str, Any]]:
    import torch  # heavy: imported when used

    if not torch.cuda.is_available():
        return []
    rows = []
    for m, k, n in GEMM_SHAPES:
        timed: dict[str, Any] = {}
        for name, call in _gemm_calls(torch, m, k, n).items():
            timed[name] = _guarded(partial(_cuda_ms, torch, call))
        base = timed["bf16"]
        rows.append({"shape": [m, k, n], "ms": timed,
                     "speedup": {name: round(base / ms, 2) for name, ms in timed.items()
                                 if isinstance(ms, float) and isinstance(base, float) and ms > 0}})
    return rows


def sensitivity_section(recipe_name: str, model_dir: Path, eval_sets: list, cache: Path) -> dict[str, Any]:
    from pipelines.hardware.targets import installed_target
    from pipelines.quantize.layout import layout_from_model_dir
    from pipelines.repair.ladder import calibration_available, load_ladder, unit_ladder
    from pipelines.repair.sensitivity import SensitivityModel, SensitivitySettings
    from pipelines.repair.simulate import compute_device
    from pipelines.repair.units import quantized_units, recipe_units
    from pipelines.serve.serving import ServeSettings

    loaded, target = load_recipe(recipe_name), installed_target()
    units = quantized_units(recipe_units(loaded.recipe, layout_from_model_dir(model_dir), loaded.path, target))
    ladder = load_ladder(None, target)
    calibrated = calibration_available(loaded.recipe, None)
    ladders = {u.name: unit_ladder(u, ladder.ladder, target, calibrated) for u in units}
    started = time.perf_counter()
    measured = SensitivityModel(model_dir, loaded.recipe, loaded.text, units, ladders, eval_sets, ServeSettings(), cache,
                                ladder.text, SensitivitySettings()).measure()
    return {"recipe": recipe_name, "ladder": str(ladder.path), "device": str(compute_device()), "units": len(units),
            "rungs": sum(len(x.options) for x in ladders.values()), "prompts": measured.prompts, "positions": measured.positions,
            "reference_source": measured.reference_source, "wall_s": measured.wall_s, "total_s": round(time.perf_counter() - started, 2),
            "spearman": measured.spearman, "split_half": measured.split_half, "kl_parent": measured.kl_parent,
            "top_units": [(e.unit, e.kl) for e in measured.units[:5]]}


def render(document: dict[str, Any]) -> str:
    host = document["host"]
    lines = [f"host class {host.get('host_class')} ({host.get('library')}), serve dtype {host.get('serve_dtype')}; "
             f"installed target {host.get('installed_target')}; torch {host.get('torch')} (CUDA {host.get('cuda_runtime')})"]
    if isinstance(document["gemm"], list) and document["gemm"]:
        lines += ["", "| rows x in x out | bf16 ms | FP8 per tensor | FP8 per row | int8 |", "|---|---|---|---|---|"]
        for row in document["gemm"]:
            ms, speed = row["ms"], row["speedup"]
            cells = [f"{ms[k]} ms ({speed[k]}x)" if k in speed else str(ms[k]) for k in ("fp8_per_tensor", "fp8_per_row", "int8")]
            lines.append(f"| {' x '.join(map(str, row['shape']))} | {ms['bf16']} | {' | '.join(cells)} |")
    for section in document["models"]:
        lines += ["", f"model {section['model']}", "",
                  "| recipe | outcome | quantize s | weight bytes (ratio) | peak GPU MiB | KL vs 16-bit | top-1 agreement |",
                  "|---|---|---|---|---|---|---|"]
        lines += [_recipe_line(row) for row in section["recipes"]]
        sens = section.get("sensitivity") or {}
        if "wall_s" in sens:
            lines += ["", f"sensitivity pass ({sens['recipe']}, {sens['units']} units, {sens['rungs']} rungs, {sens['prompts']} prompts) "
                          f"on {sens['device']}: {sens['total_s']} s; phases {sens['wall_s']}"]
        else:
            lines += ["", f"sensitivity pass: {sens.get('error')}"]
    return "\n".join(lines)


def _recipe_line(row: dict[str, Any]) -> str:
    if row["status"] != "quantized":
        return f"| {row['recipe']} | refused: {row['reason']} | | | | | |"
    versus, peak = row["versus_16_bit"], row["peak_gpu_bytes"]
    quality = f"{versus['kl_mean']:.5f} | {versus['top1_agreement']:.4f}" if "kl_mean" in versus else f"{versus.get('error')} |"
    return (f"| {row['recipe']} | quantized ({row['compute']}) | {row['quantize_s']} | {row['weight_bytes']['after']:,} "
            f"({row['weight_bytes']['ratio']}) | {'' if peak is None else round(peak / 2**20)} | {quality} |")


def shaped_model(like: Path, out_dir: Path, layers: int, hidden: int, intermediate: int) -> Path:
    """A random-weight copy of `like` at a real model's layer widths (a 7B's by default: 4096 -> 14336, 32 heads of 128,
    8 KV heads) with `layers` decoder layers and `like`'s tokenizer: the quantize step's GPU cost at real shapes."""
    import torch  # heavy: imported when used
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(like)
    heads = max(1, hidden // 128)
    config.update({"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers, "head_dim": hidden // heads,
                   "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(like).save_pretrained(out_dir)
    return out_dir


def model_section(model_dir: Path, recipes: list[str], eval_sets: list, scratch: Path, sensitivity_recipe: str) -> dict[str, Any]:
    reference = Reference(model_dir, compare_texts(eval_sets))
    return {
        "model": str(model_dir),
        "recipes": [recipe_section(name, model_dir, scratch / "artifacts", reference, eval_sets) for name in recipes],
        "sensitivity": _guarded(lambda: sensitivity_section(sensitivity_recipe, model_dir, eval_sets, scratch / "sensitivity")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.benchmarks.cuda_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--recipes", default=RECIPES)
    parser.add_argument("--eval-sets", default=",".join(DEMO_EVAL_SETS))
    parser.add_argument("--sensitivity-recipe", default="aggressive")
    parser.add_argument("--shaped-layers", type=_bounded(0, 128), default=0, help="also run a random model of this many layers at --shaped-width")
    parser.add_argument("--shaped-width", type=_widths, default=(4096, 14336), help="hidden,intermediate of the shaped model (a 7B's by default)")
    parser.add_argument("--out", type=Path, default=Path("artifacts") / "benchmarks")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except QuantGateError as error:  # bad input or a missing environment: one line, exit 2 (docs/exit-codes.md)
        print(f"cuda_check: {error.one_line()}", file=sys.stderr)
        return 2


def _bounded(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text[:40]!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    return parse


def _widths(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"give HIDDEN,INTERMEDIATE (two whole numbers): {text[:40]!r}")
    hidden, intermediate = (_bounded(128, 65_536)(part) for part in parts)
    return hidden, intermediate


def _run(args: argparse.Namespace) -> int:
    check_model_dir(args.model)  # before any model is loaded: one line naming the folder
    recipes = [name for name in args.recipes.split(",") if name]
    document: dict[str, Any] = {"host": _guarded(host_section), "gemm": _guarded(gemm_section), "models": []}
    eval_sets = _eval_sets(args.eval_sets.split(","))
    root = current_settings().artifacts_dir
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cuda-check-", dir=root))
    try:
        document["models"].append(model_section(args.model, recipes, eval_sets, scratch / "model", args.sensitivity_recipe))
        write_json_atomic(args.out / "cuda_check.json", document)  # kept if the shaped model's section is cut short
        print(render(document), flush=True)
        if args.shaped_layers:
            hidden, intermediate = args.shaped_width
            folder = scratch / f"shaped-{hidden}x{intermediate}x{args.shaped_layers}"
            shaped = shaped_model(args.model, folder, args.shaped_layers, hidden, intermediate)
            document["models"].append(model_section(shaped, recipes, eval_sets, scratch / "shaped", args.sensitivity_recipe))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        write_json_atomic(args.out / "cuda_check.json", document)
    print(render(document))
    print(f"\n{args.out / 'cuda_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
