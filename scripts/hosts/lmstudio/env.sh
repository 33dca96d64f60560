#!/usr/bin/env bash
# Create .venvs/lmstudio-08f0c07: LM Studio's MLX engine (lmstudio-ai/mlx-engine at 08f0c07, the
# unmodified snapshot in ../shared/hosts/, not on the package registry) with its requirements as
# the engine pins them, and compass-compat installed editable (--no-deps) on top.
#
# The engine's requirements.txt is a full freeze; it is installed as it is except where Linux or
# the registry cannot follow it (shared/hosts/README.md):
#   mlx==0.32.0 + mlx-metal  -> mlx[cpu]==0.32.0   (no mlx-metal on Linux)
#   mlx-vlm @ git 321514d    -> mlx-vlm==0.6.12    (that commit is tag v0.6.12)
#   mlx-lm @ git 2c008fd     -> mlx-lm==0.31.3     (the pin is 0.31.3 plus 13 commits)
#   outlines @ git 222ca17   -> outlines==1.1.1    (plus 2 doc commits)
#   torchvision==0.24.0      -> torch==2.13.0 CPU  (mlx_engine/utils/set_seed.py imports torch;
#                                                   nothing on this path needs torchvision)
# The snapshot is unpacked to .venvs/lmstudio-08f0c07/src and put on sys.path by a .pth file, so
# `python -m mlx_engine.server` runs from anywhere. Never edited.
# Usage: scripts/hosts/lmstudio/env.sh   (PYTHON=python3.x; LMSTUDIO_SNAPSHOT=archive to override)
ENV_NAME=lmstudio-08f0c07
SNAPSHOT="${LMSTUDIO_SNAPSHOT:-$(dirname "$0")/../../../../shared/hosts/mlx-engine-08f0c07.tar.gz}"
SPEC="mlx-engine 08f0c07 $(sha1sum "$SNAPSHOT" | cut -c1-12) mlx[cpu]==0.32.0 mlx-vlm==0.6.12 mlx-lm==0.31.3 outlines==1.1.1 torch==2.13.0"
REQUIRE="mlx_engine.server mlx_vlm mlx_lm outlines torch"
REPORT_NAMES="mlx mlx-cpu mlx-vlm mlx-lm transformers torch outlines"

host_install() {
  local src="$ENV_DIR/src"
  mkdir -p "$src"
  tar -xzf "$SNAPSHOT" -C "$src"
  local engine
  engine="$(ls -d "$src"/mlx-engine-*/ | head -1)"
  engine="${engine%/}"
  [ -f "$engine/mlx_engine/server/__main__.py" ] || [ -d "$engine/mlx_engine/server" ] || {
    echo "[$HOST-env] error: no mlx_engine/server in $SNAPSHOT" >&2
    exit 1
  }
  "$ENV_DIR/bin/python" -c "import site, sys; open(site.getsitepackages()[0] + '/lmstudio_mlx_engine.pth', 'w').write(sys.argv[1] + '\n')" "$engine"
  # The engine's requirements with the substitutions above.
  sed -E \
    -e 's/^mlx==(.*)$/mlx[cpu]==\1/' \
    -e '/^mlx-metal==/d' \
    -e 's/^mlx-vlm @ .*$/mlx-vlm==0.6.12/' \
    -e 's/^mlx-lm @ .*$/mlx-lm==0.31.3/' \
    -e 's/^outlines @ .*$/outlines==1.1.1/' \
    -e 's/^torchvision==.*$/torch==2.13.0/' \
    "$engine/requirements.txt" > "$ENV_DIR/requirements-linux.txt"
  "${pip[@]}" install -q "${cflags[@]}" -r "$ENV_DIR/requirements-linux.txt"
}

host_check() {
  "$ENV_DIR/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda and f'[lmstudio-env] error: torch {torch.__version__} is a CUDA build; the engine env uses the CPU one')"
}

source "$(dirname "$0")/../common/env.sh"
