#!/usr/bin/env bash
# oMLX end to end in one command (.ci/run's oMLX stage): build (or reuse) .venvs/omlx-0.7.0 with
# scripts/hosts/omlx/env.sh, then run tests/test_host_e2e.py's omlx case there (scripts/hosts/omlx/e2e.py
# against `python -m compass_compat generate`). Usage: scripts/hosts/omlx/run.sh [e2e.py args, e.g. --git-rev HEAD]
# Output: build/hosts/omlx/{e2e.log,serve-*.log,results.json,table.md,pytest.xml}. Exit 0 only if every request is equal.
HOST=omlx
ENV_DIR="$(cd "$(dirname "$0")/../../.." && pwd)/.venvs/omlx-0.7.0"
source "$(dirname "$0")/../common/run.sh"
