#!/usr/bin/env bash
# What would a new mlx-vlm release mean for compass-compat? One throw-away environment, every check.
#
# Usage: scripts/pin_bump/pin_bump.sh VERSION|latest [options]
#   -c, --constraint SPEC|FILE  an extra pip constraint (a requirement such as 'mlx==0.31.2', or a
#                               constraints file); repeatable
#   --recipe ENV|auto           resolve with a matrix environment's requirements (scripts/env/pins.sh)
#                               instead of a host's, mlx-vlm swapped for VERSION (auto: the newest
#                               untagged environment at or below VERSION). A release whose own
#                               requirements conflict with the recipe is resolved as a host would,
#                               from its own metadata (the report says so and names the conflict)
#   --tests full|sweep|none     which vendored tests run (default full: the whole suite; sweep: the
#                               selection release_sweep.sh uses, see SWEEP_TESTS below)
#   --out DIR                   where <version>.md / .json go (default benchmarks/pin-bump)
#   --keep-env                  keep the environment (default: deleted at the end)
#   --matrix-env ENV            the matrix environment whose generated text is the reference
#                               (default 0.6.12; PIN_BUMP_MATRIX_PYTHON=<interpreter> overrides it)
#
# Resolution (default): what a host gets by `pip install mlx-vlm==VERSION` next to compass-compat:
# the newest mlx[cpu], mlx-lm (>= 0.28, compass-compat's floor) and transformers the release allows,
# plus numpy, safetensors, pillow, pytest, hypothesis; never torch (the suite's torch modules skip).
# The environment lives in build/pin-bump/env-<version> (ignored by git), raw outputs in
# build/pin-bump/<version>/.
#
# Then, from this checkout (editable install; it tests the working tree as it is, so do not edit
# the checkout while it runs: release_sweep.sh snapshots HEAD instead):
#   1. the checklist: the suite's tests marked for CHECKLIST.md's items (`pytest tests -m checklist`),
#      once with COMPASS_COMPAT_IMPLEMENTATION=upstream and once =vendored, each run's junit XML
#      reduced to item verdicts (scripts/pin_bump/reduce.py: an item passes where all its tests pass);
#   2. the vendored test suite (COMPASS_COMPAT_FORCE_VENDORED=1 where upstream ships cohere_compass,
#      as the matrix runs it; torch modules skip by themselves);
#   3. python -m compass_compat generate --no-verbose (the default checkpoint, the demo picture),
#      vendored live, as installed (where upstream ships cohere_compass), and in the matrix
#      environment on the same checkout: the text hashes must agree.
# The report compares every checklist verdict with the record (compass_compat/verdicts.json) for the
# nearest recorded release at or below VERSION, whatever items it lists; then, where the release ships
# cohere_compass, writes this run's verdicts into that record (scripts/pin_bump/record.py), which
# decides the live implementation there (review and commit the diff).
#
# Exit status: 0 upstream's cohere_compass passes every item (it can replace
# the vendored copy); 1 keep the vendored copy, everything of ours fine; 2 something of ours broke
# on that release (vendored checklist item, test, generated text) or the check could not run.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=scripts/env/pins.sh
source "$root/scripts/env/pins.sh"
helper="$root/scripts/pin_bump/helpers.py"
py="${PYTHON:-python3}"
# The sweep's test selection: the quantization probes against real loads, the patch and its undo,
# loading and generation through mlx-vlm's own entry points, both weight layouts and the head rule.
# With the checklist's items (parity with the reference, both layouts, 4-bit) it is what a
# release can move, at about a tenth of the whole suite's time.
SWEEP_TESTS=(tests/test_quant_modes.py tests/test_shim.py tests/test_generate.py tests/test_tie_head.py)
version=""; recipe=""; tests=full; out="$root/benchmarks/pin-bump"; keep=0
matrix_env="${PIN_BUMP_MATRIX_ENV:-0.6.12}"; user_constraints=()
# As recorded with the verdicts, which ship: absolute paths relative to the checkout.
command_line="bash scripts/pin_bump/pin_bump.sh"
for arg in "$@"; do
  case "$arg" in /*) arg="$(realpath -m --relative-to="$root" "$arg")" ;; esac
  command_line+=" $arg"
done
while [ $# -gt 0 ]; do
  case "$1" in
    -c|--constraint) user_constraints+=("$2"); shift 2 ;;
    --recipe) recipe="$2"; shift 2 ;;
    --tests) tests="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --keep-env) keep=1; shift ;;
    --matrix-env) matrix_env="$2"; shift 2 ;;
    -h|--help) sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "[pin-bump] unknown option $1" >&2; exit 2 ;;
    *) [ -z "$version" ] || { echo "[pin-bump] one VERSION only" >&2; exit 2; }; version="$1"; shift ;;
  esac
done
[ -n "$version" ] || { sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
case "$tests" in full|sweep|none) ;; *) echo "[pin-bump] --tests takes full, sweep or none" >&2; exit 2 ;; esac
requested="$version"
if [ "$version" = latest ]; then
  version="$("$py" -m pip index versions mlx-vlm 2>/dev/null | "$py" "$helper" latest)" || {
    echo "[pin-bump] could not ask the registry for mlx-vlm's releases" >&2; exit 2; }
  echo "[pin-bump] latest mlx-vlm release: $version"
fi
if [ "$recipe" = auto ]; then
  recipe="$("$py" "$helper" recipe-env "$version" "${ALL_ENVS[@]}")"
  [ -n "$recipe" ] || echo "[pin-bump] no matrix environment at or below $version: resolving as a host"
fi
[ -z "$recipe" ] || env_requirements "$recipe" >/dev/null || exit 2

home="${PIN_BUMP_HOME:-$root/build/pin-bump}"
env="$home/env-$version"; work="$home/$version"
rm -rf "$env" "$work"; mkdir -p "$work" "$out"
log() { echo "[pin-bump] $version: $*"; }
now() { date +%s; }
declare -A seconds=()

# The commit checked (PIN_BUMP_COMMIT: a snapshot's, set by release_sweep.sh); "+dirty" when the
# checkout has uncommitted changes (then nothing is cached).
clean=1
if [ -n "${PIN_BUMP_COMMIT:-}" ]; then
  commit="$PIN_BUMP_COMMIT"
else
  commit="$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
  if [ -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    clean=0; commit="$commit+dirty"
  fi
fi

# ------------------------------------------------------------------ the environment
cflags=(-c "$work/constraints.txt"); : > "$work/constraints.txt"
for spec in "${user_constraints[@]}"; do
  if [ -f "$spec" ]; then cflags+=(-c "$spec"); else echo "$spec" >> "$work/constraints.txt"; fi
done
host_reqs="mlx[cpu] mlx-vlm==$version mlx-lm>=0.28 transformers safetensors numpy pillow"
if [ -n "$recipe" ]; then
  reqs=""
  for token in $(env_requirements "$recipe"); do
    case "$token" in mlx-vlm==*) token="mlx-vlm==$version" ;; esac
    reqs="$reqs $token"
  done
  reqs="${reqs# }"; resolution="recipe $recipe: $reqs"
else
  reqs="$host_reqs"; resolution="host: the newest mlx, mlx-lm and transformers mlx-vlm $version allows"
fi
[ ${#user_constraints[@]} -eq 0 ] || resolution="$resolution (constraints: ${user_constraints[*]})"

start=$(now)
env_error=""
log "creating $env"
"$py" -m venv "$env" && "$env/bin/pip" install -q --upgrade pip >"$work/pip.log" 2>&1 || env_error="python -m venv failed"
while [ -z "$env_error" ]; do
  log "pip install $reqs pytest hypothesis"
  # shellcheck disable=SC2086
  if "$env/bin/pip" install -q "${cflags[@]}" $reqs pytest hypothesis >>"$work/pip.log" 2>"$work/pip.err"; then
    break
  fi
  grep -v "^WARNING: Location" "$work/pip.err" | tail -n 5 | sed 's/^/    /'
  if [ -n "$recipe" ] && grep -q "ResolutionImpossible" "$work/pip.err"; then
    # The release's own requirements exclude the recipe (pip resolves before it installs anything).
    conflicting="$("$py" "$helper" conflicts < "$work/pip.err")"
    resolution="own metadata (recipe $recipe conflicts with mlx-vlm $version's requirements: ${conflicting:-?})"
    reqs="$host_reqs"; recipe=""
    log "$resolution"
    continue
  fi
  env_error="pip could not install: $(grep -v '^WARNING' "$work/pip.err" | grep -m1 ERROR || tail -n1 "$work/pip.err")"
done
if [ -z "$env_error" ]; then
  "$env/bin/pip" install -q --no-deps -e "$root" >>"$work/pip.log" 2>&1 || env_error="editable install of $root failed"
fi
if [ -z "$env_error" ]; then
  "$env/bin/pip" freeze --exclude-editable > "$work/freeze.txt"
  if grep -qi '^torch==' "$work/freeze.txt"; then env_error="torch got installed (pulled by a requirement)"; fi
fi
if [ -z "$env_error" ] && ! "$env/bin/python" -c "import mlx_vlm, mlx_lm" >"$work/import.log" 2>&1; then
  env_error="mlx-vlm $version does not import in the resolved environment: $(tail -n 1 "$work/import.log")"
fi
seconds[env]=$(( $(now) - start ))
pyenv="$env/bin/python"
[ -z "$env_error" ] && log "resolved: $("$pyenv" -c "import importlib.metadata as m; print('  '.join(f'{n} {m.version(n)}' for n in ('mlx', 'mlx-vlm', 'mlx-lm', 'transformers')))")"

# ------------------------------------------------------------------ the checks
generate() {  # label python force-vendored pythonpath
  local label="$1" python="$2" force="$3" pp="$4"
  (cd "$work" && COMPASS_COMPAT_HOME="$work/home-$label" COMPASS_COMPAT_FORCE_VENDORED="$force" \
      PYTHONPATH="$pp" "$python" -m compass_compat generate --no-verbose) \
      >"$work/generate-$label.txt" 2>"$work/generate-$label.log"
  echo "$?" > "$work/generate-$label.rc"
  log "generate ($label): exit $(cat "$work/generate-$label.rc"): $(head -c 200 "$work/generate-$label.txt")"
}
upstream_ships=0
compgen -G "$env/lib/python*/site-packages/mlx_vlm/models/cohere_compass/__init__.py" >/dev/null && upstream_ships=1
tests_cmd="-"
if [ -z "$env_error" ]; then
  for impl in upstream vendored; do
    # The checklist: the suite's marked tests with $impl live, reduced to item verdicts (reduce.py).
    if [ "$impl" = upstream ] && [ $upstream_ships = 0 ]; then
      (cd "$root" && "$pyenv" -m scripts.pin_bump.reduce --absent upstream) >"$work/checklist-$impl.json"
      echo "$?" > "$work/checklist-$impl.rc"; seconds[checklist_$impl]=0
      log "checklist, upstream: mlx-vlm $version ships no cohere_compass: every item FAILs"
      continue
    fi
    start=$(now); log "checklist, $impl: python -m pytest tests -m checklist (COMPASS_COMPAT_IMPLEMENTATION=$impl)"
    (cd "$root" && env -u COMPASS_COMPAT_FORCE_VENDORED COMPASS_COMPAT_IMPLEMENTATION="$impl" "$pyenv" -m pytest tests \
        -m checklist --checklist-measure -q -p no:cacheprovider --junitxml="$work/checklist-$impl.xml") \
        >"$work/checklist-$impl.log" 2>&1
    seconds[checklist_$impl]=$(( $(now) - start ))
    (cd "$root" && "$pyenv" -m scripts.pin_bump.reduce "$work/checklist-$impl.xml" "$impl" "${seconds[checklist_$impl]}") \
        >"$work/checklist-$impl.json" 2>>"$work/checklist-$impl.log"
    echo "$?" > "$work/checklist-$impl.rc"
    log "checklist, $impl: exit $(cat "$work/checklist-$impl.rc"), $(tail -n 1 "$work/checklist-$impl.log") [${seconds[checklist_$impl]} s]"
  done

  if [ "$tests" != none ]; then
    if [ "$tests" = sweep ]; then targets=("${SWEEP_TESTS[@]}"); else targets=(tests); fi
    args=("${targets[@]}" -q -p no:cacheprovider)
    # As the matrix: the switch only where upstream ships cohere_compass (elsewhere ours is live anyway).
    tests_cmd="COMPASS_COMPAT_FORCE_VENDORED=$upstream_ships python -m pytest ${args[*]}"
    start=$(now); log "tests ($tests): $tests_cmd"
    (cd "$root" && COMPASS_COMPAT_FORCE_VENDORED=$upstream_ships "$pyenv" -m pytest "${args[@]}" \
        --junitxml="$work/pytest.xml") >"$work/pytest.log" 2>&1
    seconds[tests]=$(( $(now) - start ))
    log "tests: $(tail -n 1 "$work/pytest.log") [${seconds[tests]} s]"
  fi

  start=$(now)
  generate vendored "$pyenv" 1 ""
  [ $upstream_ships = 1 ] && generate as_installed "$pyenv" 0 ""
  seconds[generate]=$(( $(now) - start ))
