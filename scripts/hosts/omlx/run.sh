#!/usr/bin/env bash
# oMLX's engine (.ci/run's oMLX stage) end to end in one command (scripts/hosts/common/run.sh).
# Usage: scripts/hosts/omlx/run.sh [e2e.py args, e.g. --git-rev HEAD]
source "$(dirname "$0")/../common/run.sh"
