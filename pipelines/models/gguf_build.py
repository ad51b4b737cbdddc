"""GGUF files of a model for llama.cpp, made once per source model and checked against the model's own function.

    build_ggufs(model_dir)   -> GgufSet: f16.gguf, q8_0.gguf, q4_k_m.gguf under artifacts/gguf/<name>-<key>/
    python -m pipelines.models.gguf_build --model DIR [--json]

The F16 file is written from the folder's safetensors by pipelines.models.gguf_export (never requantized from another
GGUF: SmolLM2's folder, made from a Q4_1 GGUF by `quantize models add`, is the 16-bit model vLLM serves as the baseline,
and the same weights go to llama.cpp). Q8_0 and Q4_K_M come from that F16 file through llama.cpp's own quantizer
(llama_model_quantize with its default parameters, in .venv-llamacpp).

The check, before anything is cached: on fixed text (pipelines.models.tokenizer.VERIFY_TEXTS) llama.cpp must tokenize
the F16 file's prompts exactly as the model's tokenizer does (the way llama-cpp-python's server tokenizes a completion
prompt) and detokenize them back to the text; and on the same token ids its next-token distribution at every position
must be the HF model's in float32: a mean KL(HF || GGUF) of at most F16_MAX_KL_NATS and the same top token wherever
the HF model's top two logits are more than NEAR_TIE_LOGITS apart (a near tie may go either way).
(llama.cpp's CPU matmul rounds activations to float16 for F16 weights: on the demo model the largest logit difference
is 0.14 of a 32-wide range and the KL 3e-6 nats; on SmolLM2 0.05 and 3e-6, one near tie of 148 positions flipped.)
The quantized files are measured the same way and their agreement recorded, not required.

The key of a cached set is the source folder's hash, llama-cpp-python's version (its quantizer wrote the files) and
EXPORT_VERSION (the converter's); gguf.json in the folder records the set and its check.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipelines.errors import InputError, QuantGateError
from pipelines.files.atomic import atomic_dir, write_json_atomic
from pipelines.files.hashing import folder_hash, sha256_json
from pipelines.models.gguf_export import export_gguf
from pipelines.models.llamacpp_env import llamacpp_version, run_tool
from pipelines.models.tokenizer import VERIFY_TEXTS
from pipelines.schema import StrictModel
from pipelines.settings import current as current_settings

GGUF_KINDS = ("f16", "q8_0", "q4_k_m")  # llamacpp_tool.FILE_TYPES
EXPORT_VERSION = 1  # raise when gguf_export writes a different file for the same folder
# The F16 file against the float32 HF model: vLLM's bf16 server against itself differs by about 1e-3 nats/token
# (docs/real-model.md: serving noise), so a file within that computes the model as well as its baseline server does.
F16_MAX_KL_NATS = 1e-3
NEAR_TIE_LOGITS = 0.5  # top two logits this close (odds under 1.65 to 1) may swap under float16 rounding
MANIFEST = "gguf.json"
STEP_TIMEOUT_S = 1800.0


class FileCheck(StrictModel):
    """One GGUF file against the HF model, on the same token ids."""

    kind: str
    bytes: int
    positions: int
    max_abs_logit_diff: float
    top1_agreement: float  # fraction of positions with the HF model's top token
    decided_flips: int  # positions with another top token where the HF model's top two are more than NEAR_TIE_LOGITS apart
    mean_kl_nats: float  # KL(HF || GGUF) per position


class GgufSet(StrictModel):
    model_dir: Path
    source_hash: str
    llama_cpp_python: str
    folder: Path
    files: dict[str, Path]
    tokenizer_texts: int
    checks: list[FileCheck]
    made_from: str = "f16 written from the folder's safetensors; q8_0 and q4_k_m by llama.cpp's quantizer from that f16"


def cache_key(source_hash: str, llama_cpp_python: str) -> str:
    return sha256_json({"source": source_hash, "llama-cpp-python": llama_cpp_python, "export": EXPORT_VERSION})[:16]


def cache_folder(model_dir: Path, key: str) -> Path:
    return current_settings().artifacts_dir / "gguf" / f"{model_dir.resolve().name}-{key}"


def _cached(folder: Path) -> GgufSet | None:
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    try:
        found = GgufSet.model_validate_json(manifest.read_text())
    except (OSError, ValueError):
        return None
    sizes = {check.kind: check.bytes for check in found.checks}
    whole = all(path.is_file() and path.stat().st_size == sizes.get(kind) for kind, path in found.files.items())
    return found if whole else None


def build_ggufs(model_dir: Path, *, threads: int | None = None) -> GgufSet:
    """The checked GGUF set of `model_dir`, from the cache or made now (an InputError when the F16 file is not the model)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InputError("not a model folder (no config.json)", file=model_dir)
    source_hash = folder_hash(model_dir)
    version = llamacpp_version()
    folder = cache_folder(model_dir, cache_key(source_hash, version))
    cached = _cached(folder)
    if cached is not None:
        return cached
    threads = threads or os.cpu_count() or 1
    with atomic_dir(folder) as staging:
        log = staging / "llamacpp.log"
        export_gguf(model_dir, staging / "f16.gguf")
        for kind in GGUF_KINDS[1:]:
            run_tool(["quantize", str(staging / "f16.gguf"), str(staging / f"{kind}.gguf"), kind, "--threads", str(threads)],
                     log_path=log, timeout_s=STEP_TIMEOUT_S)
        checks, texts = _check(model_dir, staging, threads, log)
        built = GgufSet(model_dir=model_dir, source_hash=source_hash, llama_cpp_python=version, folder=folder,
                        files={kind: folder / f"{kind}.gguf" for kind in GGUF_KINDS}, tokenizer_texts=texts, checks=checks)
        write_json_atomic(staging / MANIFEST, built.model_dump(mode="json"))
    return built


