#!/usr/bin/env bash
# Create .venvs/omlx-0.7.0: oMLX's engine (PyPI `flyto-mlx` 0.7.0, package `omlx`) on CPU-only
# mlx, with compass-compat installed editable (--no-deps) on top. Idempotent: the env is rebuilt
# only when this script, pyproject.toml or the committed constraints file change.
#
# torch: flyto-mlx 0.7.0 requires xgrammar, and xgrammar requires torch (a multi-GB CUDA build
# plus triton on Linux). No other requirement of flyto-mlx pulls torch. oMLX imports xgrammar
# only lazily and degrades without it (json_schema / structured output is then not enforced;
# the server logs "xgrammar not importable"), so flyto-mlx is installed with --no-deps and its
# own requirements are installed from its metadata *minus xgrammar*. The script fails if torch
# ends up importable anyway.
#
# Reproducibility: after a build the exact versions (`pip freeze --exclude-editable`) go to
# scripts/hosts/omlx/constraints.txt (committed); when that file exists, every install runs
# with `-c` it, so a rebuild resolves the same versions.
#
# Usage: scripts/hosts/omlx/env.sh            (PYTHON=python3.x to choose the interpreter)
set -euo pipefail
root="$(cd "$(dirname "$0")/../../.." && pwd)"
py="${PYTHON:-python3}"
env="$root/.venvs/omlx-0.7.0"
constraints="$root/scripts/hosts/omlx/constraints.txt"
stamp="$env/.compass-compat-stamp"
FLYTO="flyto-mlx==0.7.0"
MLX="mlx[cpu]==0.32.3"
# Requirements of flyto-mlx that are left out (see above), one regex over the requirement name.
SKIP_RE='^(xgrammar)$'

want_stamp() {
  local c="none"
  [ -f "$constraints" ] && c="$(sha1sum "$constraints" | cut -c1-12)"
  echo "$FLYTO $MLX | script $(sha1sum "$0" | cut -c1-12) | pyproject $(sha1sum "$root/pyproject.toml" | cut -c1-12) | constraints $c"
}

report() {
  "$env/bin/python" - <<'EOF'
import importlib.metadata as md, importlib.util
names = ["flyto-mlx", "mlx", "mlx-cpu", "mlx-vlm", "mlx-lm", "transformers"]
print("[omlx-env] " + "  ".join(f"{n} {md.version(n)}" for n in names))
print("[omlx-env] torch importable:", importlib.util.find_spec("torch") is not None,
      "| xgrammar importable:", importlib.util.find_spec("xgrammar") is not None)
EOF
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(want_stamp)" ] && [ -x "$env/bin/omlx" ]; then
  echo "[omlx-env] up to date ($env)"
  report
  exit 0
fi

echo "[omlx-env] creating $env"
rm -rf "$env"
"$py" -m venv "$env"
pip=("$env/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
cflags=()
if [ -f "$constraints" ]; then
  echo "[omlx-env] installing with -c ${constraints#$root/}"
  cflags=(-c "$constraints")
else
  echo "[omlx-env] no ${constraints#$root/} yet: resolving fresh (it is written afterwards)"
fi

# 1. flyto-mlx itself, without its requirements.
"${pip[@]}" install -q "${cflags[@]}" --no-deps "$FLYTO"
# 2. Its requirements (no extras), from its own metadata, minus the torch puller(s).
mapfile -t reqs < <("$env/bin/python" - "$SKIP_RE" <<'EOF'
import importlib.metadata as md, re, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
skip = re.compile(sys.argv[1])
for line in md.requires("flyto-mlx") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra (mcp, audio, bundle, dev, ...) or another platform
    if skip.match(req.name.lower()):
        print(f"[omlx-env] leaving out {req} (pulls torch)", file=sys.stderr)
        continue
    print(str(req))
EOF
)
echo "[omlx-env] expected from pip below: 'flyto-mlx 0.7.0 requires xgrammar>=0.1.32, which is not installed'"
"${pip[@]}" install -q "${cflags[@]}" "$MLX" "${reqs[@]}" pytest
# 3. compass-compat from this checkout (its .pth startup hook included).
"${pip[@]}" install -q --no-deps -e "$root"

if "$env/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  echo "[omlx-env] error: torch is importable in $env; something pulled it" >&2
  exit 1
fi
"$env/bin/omlx" --help > /dev/null

mkdir -p "$(dirname "$constraints")"
{
  echo "# Exact versions of .venvs/omlx-0.7.0, written by scripts/hosts/omlx/env.sh (pip freeze --exclude-editable)."
  echo "# flyto-mlx is installed --no-deps and xgrammar (-> torch) is left out: see the script."
  "${pip[@]}" freeze --exclude-editable
} > "$constraints.tmp"
mv "$constraints.tmp" "$constraints"
echo "[omlx-env] wrote ${constraints#$root/}"
want_stamp > "$stamp"
report
