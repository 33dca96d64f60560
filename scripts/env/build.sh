#!/usr/bin/env bash
# Create one virtual environment per entry of the matrix (scripts/env/pins.sh) under
# .venvs/mlxvlm-<env> (idempotent: rebuilt only when its requirements, pyproject.toml or its
# recorded versions change).
#
# Usage: scripts/env/build.sh [--refresh] [ENV ...]   (default: every environment)
#
# Exact versions. After an environment is resolved from its requirements, the script writes
# `pip freeze --exclude-editable` to scripts/env/constraints/mlxvlm-<env>.txt (commit it). When that
# file exists and was recorded for the same requirements, every install runs with `-c` it, so
# the same commit builds the same environment next month, and the build fails if what got
# installed differs from the record. Resolving afresh (and rewriting the file):
#   scripts/env/build.sh --refresh [ENV ...]      or   MAKE_ENVS_REFRESH=1 (also through
#   scripts/check/matrix.sh). Changing an environment's requirements in scripts/env/pins.sh also
#   resolves afresh, since the file names the requirements it was resolved from.
# PYTHON=python3.x chooses the interpreter the environments are made from.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
source "$root/scripts/env/pins.sh"
refresh="${MAKE_ENVS_REFRESH:-0}"
envs=()
for arg in "$@"; do
  case "$arg" in
    --refresh) refresh=1 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "[envs] unknown option $arg" >&2; exit 2 ;;
    *) envs+=("$arg") ;;
  esac
done
[ "$refresh" = 1 ] || refresh=0
[ ${#envs[@]} -gt 0 ] || envs=("${ALL_ENVS[@]}")
py="${PYTHON:-python3}"

# pip freeze lines with the local version label moved into a comment: PyPI serves no local
# versions, and `torch==2.13.0` matches the local `2.13.0+cpu` build where that is what pip finds.
normalize_freeze() { sed -E 's/^([^ =#]+)==([^+ ]+)\+([^ ]+)$/\1==\2  # resolved as \2+\3/'; }
# The requirement lines of a constraints file, comments and blank lines removed, sorted.
pinned_lines() { sed -E 's/[[:space:]]+#.*$//; /^[[:space:]]*(#|$)/d' | LC_ALL=C sort; }

for name in "${envs[@]}"; do
  reqs="$(env_requirements "$name")"
  env="$(env_dir "$name")"
  constraints="$(env_constraints "$name")"
  rel="${constraints#"$root"/}"
  torch_req=""
  if env_has_torch "$name"; then torch_req="$TORCH_REQUIREMENT"; fi
  # Everything that decides what gets installed, as one line (recorded in the constraints file).
  wanted="${torch_req:+$torch_req ; }$reqs pytest hypothesis"

  use_constraints=0
  if [ "$refresh" = 1 ]; then
    echo "[envs] $name: --refresh: resolving afresh, ${rel} will be rewritten"
  elif [ -f "$constraints" ]; then
    recorded="$(sed -n 's/^# requirements: //p' "$constraints")"
    if [ "$recorded" = "$wanted" ]; then
      use_constraints=1
    else
      echo "[envs] $name: ${rel} was recorded for other requirements; resolving afresh and rewriting it"
      echo "[envs]   recorded: $recorded"
      echo "[envs]   now:      $wanted"
    fi
  fi

  cstamp="none"
  [ $use_constraints = 1 ] && cstamp="$(sha1sum "$constraints" | cut -c1-12)"
  stamp="$env/.compass-compat-stamp"
  want_stamp="$wanted | pyproject $(sha1sum "$root/pyproject.toml" | cut -c1-12) | constraints $cstamp"
  if [ $use_constraints = 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ]; then
    echo "[envs] $name: up to date ($env)"; continue
  fi

  echo "[envs] $name: creating $env"
  cflags=()
  if [ $use_constraints = 1 ]; then
    echo "[envs] $name: installing the recorded versions (-c ${rel})"
    cflags=(-c "$constraints")
  fi
  rm -rf "$env"
  "$py" -m venv "$env"
  "$env/bin/pip" install -q --upgrade pip
  # torch first and pinned, so nothing later can pull a CUDA build.
  if [ -n "$torch_req" ]; then "$env/bin/pip" install -q "${cflags[@]}" "$torch_req"; fi
  # shellcheck disable=SC2086
  "$env/bin/pip" install -q "${cflags[@]}" $reqs pytest hypothesis
  "$env/bin/pip" install -q --no-deps -e "$root"

  frozen="$("$env/bin/pip" freeze --exclude-editable | normalize_freeze)"
  if [ $use_constraints = 1 ]; then
    if ! diff <(pinned_lines < "$constraints") <(pinned_lines <<<"$frozen") > "$env/.constraints-diff"; then
      echo "[envs] $name: the environment differs from ${rel} (< recorded, > installed):" >&2
      cat "$env/.constraints-diff" >&2
      echo "[envs] $name: refresh the record with scripts/env/build.sh --refresh $name" >&2
      exit 1
    fi
    rm -f "$env/.constraints-diff"
  else
    mkdir -p "$(dirname "$constraints")"
    {
      echo "# Exact versions of .venvs/mlxvlm-$name (mlx-vlm $(env_mlx_vlm "$name")), written by scripts/env/build.sh"
      echo "# (pip freeze --exclude-editable) on $("$env/bin/python" -c 'import platform; print(f"Python {platform.python_version()}, {platform.system()} {platform.machine()}")')."
      echo "# scripts/env/build.sh installs with -c this file; refresh: scripts/env/build.sh --refresh $name"
      echo "# requirements: $wanted"
      echo "$frozen"
    } > "$constraints.tmp"
    mv "$constraints.tmp" "$constraints"
    echo "[envs] $name: wrote ${rel} (commit it)"
    want_stamp="$wanted | pyproject $(sha1sum "$root/pyproject.toml" | cut -c1-12) | constraints $(sha1sum "$constraints" | cut -c1-12)"
  fi
  echo "$want_stamp" > "$stamp"
  "$env/bin/python" -c "import importlib.metadata as m; print('[envs] $name:', '  '.join(f'{n} {m.version(n)}' for n in ('mlx', 'mlx-vlm', 'mlx-lm', 'transformers')))"
done
