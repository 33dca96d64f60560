#!/usr/bin/env bash
# oMLX end to end in one command: build (or reuse) .venvs/omlx-0.7.0, then run
# tests/test_omlx_e2e.py there, which runs scripts/hosts/omlx/e2e.py (`omlx serve` on 127.0.0.1 with
# the startup hook vs `python -m compass_compat generate`) and prints its table.
# Usage: scripts/hosts/omlx/run.sh [omlx_e2e.py args, e.g. --git-rev HEAD]
# Output: build/omlx/{e2e.log,serve.log,results.json,pytest.xml}. Exit 0 only if every request matches.
set -euo pipefail
root="$(cd "$(dirname "$0")/../../.." && pwd)"
start=$SECONDS
bash "$root/scripts/hosts/omlx/env.sh"
mkdir -p "$root/build/omlx"
cd "$root"
rc=0
OMLX_E2E_ARGS="$*" "$root/.venvs/omlx-0.7.0/bin/python" -m pytest tests/test_omlx_e2e.py -q -rs -s \
  --junitxml "$root/build/omlx/pytest.xml" || rc=$?
echo "[run-omlx] done in $((SECONDS - start)) s (exit $rc); log build/omlx/e2e.log"
exit $rc
