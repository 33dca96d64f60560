#!/usr/bin/env bash
# The environment that records video reference fixtures: transformers' CohereCompassVideoProcessor
# (and so its AutoProcessor for cohere_compass) needs torchvision, which the matrix's CPU
# torch==2.13.0 has no match for. The registry's torch 2.14.1 + torchvision 0.29.1 (CUDA builds,
# about 6 GB) import and run on the CPU. Only recording scripts use this environment; the matrix
# and .ci/run never do: the fixtures it writes carry the reference to every pin.
#
# Usage: scripts/env/reference.sh [--refresh]   -> .venvs/reference-video
# Exact versions are kept in scripts/env/constraints/reference-video.txt as scripts/env/build.sh does.
# compass-compat is installed editable (--no-deps) so the recorders import compass_data and
# tests.support plainly.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
env="$root/.venvs/reference-video"
constraints="$root/scripts/env/constraints/reference-video.txt"
reqs="torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 numpy safetensors pillow opencv-python-headless"
py="${PYTHON:-python3}"
refresh=0
[ "${1:-}" = "--refresh" ] && refresh=1

cflags=()
if [ $refresh = 0 ] && [ -f "$constraints" ] && [ "$(sed -n 's/^# requirements: //p' "$constraints")" = "$reqs" ]; then
  cflags=(-c "$constraints")
  stamp="$reqs | $(sha1sum "$constraints" | cut -c1-12)"
  if [ -f "$env/.stamp" ] && [ "$(cat "$env/.stamp")" = "$stamp" ]; then
    echo "[reference-env] up to date ($env)"; exit 0
  fi
fi
rm -rf "$env"
"$py" -m venv "$env"
"$env/bin/pip" install -q --upgrade pip
# shellcheck disable=SC2086
"$env/bin/pip" install -q "${cflags[@]}" $reqs
"$env/bin/pip" install -q --no-deps -e "$root"
if [ ${#cflags[@]} -eq 0 ]; then
  {
    echo "# Exact versions of .venvs/reference-video, written by scripts/env/reference.sh"
    echo "# (pip freeze) on $("$env/bin/python" -c 'import platform; print(f"Python {platform.python_version()}, {platform.system()} {platform.machine()}")')."
    echo "# requirements: $reqs"
    "$env/bin/pip" freeze --exclude-editable | sed -E 's/^([^ =#]+)==([^+ ]+)\+([^ ]+)$/\1==\2  # resolved as \2+\3/'
  } > "$constraints"
  echo "[reference-env] wrote ${constraints#"$root"/} (commit it)"
fi
echo "$reqs | $(sha1sum "$constraints" | cut -c1-12)" > "$env/.stamp"
"$env/bin/python" -c "import torch, torchvision, transformers; print('[reference-env] torch', torch.__version__, 'torchvision', torchvision.__version__, 'transformers', transformers.__version__)"
