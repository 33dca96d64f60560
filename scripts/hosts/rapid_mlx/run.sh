#!/usr/bin/env bash
# Rapid-MLX end to end in one command (scripts/hosts/common/run.sh).
# Usage: scripts/hosts/rapid_mlx/run.sh [e2e.py args, e.g. --source DIR]
source "$(dirname "$0")/../common/run.sh"
