#!/usr/bin/env bash
# Every published mlx-vlm release in a range through scripts/pin_bump/pin_bump.sh, one at a time, into one table.
#
# Usage: scripts/pin_bump/release_sweep.sh [FROM] [TO] [--resolve recipe|host] [--tests sweep|full|none] [--commit]
#   FROM, TO      release range, inclusive (default 0.4.4 .. latest); the registry lists the releases
#   --resolve     recipe (default): each release with the requirements of the matrix environment at or
#                 below it (scripts/env/pins.sh, mlx-vlm swapped), or from its own metadata where they
#                 conflict; host: as a host resolves it (the newest mlx, mlx-lm, transformers it allows)
#   --tests       the vendored tests each release runs (default sweep: pin_bump.sh's SWEEP_TESTS; the
#                 checklist, both implementations, and the default checkpoint's generate always run)
#   --commit      git-commit the table and that release's report after each row
#
# Run it niced (`nice -n 10 bash scripts/pin_bump/release_sweep.sh`): one environment at a time, each deleted
# after its row, so disk stays bounded. The table is benchmarks/pin-bump/sweep.md, one row added per
# release as it finishes (rows sorted by release); a release already in it is skipped, so an
# interrupted sweep resumes where it stopped (delete a row to redo it). Releases run in an order
# whose every prefix spans the range (every 8th release first, the newest second, then the gaps). Per-release reports: benchmarks/pin-bump/sweep/<version>.{md,json}.
# The code checked is a snapshot of HEAD (git archive into build/pin-bump/src-<commit>), so editing
# the checkout during a sweep changes nothing; each row names the commit it ran.
# Not part of .ci/run: the scheduled CI job is .ci/pin-bump (one release, default latest).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
helper="$root/scripts/pin_bump/helpers.py"
py="${PYTHON:-python3}"
range=(); resolve=recipe; tests=sweep; commit_rows=0
while [ $# -gt 0 ]; do
  case "$1" in
    --resolve) resolve="$2"; shift 2 ;;
    --tests) tests="$2"; shift 2 ;;
    --commit) commit_rows=1; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "[sweep] unknown option $1" >&2; exit 2 ;;
    *) range+=("$1"); shift ;;
  esac
done
case "$resolve" in recipe|host) ;; *) echo "[sweep] --resolve takes recipe or host" >&2; exit 2 ;; esac
from="${range[0]:-0.4.4}"; to="${range[1]:-latest}"
index="$("$py" -m pip index versions mlx-vlm 2>/dev/null)" || { echo "[sweep] could not ask the registry" >&2; exit 2; }
[ "$to" != latest ] || to="$("$py" "$helper" latest <<<"$index")"
mapfile -t releases < <("$py" "$helper" releases "$from" "$to" <<<"$index" | "$py" "$helper" spread)
[ ${#releases[@]} -gt 0 ] || { echo "[sweep] no release in $from .. $to" >&2; exit 2; }

out="$root/benchmarks/pin-bump"; reports="$out/sweep"; table="$out/sweep.md"
home="${PIN_BUMP_HOME:-$root/build/pin-bump}"
mkdir -p "$reports" "$home"
commit="$(git -C "$root" rev-parse HEAD)"
[ -z "$(git -C "$root" status --porcelain --untracked-files=no -- compass_compat vendor tests scripts)" ] ||
  echo "[sweep] note: uncommitted changes are not in the snapshot; it checks $commit as committed"
src="$home/src-${commit:0:12}"
if [ ! -f "$src/.complete" ]; then
  rm -rf "$src"; mkdir -p "$src"
  git -C "$root" archive HEAD | tar -x -C "$src" && touch "$src/.complete"
fi
if [ ! -f "$table" ]; then
  {
    echo "# mlx-vlm release sweep"
    echo
    echo "Written by \`scripts/pin_bump/release_sweep.sh\` (one row per release, added as each finishes, kept in release order; see"
    echo "docs/testing.md). resolution: \`recipe ENV\` = scripts/env/pins.sh's requirements of that matrix"
    echo "environment with mlx-vlm swapped; \`own metadata\` = the release's requirements conflict with the recipe,"
    echo "so it is resolved as a host would (newest mlx, mlx-lm, transformers it allows); \`host\` = --resolve host."
    echo "vendored text sha256: \`python -m compass_compat generate --no-verbose\` on the default checkpoint with"
    echo "the vendored copy live; = matrix: the same text as the matrix environment on the same commit."
    echo "tests: passed/failed/skipped of the selection (--tests). upstream verdict: the checklist against"
    echo "mlx-vlm's own cohere_compass. exit: pin_bump.sh's (0 upstream can replace, 1 keep vendored, 2 broke)."
    echo
  } > "$table"
fi

echo "[sweep] ${#releases[@]} release(s) $from .. $to; commit ${commit:0:12}; table $table"
for version in "${releases[@]}"; do
  if grep -q "^| $version |" "$table"; then
    echo "[sweep] $version: already in the table, skipped"; continue
  fi
  start=$(date +%s)
  recipe_args=(); [ "$resolve" = recipe ] && recipe_args=(--recipe auto)
  PIN_BUMP_COMMIT="$commit" PIN_BUMP_HOME="$home" bash "$src/scripts/pin_bump/pin_bump.sh" "$version" "${recipe_args[@]}" --tests "$tests" \
    --out "$reports" > "$home/sweep-$version.log" 2>&1
  rc=$?
  if [ ! -f "$reports/$version.json" ]; then
    echo "[sweep] $version: pin_bump.sh wrote no report (exit $rc); log: $home/sweep-$version.log" >&2
    tail -n 20 "$home/sweep-$version.log" >&2
    continue
  fi
  "$py" "$helper" sweep-row "$reports/$version.json" "$table" | sed "s/^/[sweep] /"
  echo "[sweep] $version: exit $rc in $(( $(date +%s) - start )) s"
  if [ $commit_rows = 1 ]; then
    # The whole table and report folder: a row whose commit failed (index locked) goes with the next.
    git -C "$root" add -- "$table" "$reports" &&
      git -C "$root" commit -q -m "release sweep: mlx-vlm $version (pin_bump exit $rc, $(( $(date +%s) - start )) s)" \
        -- "$table" "$reports" ||
      echo "[sweep] $version: could not commit the row (the table keeps it)" >&2
  fi
done
echo "[sweep] done: $table"
