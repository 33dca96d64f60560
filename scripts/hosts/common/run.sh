# Shared body of scripts/hosts/<host>/run.sh (sourced, not run): build (or reuse) the host's
# environment with its env.sh, then run tests/test_host_e2e.py's case of the host there, which runs
# scripts/hosts/<host>/e2e.py and prints its table. Exit 0 only if every request is equal.
# The run.sh's arguments go to e2e.py. Output: build/hosts/<host>/{e2e.log,serve-*.log,results.json,table.md,pytest.xml}.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
HOST="$(basename "$(cd "$(dirname "$0")" && pwd)")"
ENV_DIR="$root/.venvs/$(sed -n 's/^ENV_NAME=//p' "$root/scripts/hosts/$HOST/env.sh")"
start=$SECONDS
bash "$root/scripts/hosts/$HOST/env.sh"
mkdir -p "$root/build/hosts/$HOST"
cd "$root"
rc=0
HOST_E2E_ARGS="$*" "$ENV_DIR/bin/python" -m pytest "tests/test_host_e2e.py::test_host_answers_equal_compass_compat_generate[$HOST]" -q -rs -s -p no:cacheprovider \
  --junitxml "$root/build/hosts/$HOST/pytest.xml" || rc=$?
echo "[run-$HOST] done in $((SECONDS - start)) s (exit $rc); log build/hosts/$HOST/e2e.log, table build/hosts/$HOST/table.md"
exit $rc
