#!/usr/bin/env bash
# Run the whole test suite in every environment of the mlx-vlm matrix and print a table.
#
# Usage: scripts/check/matrix.sh [ENV ...]      (default: every environment in scripts/env/pins.sh;
#                                                an ENV is an mlx-vlm version, e.g. 0.6.12, or a
#                                                version with a tag, e.g. 0.4.4-tf5.17)
#
# - Builds or updates every .venvs/mlxvlm-<env> (scripts/env/build.sh, idempotent) in the
#   background, a few at a time (MATRIX_ENV_JOBS, default 3: mostly downloads), with the exact
#   versions recorded in scripts/env/constraints/mlxvlm-<env>.txt; MAKE_ENVS_REFRESH=1 resolves
#   afresh and rewrites those records.
# - Runs `python -m pytest tests -q` in each env from the repo root as soon as it is ready,
#   MATRIX_JOBS runs at a time (default: the number of cores, at most 2; the suites are
#   single-threaded Python mostly), the longest first (below). junit XML and the full log of each run go
#   to build/matrix/<run>.{xml,log}; each run's own time is in the table.
# - An environment whose mlx-vlm ships its own cohere_compass (0.6.13+, i.e. 0.7.10-notorch here)
#   runs twice: "<env>" as users get it (the recorded verdicts choose: the vendored package on
#   0.7.10) and "<env>+upstream" with COMPASS_COMPAT_IMPLEMENTATION=upstream, mlx-vlm's own package
#   live, so upstream's verdicts stay measured (tests of the vendored model skip there, saying so).
# - The reference environment (REFERENCE_ENV, torch as the oracle) runs only the tests marked
#   `reference` (`-m reference`), once; its torch-free twin runs everything else, as hosts resolve it.
# - Exits non-zero if any environment could not be built or any run failed; pytest's
#   exit code 5 (no tests collected) counts as a failure.
# Extra pytest arguments: MATRIX_PYTEST_ARGS="-x -k shim" scripts/check/matrix.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=scripts/env/pins.sh
source "$root/scripts/env/pins.sh"
pins=("$@")
[ ${#pins[@]} -gt 0 ] || pins=("${ALL_ENVS[@]}")
for pin in "${pins[@]}"; do env_requirements "$pin" >/dev/null || exit 2; done
out="$root/build/matrix"
mkdir -p "$out"
rm -f "$out"/*.row
matrix_start=$(date +%s)
cores=$(nproc 2>/dev/null || echo 1)
jobs="${MATRIX_JOBS:-$(( cores < 2 ? cores : 2 ))}"
env_jobs="${MATRIX_ENV_JOBS:-3}"

# Longest runs first, the short ones fill the end: each pin's full run, newest first (newer pins
# skip fewer tests), then the +upstream runs (the vendored package's tests skip there) and the
# reference environment's `-m reference` run. Environments are built in that order too.
order=()
for (( i = ${#pins[@]} - 1; i >= 0; i-- )); do env_has_torch "${pins[i]}" || order+=("${pins[i]}"); done
for pin in "${pins[@]}"; do env_has_torch "$pin" && order+=("$pin"); done
rm -f "$out"/env-*.rc

# ---- environments, in the background, $env_jobs at a time; each leaves env-<pin>.rc when done
env_start=$(date +%s)
(
  for pin in "${order[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$env_jobs" ]; do wait -n 2>/dev/null || true; done
    (
      bash "$root/scripts/env/build.sh" "$pin" >"$out/env-$pin.log" 2>&1
      rc=$?
      echo "$(( $(date +%s) - env_start ))" >"$out/env-$pin.seconds"
      echo $rc >"$out/env-$pin.rc"
    ) &
  done
  wait
) &
envs_pid=$!

# Waits for pin's environment; 0 when it was built, else records the failure (said once per pin).
declare -A said=()
env_ready() {
  local pin="$1"
  while [ ! -f "$out/env-$pin.rc" ]; do sleep 1; done
  [ -n "${said[$pin]:-}" ] && return "${said[$pin]}"
  if [ "$(cat "$out/env-$pin.rc")" = 0 ]; then
    echo "$(grep '^\[envs\]' "$out/env-$pin.log" | tail -n 1) (ready after $(cat "$out/env-$pin.seconds")s)"
    said[$pin]=0
    return 0
  fi
  said[$pin]=1
  echo "[matrix] $pin: environment could not be built; last lines of $out/env-$pin.log:"
  tail -n 20 "$out/env-$pin.log" | sed 's/^/    /'
  echo "$pin|$(env_mlx_vlm "$pin")|-|-|-|-|-|ENV FAILED" >"$out/$pin.row"
  return 1
}

run_one() {
  local label="$1" pin="$2" switch="$3"
  local py xml="$out/$label.xml" log="$out/$label.log" start rc seconds status
  local passed=0 failed=0 skipped=0 version tf
  py="$(env_dir "$pin")/bin/python"
  local select=()
  if env_has_torch "$pin"; then select=(-m reference); fi
  rm -f "$xml"
  start=$(date +%s)
  # shellcheck disable=SC2086
  # --durations: each run's log ends with its 20 slowest tests (where CI's time goes).
  (cd "$root" && env -u COMPASS_COMPAT_FORCE_VENDORED COMPASS_COMPAT_IMPLEMENTATION="$switch" "$py" -m pytest tests -q "${select[@]}" \
      --durations=20 --junitxml="$xml" ${MATRIX_PYTEST_ARGS:-}) >"$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  if [ -f "$xml" ]; then
    read -r passed failed skipped < <("$py" "$root/scripts/check/junit_counts.py" "$xml")
  fi
  case $rc in
    0) status=ok ;;
    5) status="FAILED (no tests collected)" ;;
    *) status="FAILED (pytest exit $rc)" ;;
  esac
  if [ $rc -ne 0 ]; then
    echo "[matrix] $label: $status in ${seconds}s; last lines of $log:"
    tail -n 40 "$log" | sed 's/^/    /'
  else
    echo "[matrix] $label ($seconds s): $(tail -n 1 "$log")"
  fi
  version=$("$py" -c "import importlib.metadata as m; print(m.version('mlx-vlm'))" 2>/dev/null || echo "?")
  tf=$("$py" -c "import importlib.metadata as m; print(m.version('transformers'))" 2>/dev/null || echo "?")
  echo "$label|$version|$tf|$passed|$failed|$skipped|$seconds|$status" >"$out/$label.row"
}

# ---- runs, $jobs at a time, each as soon as its environment is ready: every pin's own run in
# `order`, then for each environment whose mlx-vlm ships cohere_compass the run with upstream's
# package live (not the reference environment: its tests do not depend on which is live), then
# the reference run.
run_pids=()
running() { local n=0 pid; for pid in "${run_pids[@]}"; do kill -0 "$pid" 2>/dev/null && n=$((n + 1)); done; echo $n; }
queue=()
for pin in "${order[@]}"; do env_has_torch "$pin" || queue+=("$pin|auto"); done
for pin in "${order[@]}"; do env_has_torch "$pin" || queue+=("$pin|upstream"); done
for pin in "${order[@]}"; do env_has_torch "$pin" && queue+=("$pin|auto"); done
for run in "${queue[@]}"; do
  pin="${run%|*}"; switch="${run#*|}"; label="$pin"
  env_ready "$pin" || continue
  if [ "$switch" = upstream ]; then
    compgen -G "$(env_dir "$pin")/lib/python*/site-packages/mlx_vlm/models/cohere_compass/__init__.py" >/dev/null || continue
    label="$pin+upstream"
  fi
  while [ "$(running)" -ge "$jobs" ]; do sleep 1; done
  echo "[matrix] $label: python -m pytest tests -q (COMPASS_COMPAT_IMPLEMENTATION=$switch)"
  run_one "$label" "$pin" "$switch" &
  run_pids+=($!)
done
wait

# ---- table, in the matrix's order
failed_runs=0; total_passed=0; total_failed=0; total_skipped=0
wall=$(( $(date +%s) - matrix_start ))
echo
printf '%-24s %-9s %-12s %7s %7s %8s %8s  %s\n' run mlx-vlm transformers passed failed skipped seconds status
for pin in "${pins[@]}"; do
  for label in "$pin" "$pin+upstream"; do
    [ -f "$out/$label.row" ] || continue
    IFS='|' read -r label version tf passed failed skipped seconds status <"$out/$label.row"
    printf '%-24s %-9s %-12s %7s %7s %8s %8s  %s\n' "$label" "$version" "$tf" "$passed" "$failed" "$skipped" "$seconds" "$status"
    [ "$status" = ok ] || failed_runs=$((failed_runs + 1))
    [ "$passed" = - ] && continue
    total_passed=$((total_passed + passed)); total_failed=$((total_failed + failed))
    total_skipped=$((total_skipped + skipped))
  done
done
echo "[matrix] wall time ${wall}s (environments built beside the runs, $jobs runs at a time); logs in build/matrix/"
if [ $failed_runs -gt 0 ] && [ $total_failed -eq 0 ]; then
  total_failed=$failed_runs  # a run that failed without failing tests (no tests, crash, env)
fi
echo "matrix: $total_passed passed, $total_failed failed, $total_skipped skipped"
[ $failed_runs -eq 0 ]
