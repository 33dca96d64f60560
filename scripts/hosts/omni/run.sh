#!/usr/bin/env bash
# mlx-omni-server (what a user gets, as docs/hosts.md says) end to end in one command (scripts/hosts/common/run.sh).
# Usage: scripts/hosts/omni/run.sh [e2e.py args, e.g. --source DIR]
source "$(dirname "$0")/../common/run.sh"