def _reference(model_dir: Path) -> tuple[list[list[int]], list[Any]]:
    """The HF model's token ids for VERIFY_TEXTS and its float32 logits at every position."""
    import torch  # heavy: imported when used
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: imported when used
    from transformers.utils import logging as transformers_logging  # heavy: imported when used

    transformers_logging.disable_progress_bar()  # library chatter: not on the terminal
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [list(tokenizer(text).input_ids) for text in VERIFY_TEXTS]
    with torch.no_grad():
        logits = [model(torch.tensor([prompt])).logits[0].numpy() for prompt in ids]
    return ids, logits


def _check(model_dir: Path, staging: Path, threads: int, log: Path) -> tuple[list[FileCheck], int]:
    ids, reference = _reference(model_dir)
    checks = []
    for kind in GGUF_KINDS:
        path = staging / f"{kind}.gguf"
        with tempfile.TemporaryDirectory(dir=staging) as scratch:
            logits_path = Path(scratch) / "logits.npz"
            found = run_tool(["probe", str(path), "--threads", str(threads)], log_path=log, timeout_s=STEP_TIMEOUT_S,
                             request={"texts": list(VERIFY_TEXTS), "token_prompts": ids, "logits": str(logits_path)})
            if found is None:
                raise InputError("llama.cpp's probe printed no result", file=log)
            if kind == "f16":
                require_same_tokenizer(path, ids, found)
            checks.append(compare_logits(kind, path.stat().st_size, reference, logits_path))
    require_same_function(staging / "f16.gguf", checks[0])
    return checks, len(VERIFY_TEXTS)


def require_same_tokenizer(path: Path, ids: list[list[int]], found: dict) -> None:
    """llama.cpp's tokens for VERIFY_TEXTS must be the HF tokenizer's, and decode back to the text."""
    for text, want, got, decoded in zip(VERIFY_TEXTS, ids, found["tokens"], found["decoded"], strict=True):
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
            raise InputError(f"llama.cpp tokenizes {text!r} differently from the model's tokenizer at token {first} "
                             f"({got[first:first + 3]} vs {want[first:first + 3]})", file=path, field="tokenizer")
        if decoded != text:
            raise InputError(f"llama.cpp decodes {text!r} back as {decoded!r}", file=path, field="tokenizer")


def compare_logits(kind: str, size: int, reference: list[Any], logits_path: Path) -> FileCheck:
    """Logit difference, top-token agreement and KL(HF || GGUF) over every position of every prompt."""
    import numpy as np  # heavy: imported when used

    with np.load(logits_path) as saved:
        found = [saved[f"arr_{index}"] for index in range(len(reference))]
    want, got = np.concatenate(reference).astype(np.float64), np.concatenate(found).astype(np.float64)
    if want.shape != got.shape:
        raise InputError(f"llama.cpp's logits have shape {got.shape}, the model's {want.shape}", file=logits_path)
    log_p, log_q = _log_softmax(want), _log_softmax(got)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=1)
    largest = float(np.abs(want - got).max())
    top_two = np.sort(want, axis=1)[:, -2:] if want.shape[1] > 1 else np.concatenate([want, want], axis=1)
    flipped = want.argmax(axis=1) != got.argmax(axis=1)
    decided = top_two[:, 1] - top_two[:, 0] > NEAR_TIE_LOGITS
    return FileCheck(kind=kind, bytes=size, positions=int(want.shape[0]), max_abs_logit_diff=largest,
                     top1_agreement=float((~flipped).mean()), decided_flips=int((flipped & decided).sum()), mean_kl_nats=float(kl.mean()))


def _log_softmax(logits: Any) -> Any:
    import numpy as np  # heavy: imported when used

    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def require_same_function(path: Path, check: FileCheck) -> None:
    """The F16 file computes the model: its next-token distributions are the float32 HF model's, within serving noise."""
    if check.mean_kl_nats > F16_MAX_KL_NATS or check.decided_flips:
        raise InputError(f"llama.cpp's next-token distributions differ from the model's: KL {check.mean_kl_nats:.2g} nats/token "
                         f"(at most {F16_MAX_KL_NATS:g}), another top token at {check.decided_flips} of {check.positions} positions "
                         f"that are no near tie (none allowed), logits up to {check.max_abs_logit_diff:.3g} apart: the GGUF is not the model",
                         file=path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.models.gguf_build", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a Llama model folder (HF format)")
    parser.add_argument("--json", action="store_true", help="print the set as JSON")
    args = parser.parse_args(argv)
    try:
        built = build_ggufs(args.model)
    except QuantGateError as error:
        print(f"error: {error.one_line()}", file=sys.stderr)
        return error.exit_code
    if args.json:
        print(built.model_dump_json(indent=2))
        return 0
    for check in built.checks:
        print(f"{built.files[check.kind]}  {check.bytes / 2**20:7.1f} MiB  max |logit diff| {check.max_abs_logit_diff:.4f}  "
              f"top-1 agreement {check.top1_agreement:.1%} ({check.decided_flips} beyond near ties)  "
              f"KL {check.mean_kl_nats:.2e} nats/token ({check.positions} positions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
