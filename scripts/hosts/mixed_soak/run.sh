#!/usr/bin/env bash
# The mixed-batch soak (scripts/hosts/common/mixed_soak.py) on every pin whose server batches:
# mlx-vlm's own server in the matrix environments 0.6.12 and 0.7.10 (vendored package live),
# each until the full cross product was seen and 300 requests went out (40 minutes at most).
# Writes build/hosts/mixed_soak/<pin>.md and a summary line per pin to build/hosts/mixed_soak/e2e.log.
set -uo pipefail
root="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$root"
out=build/hosts/mixed_soak
mkdir -p "$out"
: >"$out/e2e.log"
rc=0
for pin in 0.6.12 0.7.10; do
  bash scripts/env/build.sh "$pin" >"$out/env-$pin.log" 2>&1 || { echo "[mixed_soak-e2e] $pin: environment failed" | tee -a "$out/e2e.log"; rc=1; continue; }
  ".venvs/mlxvlm-$pin/bin/python" -m scripts.hosts.common.mixed_soak \
    --requests 300 --minutes 40 --out "$out/$pin.md" >"$out/soak-$pin.log" 2>&1
  pin_rc=$?
  echo "[mixed_soak-e2e] $pin: exit $pin_rc; $(sed -n 3p "$out/$pin.md") (requests equal as alone unless listed there)" | tee -a "$out/e2e.log"
  [ "$pin_rc" -eq 0 ] || rc=1
done
exit $rc
