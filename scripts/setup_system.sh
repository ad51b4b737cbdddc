#!/usr/bin/env bash
# The Debian packages the product drives as real parts (docs/deploy.md): Prometheus (and its promtool) for the
# deployment files and `quantize watch`, nginx for `quantize serve`, PostgreSQL 15 for a shared registry
# (QUANTGATE_REGISTRY=postgresql://..., docs/registry.md; the tests start throwaway clusters with its initdb) and
# Chromium, which opens the HTML reports headless (`quantize report`, the tests' screenshots). Installs what is missing, once; a second run
# checks and returns in milliseconds. Needs root (apt-get) the first time; without it, says what to run.
set -euo pipefail
want=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || want+=(prometheus)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || want+=(nginx)
command -v initdb >/dev/null 2>&1 || compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || want+=(postgresql)
command -v chromium >/dev/null 2>&1 || want+=(chromium)
[ ${#want[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "setup: the system packages ${want[*]} are missing; install them as root: apt-get install -y ${want[*]}" >&2
  exit 2
fi
echo "setup: installing Debian packages ${want[*]} (first run only)"
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get install -y -q --no-install-recommends "${want[@]}" >"$log" 2>&1 || { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q --no-install-recommends "${want[@]}" >>"$log" 2>&1; }; }; then
  echo "setup: apt-get could not install ${want[*]}: $(grep -iE 'E:|error' "$log" | tail -n1)" >&2
  rm -f "$log"
  exit 2
fi
rm -f "$log"
# The packages' own services are not used (the product starts its own processes, on loopback, per command).
for service in prometheus nginx postgresql; do
  if command -v service >/dev/null 2>&1; then service "$service" stop >/dev/null 2>&1 || true; fi
done
echo "setup: ${want[*]} installed in $(( $(date +%s) - start )) s"
