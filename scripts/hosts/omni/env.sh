#!/usr/bin/env bash
# Create .venvs/omni-0.5.3: mlx-omni-server 0.5.3 (`mlx-omni-server`), resolved by pip as a user's
# `pip install mlx-omni-server==0.5.3 mlx[cpu]` resolves it on Linux (mlx-vlm 0.4.4, mlx-lm 0.31.3,
# transformers 5.8.1; mlx[cpu]: Linux needs the CPU backend package), with one change:
#   mlx 0.31.1 + mlx-cuda-13  -> mlx[cpu]==0.31.2   On Linux its image stack (mflux) asks for
#                               mlx[cuda13] < 0.32, and mlx-cuda-13 has no 0.31.2, so pip settles on
#                               mlx 0.31.1, with which mlx-lm 0.31.3 cannot import
#                               (mx.new_thread_local_stream); the host's own macOS requirement is
#                               mlx>=0.31.2,<0.32. mlx-cuda-13 is removed (its CUDA libraries stay,
#                               unused); mflux's requirement is left unmet (off the chat path).
# and compass-compat installed editable (--no-deps) on top. Multi-GB (torch, CUDA libraries).
# Usage: scripts/hosts/omni/env.sh   (PYTHON=python3.x to choose the interpreter)
ENV_NAME=omni-0.5.3
SPEC="mlx-omni-server==0.5.3 mlx[cpu] then mlx[cpu]==0.31.2 without mlx-cuda-13"
REQUIRE="mlx_omni_server mlx_vlm mlx_lm -- mlx-omni-server"
REPORT_NAMES="mlx-omni-server mlx mlx-cpu mlx-vlm mlx-lm transformers"

host_install() {
  local first=()
  if [ ${#cflags[@]} -gt 0 ]; then
    # The recorded mlx 0.31.2 is this script's change: the host's own resolution cannot have it.
    grep -v -E '^(mlx|mlx-cpu)==' "$CONSTRAINTS" > "$ENV_DIR/constraints-resolve.txt"
    first=(-c "$ENV_DIR/constraints-resolve.txt")
  fi
  "${pip[@]}" install -q "${first[@]}" "mlx-omni-server==0.5.3" "mlx[cpu]"
  "${pip[@]}" uninstall -q -y mlx-cuda-13
  "${pip[@]}" install -q --no-deps "mlx==0.31.2" "mlx-cpu==0.31.2"
}

host_check() {
  "$ENV_DIR/bin/python" -c "import mlx_lm, mlx.core as mx; print('[omni-env] mlx', mx.__version__, mx.default_device())"
}

source "$(dirname "$0")/../common/env.sh"
