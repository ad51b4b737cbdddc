"""Quantize backends: the toolkit that turns a recipe into a vLLM-servable artifact (docs/backends.md).

- `llm-compressor` (the default): in .venv, in-process (pipelines.quantize.oneshot), compressed-tensors checkpoints.
- `gptqmodel`: GPTQModel, the maintained successor of the archived AutoGPTQ; GPTQ checkpoints (vLLM's `gptq` method).
- `bitsandbytes`: bitsandbytes through transformers; LLM.int8 and NF4 checkpoints (vLLM's `bitsandbytes` method).

Every backend but the default runs in an environment of its own (scripts/setup_env.sh NAME, pinned and locked like
the others, built on first use), as a subprocess of backend_tool.py: its pins conflict with .venv's (GPTQModel needs
torch >= 2.14.1 and transformers >= 5.20.2) and it is never imported into .venv. Each backend compiles the recipe's
layer-wise schemes (the plan pipelines.quantize.compiler resolved and checked against vLLM's kernels) into its own
configuration, or refuses the first field it cannot express, in one line, before any model is loaded.
"""
