#!/usr/bin/env bash
# lmstudio end to end in one command: build (or reuse) .venvs/lmstudio-08f0c07 with scripts/hosts/lmstudio/env.sh, then
# run tests/test_host_e2e.py's lmstudio case there (scripts/hosts/lmstudio/e2e.py against
# `python -m compass_compat generate`). Usage: scripts/hosts/lmstudio/run.sh [e2e.py args, e.g. --source DIR]
# Output: build/hosts/lmstudio/{e2e.log,serve-*.log,results.json,table.md,pytest.xml}. Exit 0 only if every request is equal.
HOST=lmstudio
ENV_DIR="$(cd "$(dirname "$0")/../../.." && pwd)/.venvs/lmstudio-08f0c07"
source "$(dirname "$0")/../common/run.sh"
