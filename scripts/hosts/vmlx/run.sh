#!/usr/bin/env bash
# vMLX end to end in one command (scripts/hosts/common/run.sh).
# Usage: scripts/hosts/vmlx/run.sh [e2e.py args, e.g. --source DIR]
source "$(dirname "$0")/../common/run.sh"
