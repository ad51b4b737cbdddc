"""llama.cpp's own quantizer and a forward pass, run by .venv-llamacpp's Python (llama-cpp-python, never the project's):
it imports llama_cpp, numpy and the standard library only, so it must not import anything from `pipelines`.

    python llamacpp_tool.py quantize SRC DST TYPE --threads N [--allow-requantize]
        llama_model_quantize with llama_model_quantize_default_params (TYPE: f16, q8_0, q4_k_m); exit 0 on success
    python llamacpp_tool.py probe GGUF --threads N < {"texts": [...], "token_prompts": [[id, ...], ...], "logits": PATH}
        tokenizes each text as llama-cpp-python's server tokenizes a completion prompt (the GGUF's own BOS rule,
        special tokens parsed) and detokenizes the result; runs each token prompt and saves every position's logits
        to PATH (numpy .npz, arrays arr_0, arr_1, ...). stdout: one line `QUANTGATE-LLAMACPP <json>` with
        {"tokens": [[...]], "decoded": [...], "vocab": N, "system": llama_print_system_info()}.

llama.cpp's own chatter goes to stderr (the caller keeps it in a log file).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

MARKER = "QUANTGATE-LLAMACPP "
FILE_TYPES = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def _llama_cpp() -> Any:
    import llama_cpp  # type: ignore[import-not-found]  # .venv-llamacpp only: this file runs there

    return llama_cpp


def quantize(source: str, target: str, kind: str, threads: int, allow_requantize: bool) -> int:
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FILE_TYPES[kind])
    params.nthread = threads
    params.allow_requantize = allow_requantize
    return int(llama_cpp.llama_model_quantize(source.encode(), target.encode(), params))


def probe(model: str, threads: int, request: dict) -> dict:
    import numpy as np

    llama_cpp = _llama_cpp()

    longest = max([len(prompt) for prompt in request["token_prompts"]] + [8])
    llm = llama_cpp.Llama(model_path=model, n_ctx=longest + 8, n_batch=longest + 8, n_ubatch=longest + 8, n_threads=threads,
                          logits_all=True, verbose=False)
    tokens = [llm.tokenize(text.encode(), add_bos=True, special=True) for text in request["texts"]]
    decoded = [llm.detokenize(ids).decode("utf-8", errors="replace") for ids in tokens]
    logits = []
    for prompt in request["token_prompts"]:
        llm.reset()
        llm.eval(prompt)
        logits.append(np.array(llm.scores[: len(prompt), :], dtype=np.float32))
    np.savez(request["logits"], *logits)
    return {"tokens": tokens, "decoded": decoded, "vocab": llm.n_vocab(),
            "system": llama_cpp.llama_print_system_info().decode(errors="replace")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llamacpp_tool.py")
    commands = parser.add_subparsers(dest="command", required=True)
    quant = commands.add_parser("quantize")
    quant.add_argument("source")
    quant.add_argument("target")
    quant.add_argument("kind", choices=sorted(FILE_TYPES))
    quant.add_argument("--threads", type=int, required=True)
    quant.add_argument("--allow-requantize", action="store_true")
    check = commands.add_parser("probe")
    check.add_argument("model")
    check.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "quantize":
        return quantize(args.source, args.target, args.kind, args.threads, args.allow_requantize)
    print(MARKER + json.dumps(probe(args.model, args.threads, json.load(sys.stdin))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
