#!/usr/bin/env bash
# Create .venvs/rapid_mlx-0.16.10: Rapid-MLX 0.16.10 with its `vision` extra, resolved by pip as a
# user's `pip install "rapid-mlx[vision]==0.16.10"` resolves it (measured: mlx-vlm 0.7.2,
# mlx-lm 0.31.3, transformers 5.15.1, and a CUDA torch + torchvision that run on CPU here), plus
# `mlx[cpu]` in the range Rapid-MLX requires (Linux needs the CPU backend package), and
# compass-compat installed editable (--no-deps) on top. Multi-GB (torch): build it niced.
# Usage: scripts/hosts/rapid_mlx/env.sh   (PYTHON=python3.x to choose the interpreter)
ENV_NAME=rapid_mlx-0.16.10
INSTALL=("rapid-mlx[vision]==0.16.10" "mlx[cpu]>=0.32.1,<0.33")
REQUIRE="rapid_mlx mlx_vlm mlx_lm torch -- rapid-mlx"
REPORT_NAMES="rapid-mlx mlx mlx-cpu mlx-vlm mlx-lm transformers torch torchvision"
source "$(dirname "$0")/../common/env.sh"
