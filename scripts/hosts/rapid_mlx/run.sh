#!/usr/bin/env bash
# rapid_mlx end to end in one command: build (or reuse) .venvs/rapid_mlx-0.16.10 with scripts/hosts/rapid_mlx/env.sh, then
# run tests/test_host_e2e.py's rapid_mlx case there (scripts/hosts/rapid_mlx/e2e.py against
# `python -m compass_compat generate`). Usage: scripts/hosts/rapid_mlx/run.sh [e2e.py args, e.g. --source DIR]
# Output: build/hosts/rapid_mlx/{e2e.log,serve-*.log,results.json,table.md,pytest.xml}. Exit 0 only if every request is equal.
HOST=rapid_mlx
ENV_DIR="$(cd "$(dirname "$0")/../../.." && pwd)/.venvs/rapid_mlx-0.16.10"
source "$(dirname "$0")/../common/run.sh"
