"""How far transformers, recomputed on this CPU, lands from the recorded reference fixtures.

The fixtures in tests/fixtures/reference were recorded on one CPU; torch's kernels (ATen's
vectorised loops, MKL, oneDNN) round differently on another instruction set, so a check that
recomputes them (tests/test_reference_fixtures.py::test_recorded_fixtures_are_current) needs a
tolerance from this spread. Each setting runs in a fresh process with torch told to use the kernels
of a smaller CPU (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA), which imitates
that CPU in part. Run in the reference environment:

    .venvs/mlxvlm-0.7.10/bin/python scripts/reference/cpu_spread.py [CASE ...]

Prints, per setting and float array, the largest absolute difference, the array's largest
magnitude and their ratio (the test allows 1e-5 of the magnitude); integer arrays must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "reference"
SETTINGS = {
    "native": {},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten-scalar": {"ATEN_CPU_CAPABILITY": "default"},
    "all-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "all-sse4": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
TAG = "SPREAD-JSON "


def measure(cases) -> dict:
    """In this process: recompute ``cases`` and compare them with the fixtures."""
    import torch

    from scripts.checklist.harness import read_case_arrays
    from scripts.reference import model_outputs

    index = json.loads((FIXTURES / "index.json").read_text(encoding="utf-8"))
    results, _ = model_outputs.record(list(cases))
    rows = {"capability": torch.backends.cpu.get_cpu_capability()}
    for case in cases:
        recorded = read_case_arrays(FIXTURES / index["cases"][case]["file"])
        live = results[case]
        if "pixel_values_codes" in live:
            codes, levels = live.pop("pixel_values_codes"), live.pop("pixel_values_levels")
            live["pixel_values"] = model_outputs.unpack_pixel_values(codes, levels)
        for key, value in live.items():
            want = recorded[key]
            if np.issubdtype(value.dtype, np.integer):
                rows[f"{case}/{key}"] = {"equal": bool(np.array_equal(value, want))}
            else:
                diff = float(np.abs(value.astype(np.float64) - want).max())
                rows[f"{case}/{key}"] = {"max_abs": diff, "magnitude": float(np.abs(want).max())}
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", default=["text_short", "img_448"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(TAG + json.dumps(measure(args.cases)), flush=True)
        return 0
    worst = 0.0
    for name, overrides in SETTINGS.items():
        env = {**os.environ, **overrides}
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", *args.cases],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith(TAG)]
        if proc.returncode or not lines:
            print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
            return 1
        rows = json.loads(lines[-1][len(TAG) :])
        print(f"{name} (torch kernels: {rows.pop('capability')}; {overrides or 'no overrides'})")
        for key, row in rows.items():
            if "equal" in row:
                print(f"  {key:32s} {'equal' if row['equal'] else 'DIFFERENT'}")
                continue
            ratio = row["max_abs"] / row["magnitude"] if row["magnitude"] else 0.0
            worst = max(worst, ratio)
            print(f"  {key:32s} max |diff| {row['max_abs']:.3g} of {row['magnitude']:.3g} ({ratio:.2g})")
    print(f"largest difference / magnitude: {worst:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