fi

# The reference: the same command in a matrix environment on this checkout (cached per clean commit).
start=$(now)
matrix_py="${PIN_BUMP_MATRIX_PYTHON:-$(env_dir "$matrix_env")/bin/python}"
# A given interpreter names its own environment in the report and the cache key.
if [ -n "${PIN_BUMP_MATRIX_PYTHON:-}" ]; then
  matrix_env="$(basename "$(dirname "$(dirname "$matrix_py")")")"; matrix_env="${matrix_env#mlxvlm-}"
fi
cache="$home/matrix-text/${commit}-${matrix_env}"
if [ $clean = 1 ] && [ -f "$cache.rc" ] && [ "$(cat "$cache.rc")" = 0 ]; then
  cp "$cache.txt" "$work/generate-matrix.txt"; cp "$cache.rc" "$work/generate-matrix.rc"
  log "generate (matrix $matrix_env): cached for $commit"
else
  if [ ! -x "$matrix_py" ] && [ -z "${PIN_BUMP_MATRIX_PYTHON:-}" ]; then
    log "building the matrix environment $matrix_env for the reference text"
    bash "$root/scripts/env/build.sh" "$matrix_env" >"$work/make_envs.log" 2>&1
  fi
  if [ -x "$matrix_py" ]; then
    generate matrix "$matrix_py" 0 "$root"
    if [ $clean = 1 ] && [ "$(cat "$work/generate-matrix.rc")" = 0 ]; then
      mkdir -p "$home/matrix-text"
      cp "$work/generate-matrix.txt" "$cache.txt"; cp "$work/generate-matrix.rc" "$cache.rc"
    fi
  else
    log "no matrix interpreter at $matrix_py"
  fi
