#!/usr/bin/env bash
# Create one virtual environment per mlx-vlm pin under .venvs/ (idempotent).
# Usage: scripts/make_envs.sh [PIN ...]   (default: every pin of the matrix)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/pins.sh"
pins=("$@")
[ ${#pins[@]} -gt 0 ] || pins=("${ALL_PINS[@]}")
py="${PYTHON:-python3}"
for pin in "${pins[@]}"; do
  env="$root/.venvs/mlxvlm-$pin"
  stamp="$env/.compass-compat-stamp"
  want="$(pin_requirements "$pin") | $(sha1sum "$root/pyproject.toml" | cut -c1-12)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[envs] mlx-vlm $pin: up to date ($env)"; continue
  fi
  echo "[envs] mlx-vlm $pin: creating $env"
  rm -rf "$env"
  "$py" -m venv "$env"
  "$env/bin/pip" install -q --upgrade pip
  # torch first and pinned, so nothing later can pull a CUDA build.
  if pin_has_torch "$pin"; then "$env/bin/pip" install -q "torch==2.13.0"; fi
  # shellcheck disable=SC2046
  "$env/bin/pip" install -q $(pin_requirements "$pin") pytest hypothesis
  "$env/bin/pip" install -q --no-deps -e "$root"
  echo "$want" > "$stamp"
  "$env/bin/python" -c "import mlx_vlm, transformers, mlx.core as mx; print('[envs]', 'mlx-vlm', mlx_vlm.__version__, 'transformers', transformers.__version__)"
done
