#!/usr/bin/env bash
# vmlx end to end in one command: build (or reuse) .venvs/vmlx-1.6.81 with scripts/hosts/vmlx/env.sh, then
# run tests/test_host_e2e.py's vmlx case there (scripts/hosts/vmlx/e2e.py against
# `python -m compass_compat generate`). Usage: scripts/hosts/vmlx/run.sh [e2e.py args, e.g. --source DIR]
# Output: build/hosts/vmlx/{e2e.log,serve-*.log,results.json,table.md,pytest.xml}. Exit 0 only if every request is equal.
HOST=vmlx
ENV_DIR="$(cd "$(dirname "$0")/../../.." && pwd)/.venvs/vmlx-1.6.81"
source "$(dirname "$0")/../common/run.sh"
