#!/usr/bin/env bash
# A CI/CD promotion step: gate a quantized artifact against its 16-bit baseline; the exit code decides.
#
#   scripts/ci_gate_example.sh ARTIFACT BASELINE [more `quantize gate` options, e.g. --eval-sets a,b]
#
# Exit codes (those of `quantize gate`): 0 promoted (deploy), 1 rejected by the gate (block),
# 2 no decision (bad input, vLLM or lm-eval failed: fix and rerun). Only the exit code and gate.json are
# relied on; gate.json's fields are described in docs/gate-json.md. See docs/ci-cd.md.
# QUANTIZE (default: `quantize` on PATH, else .venv/bin/quantize) and PYTHON (default: python3) can be set.
set -uo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 ARTIFACT BASELINE [quantize gate options...]" >&2
  exit 2
fi
artifact=$1
baseline=$2
shift 2
quantize=${QUANTIZE:-$(command -v quantize || echo "$(dirname "$0")/../.venv/bin/quantize")}
python=${PYTHON:-python3}

outcome=$(mktemp)
trap 'rm -f "$outcome"' EXIT

# Progress goes to stderr (the CI log); --json puts the outcome, with the path of gate.json, on stdout.
"$quantize" gate --artifact "$artifact" --baseline "$baseline" --json "$@" >"$outcome"
code=$?
if [ "$code" -ne 0 ] && [ "$code" -ne 1 ]; then
  echo "gate: NO DECISION (exit $code): the error is on the line starting 'quantize: error:' above" >&2
  exit 2
fi

gate_json=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["gate_json"])' "$outcome") || {
  echo "gate: exit $code but no readable outcome on stdout" >&2
  exit 2
}

# The verdict in gate.json must agree with the exit code; print it with the reasons and warnings.
"$python" - "$gate_json" "$code" <<'EOF'
import json
import sys

path, code = sys.argv[1], int(sys.argv[2])
gate = json.load(open(path))["gate"]
expected = {"promoted": 0, "rejected": 1}[gate["verdict"]]
print(f"verdict: {gate['verdict']} (exit {code})")
print(f"evidence: {path}")
for line in gate["reasons"]:
    print(f"reason: {line}")
for line in gate["warnings"]:
    print(f"warning: {line}")
for s in gate["sets"]:
    print(f"set {s['eval_set']}: {s['metric']} {s['baseline_score']:.1f} -> {s['candidate_score']:.1f} "
          f"(delta {s['delta']:+.2f} points, 95% CI [{s['ci_low']:.2f}, {s['ci_high']:.2f}]) {'pass' if s['passed'] else 'FAIL'}")
if expected != code:
    print(f"gate.json says {gate['verdict']} but quantize exited {code}", file=sys.stderr)
    sys.exit(2)
EOF
check=$?
[ "$check" -ne 0 ] && exit 2
exit "$code"
