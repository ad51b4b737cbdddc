"""A quantize backend's own step, run by that backend's environment's Python (.venv-gptqmodel, .venv-bitsandbytes),
never by the project's: it imports the backend, torch and transformers only, nothing from `pipelines`.

argv[1]: a JSON file {"backend": "gptqmodel"|"bitsandbytes", "model_dir", "out_dir", "workdir", "config": {...}, "calibration": null |
{"texts_file", "max_seq_length", "seed"}}. `config` is what pipelines.quantize.backends compiled from the recipe:
GPTQModel's QuantizeConfig arguments, or transformers' BitsAndBytesConfig arguments plus `skip_modules`.

stdout: progress lines `QUANTGATE-BACKEND <json>` ({"stage": "loading"|"quantizing"|"saving"|"done", ...}); the
last one carries {"stage": "done", "seconds": s, "versions": {...}, "peak_bytes": this process's peak RSS}. Everything the libraries print goes to the
log the caller gave this process (stderr and stdout share it). An exception ends the process with exit code 1 after
its traceback: the caller reports the last exception line with the log's path.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import time
from importlib.metadata import version

MARKER = "QUANTGATE-BACKEND "
VERSIONED = {"gptqmodel": ("gptqmodel", "torch", "transformers"), "bitsandbytes": ("bitsandbytes", "torch", "transformers")}


def say(stage: str, **fields: object) -> None:
    sys.stdout.write(MARKER + json.dumps({"stage": stage, **fields}) + "\n")
    sys.stdout.flush()


def seeded(seed: int) -> None:
    import numpy
    import torch

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def calibration_rows(job: dict, tokenizer) -> list[dict]:
    """The calibration texts (the product resolved and hashed them), tokenized and cut to max_seq_length."""
    calibration = job["calibration"]
    with open(calibration["texts_file"], encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle if line.strip()]
    rows = []
    for text in texts:
        encoded = tokenizer(text, truncation=True, max_length=int(calibration["max_seq_length"]))
        rows.append({"input_ids": list(encoded["input_ids"]), "attention_mask": list(encoded["attention_mask"])})
    return rows


def run_gptqmodel(job: dict) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    config = dict(job["config"])
    say("loading", model=job["model_dir"])
    model = GPTQModel.load(job["model_dir"], QuantizeConfig(**config))
    rows = calibration_rows(job, model.tokenizer)
    say("quantizing", samples=len(rows))
    model.quantize(rows, batch_size=1)
    say("saving")
    model.save(job["out_dir"])


def run_bitsandbytes(job: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    config = dict(job["config"])
    skip = config.pop("skip_modules", [])
    if "bnb_4bit_compute_dtype" in config:
        config["bnb_4bit_compute_dtype"] = getattr(torch, config["bnb_4bit_compute_dtype"])
    say("loading", model=job["model_dir"])
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    quantization = BitsAndBytesConfig(**config, llm_int8_skip_modules=skip or None)
    say("quantizing", samples=0)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], quantization_config=quantization, dtype="auto")
    say("saving")
    model.save_pretrained(job["out_dir"])
    tokenizer.save_pretrained(job["out_dir"])


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as handle:
        job = json.load(handle)
    os.chdir(job["workdir"])  # libraries that write into the working folder (GPTQModel's ./logs) write into the caller's
    started = time.perf_counter()
    seeded(int((job.get("calibration") or {}).get("seed", 0)))
    {"gptqmodel": run_gptqmodel, "bitsandbytes": run_bitsandbytes}[job["backend"]](job)
    versions = {name: version(name) for name in VERSIONED[job["backend"]]}
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    say("done", seconds=round(time.perf_counter() - started, 3), versions=versions, peak_bytes=peak_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
