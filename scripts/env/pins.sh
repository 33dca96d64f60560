# The mlx-vlm environment matrix: the one place that says what each environment holds.
#
# An environment's name is its mlx-vlm version, plus "-<tag>" when two environments share a
# version (e.g. 0.4.4-tf5.17). It lives in .venvs/mlxvlm-<name>; the exact versions it resolved
# are recorded in scripts/env/constraints/mlxvlm-<name>.txt (scripts/env/build.sh). Each requirement
# set is what a real host resolves (see README "Supported mlx-vlm pins").
ALL_ENVS=(0.4.4 0.4.4-tf5.17 0.6.3 0.6.12 0.7.10 0.7.10-notorch)
# The environment that also holds torch + transformers >= 5.21 (the reference oracle). The matrix
# runs only the tests marked `reference` there (tests/conftest.py); 0.7.10-notorch runs the rest.
REFERENCE_ENV=0.7.10
# torch, installed first and alone in the reference environment, so nothing can pull CUDA.
TORCH_REQUIREMENT="torch==2.13.0"

env_requirements() {
  local common="safetensors numpy pillow"
  case "$1" in
    # mlx-omni-server 0.5.x: mlx-vlm<0.5, mlx-lm>=0.31.2,<0.32, transformers>=5.5,<5.9; mlx<0.32 (darwin)
    0.4.4)        echo "mlx[cpu]>=0.31.2,<0.32 mlx-vlm==0.4.4 mlx-lm>=0.31.2,<0.32 transformers>=5.5,<5.9 $common" ;;
    # mlx-openai-server 1.8.x: mlx-vlm<0.5, mlx-lm>=0.31.3,<0.32, mlx<0.32 (via mflux), transformers 5.17
    0.4.4-tf5.17) echo "mlx[cpu]>=0.31.2,<0.32 mlx-vlm==0.4.4 mlx-lm>=0.31.3,<0.32 transformers==5.17.* $common" ;;
    # oMLX's engine (flyto-mlx 0.7.0) without flyto-mlx itself
    0.6.3)        echo "mlx[cpu]==0.32.3 mlx-vlm==0.6.3 mlx-lm==0.31.3 transformers>=5.12.1,<5.13 $common" ;;
    # last release without cohere_compass; the train extra (datasets) for python -m mlx_vlm.lora
    0.6.12)       echo "mlx[cpu] mlx-vlm[train]==0.6.12 mlx-lm>=0.31.3 $common" ;;
    # current, ships cohere_compass; the reference environment (torch as the oracle)
    0.7.10)       echo "mlx[cpu] mlx-vlm==0.7.10 mlx-lm>=0.31.3 transformers>=5.21 $common" ;;
    # the same as a host resolves it, without the oracle's torch
    0.7.10-notorch) echo "mlx[cpu] mlx-vlm==0.7.10 mlx-lm>=0.31.3 transformers>=5.21 $common" ;;
    *) echo "unknown environment $1 (scripts/env/pins.sh knows: ${ALL_ENVS[*]})" >&2; return 1 ;;
  esac
}

env_mlx_vlm() { echo "${1%%-*}"; }              # 0.4.4-tf5.17 -> 0.4.4
env_has_torch() { [ "$1" = "$REFERENCE_ENV" ]; }
env_dir() { echo "$root/.venvs/mlxvlm-$1"; }    # $root: the repository, set by the caller
env_constraints() { echo "$root/scripts/env/constraints/mlxvlm-$1.txt"; }
