#!/usr/bin/env bash
# omni end to end in one command: build (or reuse) .venvs/omni-0.5.3 with scripts/hosts/omni/env.sh, then
# run tests/test_host_e2e.py's omni case there (scripts/hosts/omni/e2e.py: what a user of mlx-omni-server
# 0.5.3 gets with the opt-in, checked against docs/hosts.md). Usage: scripts/hosts/omni/run.sh [e2e.py args]
# Output: build/hosts/omni/{e2e.log,serve-*.log,results.json,table.md,pytest.xml}. Exit 0 only if every check holds.
HOST=omni
ENV_DIR="$(cd "$(dirname "$0")/../../.." && pwd)/.venvs/omni-0.5.3"
source "$(dirname "$0")/../common/run.sh"
