# The two commands a fresh machine needs: `make demo` and `make test`. Both set up what is missing first.
SHELL := /bin/bash
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo demo-reject test test-unit test-integration clean-artifacts bench-gate

setup:
	@scripts/setup_env.sh project
	@scripts/setup_env.sh serve

## The main job on the shipped demo model: quantize with w8a8, serve on vLLM, gate against 16-bit, promote.
demo: setup
	.venv/bin/quantize --recipe w8a8

## The negative control: an aggressive recipe the gate must reject (exit code 1 is the expected outcome).
demo-reject: setup
	.venv/bin/quantize --recipe aggressive; test $$? -eq 1

test: setup
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests/unit

test-integration: setup
	$(PY) -m pytest tests/integration

clean-artifacts:
	find artifacts -mindepth 1 ! -name README.md -exec rm -rf {} +

## Operating characteristics of the gate policy (P(promote) by true drop and noise; not a test).
bench-gate: setup
	$(PY) -m pipelines.benchmarks.gate_oc --policy $(or $(POLICY),policies/default.yaml)
