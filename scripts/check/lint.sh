#!/usr/bin/env bash
# Lint and format check ([tool.ruff] in pyproject.toml) with a pinned ruff in its own venv
# (.venvs/tools), so every machine checks with the same rules and version.
#   bash scripts/check/lint.sh          # check (CI)
#   bash scripts/check/lint.sh --fix    # sort imports, apply safe fixes, format
set -euo pipefail
cd "$(dirname "$0")/../.."
RUFF_VERSION=0.17.6
tools=.venvs/tools
if [ ! -x "$tools/bin/ruff" ] || [ "$("$tools/bin/ruff" --version)" != "ruff $RUFF_VERSION" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install --quiet --disable-pip-version-check "ruff==$RUFF_VERSION"
fi
if [ "${1:-}" = "--fix" ]; then
  "$tools/bin/ruff" check --fix .
  "$tools/bin/ruff" format .
else
  "$tools/bin/ruff" check .
  "$tools/bin/ruff" format --check .
fi
# The import directions (scripts/README.md): scripts/ never imports tests/, nothing shipped imports either.
python3 scripts/check/imports.py
