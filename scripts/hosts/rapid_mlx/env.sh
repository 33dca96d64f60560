#!/usr/bin/env bash
# Create .venvs/rapid_mlx-0.16.10: Rapid-MLX 0.16.10 with its `vision` extra, resolved by pip as a
# user's `pip install "rapid-mlx[vision]==0.16.10"` resolves it (measured: mlx-vlm 0.7.2,
# mlx-lm 0.31.3, transformers 5.15.1, and a CUDA torch + torchvision that run on CPU here), plus
# `mlx[cpu]` in the range Rapid-MLX requires (Linux needs the CPU backend package), and
# compass-compat installed editable (--no-deps) on top. mlx-vlm 0.7.2 ships its own
# cohere_compass; the recorded verdicts make the vendored one live there (no flag).
# Multi-GB (torch); build it niced, one environment at a time.
#
# Usage: scripts/hosts/rapid_mlx/env.sh   (PYTHON=python3.x to choose the interpreter)
set -euo pipefail
HOST=rapid_mlx
HOST_SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
source "$(dirname "$0")/../common/env.sh"
ENV_DIR="$root/.venvs/rapid_mlx-0.16.10"
SPEC="rapid-mlx[vision]==0.16.10 mlx[cpu]>=0.32.1,<0.33"
REPORT_NAMES="rapid-mlx mlx mlx-cpu mlx-vlm mlx-lm transformers torch torchvision"

host_install() {
  "${pip[@]}" install -q "${cflags[@]}" "rapid-mlx[vision]==0.16.10" "mlx[cpu]>=0.32.1,<0.33"
}

host_check() {
  require_host rapid_mlx mlx_vlm mlx_lm torch -- rapid-mlx
}

build_host_env
