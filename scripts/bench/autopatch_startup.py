"""What the opt-in autopatch costs: at interpreter start, and when the host imports mlx-vlm.

    .venvs/mlxvlm-0.6.12/bin/python scripts/bench/autopatch_startup.py               # this tree's hook
    .venvs/mlxvlm-0.6.12/bin/python scripts/bench/autopatch_startup.py --installed   # the env's own

Four fresh-interpreter cases, each run ``--runs`` times (interleaved, so load drifts hit all
alike): ``python -c pass`` and ``python -c "import mlx_vlm"``, each with
``COMPASS_COMPAT_AUTOPATCH`` unset and set to 1. A case's figures are the medians of its wall
time (spawn to exit) and of its peak RSS (``wait4``'s ``ru_maxrss``). The startup cost is
"pass, opted in" minus "pass"; the cost at the moment mlx-vlm is imported is "import mlx_vlm,
opted in" minus "import mlx_vlm" (the patch, the ``compass_compat`` import and what it imports).

By default the interpreter is a throw-away venv that sees ``--python``'s packages and this
tree's code, with this tree's ``.pth`` and hook module installed as the wheel installs them
(``scripts/_lib/hook_venv.py``). ``--installed`` measures ``--python`` exactly as installed
instead (whatever hook its last ``pip install`` put into site-packages). Prints a table, or
one JSON object with ``--json``. ``COMPASS_COMPAT_FORCE_VENDORED`` and the other switches are
passed through as set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from scripts._lib import hook_venv

ENV = "COMPASS_COMPAT_AUTOPATCH"
CASES = {
    "pass": ("pass", False),
    "pass, opted in": ("pass", True),
    "import mlx_vlm": ("import mlx_vlm", False),
    "import mlx_vlm, opted in": ("import mlx_vlm", True),
}


def run_once(python: Path, code: str, opted_in: bool, cwd: str) -> Dict[str, float]:
    """One fresh interpreter: wall seconds and peak RSS (MB)."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTHONPATH")}
    if opted_in:
        env[ENV] = "1"
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen([str(python), "-c", code], env=env, cwd=cwd, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS, not all children's
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            text = err.read().decode(errors="replace")
            raise SystemExit(f"{python} -c {code!r} ({ENV}={'1' if opted_in else 'unset'}) failed:\n{text}")
    return {"s": wall, "mb": usage.ru_maxrss / 1024}  # ru_maxrss is in KiB on Linux


def measure(python: Path, runs: int) -> Dict[str, Dict[str, float]]:
    samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as cwd:  # outside the repo: -c puts the cwd on sys.path
        for name, (code, opted) in CASES.items():
            run_once(python, code, opted, cwd)  # warm the page cache and .pyc files, not counted
        for _ in range(runs):
            for name, (code, opted) in CASES.items():
                samples[name].append(run_once(python, code, opted, cwd))
    return {
        name: {
            "s": statistics.median(r["s"] for r in rows),
            "mb": statistics.median(r["mb"] for r in rows),
            "runs": len(rows),
        }
        for name, rows in samples.items()
    }


def mlx_vlm_version(python: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('mlx-vlm'))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", type=Path, default=Path(sys.executable), help="a pin environment's python")
    parser.add_argument("--runs", type=int, default=5, help="runs per case (median)")
    parser.add_argument("--installed", action="store_true", help="measure --python as installed")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        python = args.python if args.installed else hook_venv.build(args.python, Path(tmp) / "env")
        figures = measure(python, args.runs)
    result = {
        "mlx_vlm": mlx_vlm_version(args.python),
        "hook": f"as installed in {args.python}" if args.installed else f"this tree ({hook_venv.REPO})",
        "force_vendored": os.environ.get("COMPASS_COMPAT_FORCE_VENDORED", ""),
        "cases": figures,
        "startup_cost": {
            "s": figures["pass, opted in"]["s"] - figures["pass"]["s"],
            "mb": figures["pass, opted in"]["mb"] - figures["pass"]["mb"],
        },
        "cost_at_import_mlx_vlm": {
            "s": figures["import mlx_vlm, opted in"]["s"] - figures["import mlx_vlm"]["s"],
            "mb": figures["import mlx_vlm, opted in"]["mb"] - figures["import mlx_vlm"]["mb"],
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"mlx-vlm {result['mlx_vlm']}, hook: {result['hook']}, median of {args.runs} fresh interpreters")
    print(f"{'case':<26} {'wall s':>8} {'peak RSS MB':>12}")
    for name, row in figures.items():
        print(f"{name:<26} {row['s']:>8.3f} {row['mb']:>12.1f}")
    for key in ("startup_cost", "cost_at_import_mlx_vlm"):
        row = result[key]
        print(f"{key.replace('_', ' '):<26} {row['s']:>+8.3f} {row['mb']:>+12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
