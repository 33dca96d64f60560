#!/usr/bin/env bash
# Run the whole test suite in every environment of the mlx-vlm matrix and print a table.
#
# Usage: scripts/check/matrix.sh [ENV ...]      (default: every environment in scripts/env/pins.sh;
#                                              an ENV is an mlx-vlm version, e.g. 0.6.12, or a
#                                              version with a tag, e.g. 0.4.4-tf5.17)
#
# - Creates or updates .venvs/mlxvlm-<env> first (scripts/env/build.sh, idempotent), with the
#   exact versions recorded in scripts/env/constraints/mlxvlm-<env>.txt; MAKE_ENVS_REFRESH=1
#   resolves afresh and rewrites those records.
# - Runs `python -m pytest tests -q` in each env from the repo root; junit XML and the
#   full log of each run go to build/matrix/<run>.{xml,log}.
# - An environment whose mlx-vlm ships its own cohere_compass (0.6.13+, i.e. 0.7.10 here) runs
#   twice: "<env>" as users get it (upstream wins) and "<env>+forced" with
#   COMPASS_COMPAT_FORCE_VENDORED=1, where the vendored model is the live one.
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
matrix_start=$(date +%s)

rows=()      # "run|mlx-vlm|transformers|passed|failed|skipped|seconds|status"
failed_runs=0
total_passed=0; total_failed=0; total_skipped=0

for pin in "${pins[@]}"; do
  env="$(env_dir "$pin")"
  if ! bash "$root/scripts/env/build.sh" "$pin"; then
    echo "[matrix] $pin: environment could not be built" >&2
    rows+=("$pin|$(env_mlx_vlm "$pin")|-|-|-|-|-|ENV FAILED"); failed_runs=$((failed_runs + 1)); continue
  fi
  py="$env/bin/python"
  runs=("$pin|0")
  # Upstream ships cohere_compass on this pin: also run with the vendored copy forced.
  if compgen -G "$env/lib/python*/site-packages/mlx_vlm/models/cohere_compass/__init__.py" >/dev/null; then
    runs+=("$pin+forced|1")
  fi
  for run in "${runs[@]}"; do
    label="${run%|*}"; force="${run#*|}"
    xml="$out/$label.xml"; log="$out/$label.log"
    rm -f "$xml"
    echo "[matrix] $label: python -m pytest tests -q (COMPASS_COMPAT_FORCE_VENDORED=$force)"
    start=$(date +%s)
    # shellcheck disable=SC2086
    (cd "$root" && COMPASS_COMPAT_FORCE_VENDORED="$force" "$py" -m pytest tests -q \
        --junitxml="$xml" ${MATRIX_PYTEST_ARGS:-}) >"$log" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - start ))
    passed=0; failed=0; skipped=0
    if [ -f "$xml" ]; then
      read -r passed failed skipped < <("$py" "$root/scripts/check/junit_counts.py" "$xml")
    fi
    case $rc in
      0) status=ok ;;
      5) status="FAILED (no tests collected)" ;;
      *) status="FAILED (pytest exit $rc)" ;;
    esac
    if [ $rc -ne 0 ]; then
      failed_runs=$((failed_runs + 1))
      echo "[matrix] $label: $status; last lines of $log:"
      tail -n 40 "$log" | sed 's/^/    /'
    else
      tail -n 1 "$log" | sed "s/^/[matrix] $label: /"
    fi
    version=$("$py" -c "import importlib.metadata as m; print(m.version('mlx-vlm'))" 2>/dev/null || echo "?")
    tf=$("$py" -c "import importlib.metadata as m; print(m.version('transformers'))" 2>/dev/null || echo "?")
    rows+=("$label|$version|$tf|$passed|$failed|$skipped|$seconds|$status")
    total_passed=$((total_passed + passed)); total_failed=$((total_failed + failed))
    total_skipped=$((total_skipped + skipped))
  done
done

wall=$(( $(date +%s) - matrix_start ))
echo
printf '%-16s %-9s %-12s %7s %7s %8s %8s  %s\n' run mlx-vlm transformers passed failed skipped seconds status
for row in "${rows[@]}"; do
  IFS='|' read -r label version tf passed failed skipped seconds status <<<"$row"
  printf '%-16s %-9s %-12s %7s %7s %8s %8s  %s\n' "$label" "$version" "$tf" "$passed" "$failed" "$skipped" "$seconds" "$status"
done
echo "[matrix] wall time ${wall}s (environments included); logs in build/matrix/"
if [ $failed_runs -gt 0 ] && [ $total_failed -eq 0 ]; then
  total_failed=$failed_runs  # a run that failed without failing tests (no tests, crash, env)
fi
echo "matrix: $total_passed passed, $total_failed failed, $total_skipped skipped"
[ $failed_runs -eq 0 ]
