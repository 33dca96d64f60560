#!/usr/bin/env bash
# Create .venvs/vmlx-1.6.81: vMLX 1.6.81 (`vmlx serve`), resolved by pip as a user's
# `pip install vmlx==1.6.81` resolves it on Linux (measured: mlx-vlm 0.7.10, transformers 5.25.0,
# a CUDA torch + torchvision that run on CPU here), with two changes:
#   mlx-lm==0.31.3   with mlx-lm 0.32 vMLX cannot start for any model (it imports
#                    SequenceStateMachine, which 0.32 no longer has): a host defect, avoided by
#                    the pin (docs/hosts.md)
#   mlx[cpu]         Linux needs the CPU backend package; vMLX only asks for `mlx`
# and compass-compat installed editable (--no-deps) on top. mlx-vlm 0.7.10 ships its own
# cohere_compass; the recorded verdicts make the vendored one live there (no flag).
# Multi-GB (torch); build it niced, one environment at a time.
#
# Usage: scripts/hosts/vmlx/env.sh   (PYTHON=python3.x to choose the interpreter)
set -euo pipefail
HOST=vmlx
HOST_SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
source "$(dirname "$0")/../common/env.sh"
ENV_DIR="$root/.venvs/vmlx-1.6.81"
SPEC="vmlx==1.6.81 mlx-lm==0.31.3 mlx[cpu]"
REPORT_NAMES="vmlx mlx mlx-cpu mlx-vlm mlx-lm transformers torch torchvision"

host_install() {
  "${pip[@]}" install -q "${cflags[@]}" "vmlx==1.6.81" "mlx-lm==0.31.3" "mlx[cpu]"
}

host_check() {
  require_host vmlx_engine mlx_vlm mlx_lm torch -- vmlx
}

build_host_env
