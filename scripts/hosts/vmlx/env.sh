#!/usr/bin/env bash
# Create .venvs/vmlx-1.6.81: vMLX 1.6.81 (`vmlx serve`), resolved by pip as a user's
# `pip install vmlx==1.6.81` resolves it on Linux (measured: mlx-vlm 0.7.10, transformers 5.25.0,
# a CUDA torch + torchvision that run on CPU here), with two changes:
#   mlx-lm==0.31.3   with mlx-lm 0.32 vMLX cannot start for any model (it imports
#                    SequenceStateMachine, which 0.32 no longer has): a host defect, avoided by
#                    the pin (docs/hosts.md)
#   mlx[cpu]         Linux needs the CPU backend package; vMLX only asks for `mlx`
# and compass-compat installed editable (--no-deps) on top. Multi-GB (torch): build it niced.
# Usage: scripts/hosts/vmlx/env.sh   (PYTHON=python3.x to choose the interpreter)
ENV_NAME=vmlx-1.6.81
INSTALL=("vmlx==1.6.81" "mlx-lm==0.31.3" "mlx[cpu]")
REQUIRE="vmlx_engine mlx_vlm mlx_lm torch -- vmlx"
REPORT_NAMES="vmlx mlx mlx-cpu mlx-vlm mlx-lm transformers torch torchvision"
source "$(dirname "$0")/../common/env.sh"
