#!/usr/bin/env bash
# Create .venvs/omlx-0.7.0: oMLX's engine (PyPI `flyto-mlx` 0.7.0, package `omlx`) on CPU-only
# mlx, with compass-compat installed editable (--no-deps) on top.
#
# torch: flyto-mlx 0.7.0 requires xgrammar, and xgrammar requires torch (a multi-GB CUDA build
# plus triton on Linux). No other requirement of flyto-mlx pulls torch. oMLX imports xgrammar
# only lazily and degrades without it (json_schema / structured output is then not enforced;
# the server logs "xgrammar not importable"), so flyto-mlx is installed with --no-deps and its
# own requirements are installed from its metadata *minus xgrammar*. The script fails if torch
# ends up importable anyway.
# Usage: scripts/hosts/omlx/env.sh            (PYTHON=python3.x to choose the interpreter)
ENV_NAME=omlx-0.7.0
SPEC="flyto-mlx==0.7.0 mlx[cpu]==0.32.3"
REQUIRE="omlx -- omlx"
REPORT_NAMES="flyto-mlx mlx mlx-cpu mlx-vlm mlx-lm transformers"

host_install() {
  "${pip[@]}" install -q "${cflags[@]}" --no-deps "flyto-mlx==0.7.0"
  # Its requirements (no extras), from its own metadata, minus xgrammar.
  mapfile -t reqs < <("$ENV_DIR/bin/python" - <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement  # a fresh venv has only pip's copy
import sys
for line in md.requires("flyto-mlx") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra (mcp, audio, bundle, dev, ...) or another platform
    if req.name.lower() == "xgrammar":
        print(f"[omlx-env] leaving out {req} (pulls torch)", file=sys.stderr)
        continue
    print(str(req))
PY
)
  echo "[omlx-env] expected from pip below: 'flyto-mlx 0.7.0 requires xgrammar>=0.1.32, which is not installed'"
  "${pip[@]}" install -q "${cflags[@]}" "mlx[cpu]==0.32.3" "${reqs[@]}"
}

host_check() {
  if "$ENV_DIR/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    echo "[omlx-env] error: torch is importable in $ENV_DIR; something pulled it" >&2
    exit 1
  fi
  "$ENV_DIR/bin/omlx" --help > /dev/null
}

source "$(dirname "$0")/../common/env.sh"
