# Shared steps of scripts/hosts/<host>/env.sh, sourced as its last line. The host script sets:
#   ENV_NAME      the environment's folder under .venvs (<host>-<version>)
#   INSTALL       the pip arguments that install the host (unless it defines host_install)
#   SPEC          one line naming what is installed, for the stamp (default: INSTALL)
#   REQUIRE       require_host's arguments: modules [-- executables] the host needs
#   REPORT_NAMES  distributions whose versions are reported
#   host_install  optional function: installs the host with "${pip[@]}" and "${cflags[@]}" (the
#                 constraints flags; empty on a fresh resolution)
#   host_check    optional function: what else fails if the environment is not what the host needs
# The environment is rebuilt only when the host script, this file, pyproject.toml or the
# committed constraints change. After a build the exact versions (`pip freeze --exclude-editable`)
# go to scripts/hosts/<host>/constraints.txt; when that file exists every install runs with `-c`
# it, so a rebuild resolves the same versions.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
py="${PYTHON:-python3}"
HOST_SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
HOST="$(basename "$(dirname "$HOST_SCRIPT")")"
ENV_DIR="$root/.venvs/$ENV_NAME"
CONSTRAINTS="$root/scripts/hosts/$HOST/constraints.txt"
: "${SPEC:=${INSTALL[*]}}"

_stamp() {
  local c="none"
  [ -f "$CONSTRAINTS" ] && c="$(sha1sum "$CONSTRAINTS" | cut -c1-12)"
  echo "$SPEC | script $(sha1sum "$HOST_SCRIPT" | cut -c1-12) | common $(sha1sum "${BASH_SOURCE[0]}" | cut -c1-12)" \
    "| pyproject $(sha1sum "$root/pyproject.toml" | cut -c1-12) | constraints $c"
}

report_env() {
  "$ENV_DIR/bin/python" - "$HOST" $REPORT_NAMES <<'PY'
import importlib.metadata as md, sys
host, names = sys.argv[1], sys.argv[2:]
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "missing"
print(f"[{host}-env] " + "  ".join(f"{n} {v(n)}" for n in names))
PY
}

# The editable install copies the opt-in .pth file(s) into site-packages: when the checkout's
# differ (a changed startup hook), install compass-compat again; the host's packages stay.
_sync_startup_hook() {
  local site pth stale=0
  site="$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  for pth in "$root"/compass_compat/*.pth; do
    [ -e "$pth" ] || continue
    cmp -s "$pth" "$site/$(basename "$pth")" || stale=1
  done
  if [ "$stale" -eq 1 ]; then
    echo "[$HOST-env] the checkout's startup hook changed: reinstalling compass-compat (editable, --no-deps)"
    "$ENV_DIR/bin/python" -m pip install -q --no-deps -e "$root"
  fi
}

# Fail unless every module imports by name in the environment and the named executables exist.
#   require_host MODULE ... [-- EXECUTABLE ...]
require_host() {
  local mods=() exes=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do mods+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  exes=("$@")
  "$ENV_DIR/bin/python" - "$HOST" "${mods[@]}" <<'PY'
import importlib.util, sys
host, mods = sys.argv[1], sys.argv[2:]
missing = [m for m in mods if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"[{host}-env] error: not importable: {', '.join(missing)}")
PY
  [ $? -eq 0 ] || exit 1
  local exe
  for exe in "${exes[@]}"; do
    [ -x "$ENV_DIR/bin/$exe" ] || { echo "[$HOST-env] error: no $exe executable in $ENV_DIR/bin" >&2; exit 1; }
  done
}

declare -F host_install >/dev/null || host_install() { "${pip[@]}" install -q "${cflags[@]}" "${INSTALL[@]}"; }
declare -F host_check >/dev/null || host_check() { :; }

if [ -f "$ENV_DIR/.compass-compat-stamp" ] && [ "$(cat "$ENV_DIR/.compass-compat-stamp")" = "$(_stamp)" ]; then
  echo "[$HOST-env] up to date ($ENV_DIR)"
  _sync_startup_hook
  report_env
  exit 0
fi
echo "[$HOST-env] creating $ENV_DIR"
rm -rf "$ENV_DIR"
"$py" -m venv "$ENV_DIR"
pip=("$ENV_DIR/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
cflags=()
if [ -f "$CONSTRAINTS" ]; then
  echo "[$HOST-env] installing with -c ${CONSTRAINTS#$root/}"
  cflags=(-c "$CONSTRAINTS")
else
  echo "[$HOST-env] no ${CONSTRAINTS#$root/} yet: resolving fresh (it is written afterwards)"
fi
host_install
"${pip[@]}" install -q "${cflags[@]}" pytest
# compass-compat from this checkout (its .pth startup hook included), never its requirements:
# the host's resolution stays the host's.
"${pip[@]}" install -q --no-deps -e "$root"
require_host $REQUIRE
host_check
{
  echo "# Exact versions of ${ENV_DIR#$root/}, written by scripts/hosts/$HOST/env.sh (pip freeze --exclude-editable)."
  "${pip[@]}" freeze --exclude-editable
} > "$CONSTRAINTS.tmp"
mv "$CONSTRAINTS.tmp" "$CONSTRAINTS"
echo "[$HOST-env] wrote ${CONSTRAINTS#$root/}"
_stamp > "$ENV_DIR/.compass-compat-stamp"
report_env
