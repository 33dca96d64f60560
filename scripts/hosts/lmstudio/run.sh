#!/usr/bin/env bash
# LM Studio's engine end to end in one command (scripts/hosts/common/run.sh).
# Usage: scripts/hosts/lmstudio/run.sh [e2e.py args, e.g. --source DIR]
source "$(dirname "$0")/../common/run.sh"