fi
seconds[matrix_generate]=$(( $(now) - start ))

# ------------------------------------------------------------------ the report
secs_json="{"; for k in "${!seconds[@]}"; do secs_json="$secs_json\"$k\": ${seconds[$k]}, "; done
secs_json="${secs_json%, }}"
constraints_json="$(printf '%s\n' "${user_constraints[@]}" | "$py" -c 'import json,sys; print(json.dumps([l for l in sys.stdin.read().splitlines() if l]))')"
MLX_VLM="$version" REQUESTED="$requested" REPO="$root" COMMIT="$commit" RESOLUTION="$resolution" \
  REQS="$reqs pytest hypothesis" ENV_ERROR="$env_error" TESTS="$tests" TESTS_CMD="$tests_cmd" \
  MATRIX_ENV="$matrix_env ($matrix_py)" SECS="$secs_json" CONSTRAINTS="$constraints_json" PYENV="$pyenv" \
  COMMAND_LINE="$command_line" \
  "$py" - "$work/meta.json" <<'EOF'
import json, os, subprocess, sys, datetime
e = os.environ
try:
    python = subprocess.run([e["PYENV"], "-c", "import platform; print(platform.python_version())"],
                            capture_output=True, text=True).stdout.strip() or "?"
except OSError:
    python = "?"
meta = {
    "mlx_vlm": e["MLX_VLM"], "requested": e["REQUESTED"], "repo": e["REPO"], "commit": e["COMMIT"],
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    "command": e["COMMAND_LINE"],
    "resolution": e["RESOLUTION"], "requirements": e["REQS"], "env_error": e["ENV_ERROR"] or None,
    "tests": e["TESTS"], "tests_command": e["TESTS_CMD"], "matrix_env": e["MATRIX_ENV"],
    "seconds": json.loads(e["SECS"]), "constraints": json.loads(e["CONSTRAINTS"]), "python": python,
}
open(sys.argv[1], "w").write(json.dumps(meta, indent=2) + "\n")
EOF
code="$("$py" "$helper" report "$work" "$out/$version")"
cat "$out/$version.md"
# The verdicts go into the record apply_patch reads (compass_compat/verdicts.json: review the diff).
if [ -z "$env_error" ] && [ $upstream_ships = 1 ]; then
  (cd "$root" && "$pyenv" -m scripts.pin_bump.record "$work") || log "the verdicts were not recorded"
fi
if [ $keep = 1 ]; then log "environment kept: $env"; else rm -rf "$env"; fi
log "report: $out/$version.md (exit $code)"
exit "${code:-2}"
