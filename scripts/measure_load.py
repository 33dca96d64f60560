"""Load time of ours and upstream's cohere_compass, alone and alternating, fresh process each.

The benchmark's load row is a median of a few rounds taken between other workers, whose
gigabytes come and go; this isolates the load itself:

    .venvs/mlxvlm-0.7.10/bin/python scripts/measure_load.py               # bf16, 3 rounds
    .venvs/mlxvlm-0.7.10/bin/python scripts/measure_load.py --variant 4bit --rounds 5

Needs mlx-vlm >= 0.6.13 (upstream's own package) and the stand-in checkpoint of
``scripts/build_fullsize.py`` (built on first use). Each load is ``mlx_vlm.utils.load_model``
plus ``mx.eval`` of the parameters, timed inside a new Python process after its imports;
the order alternates (upstream first in odd rounds). Prints one line per load, then the
medians and their ratio (upstream / ours: > 1 means ours loads faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import pathlib, sys, time
import mlx.core as mx
import compass_compat
from mlx_vlm.utils import load_model
tic = time.perf_counter()
model = load_model(pathlib.Path(sys.argv[1]))
mx.eval(model.parameters())
seconds = time.perf_counter() - tic
info = compass_compat.implementation_info()
print(f"RESULT {info.implementation} {seconds:.4f}")
"""


def load_once(impl: str, checkpoint: Path) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["COMPASS_COMPAT_FORCE_VENDORED"] = "1" if impl == "ours" else "0"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(checkpoint)], env=env, capture_output=True, text=True, check=True
    ).stdout
    live, seconds = next(line.split()[1:] for line in out.splitlines() if line.startswith("RESULT "))
    want = "vendored" if impl == "ours" else "upstream"
    if live != want:
        raise SystemExit(f"{impl}: expected the {want} cohere_compass to be live, got {live}")
    return float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=["bf16", "4bit"], default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", help="stand-in checkpoint cache (default: scripts/build_fullsize.py's)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_fullsize

    checkpoint = Path(build_fullsize.ensure_checkpoint(args.variant, args.dir))
    load_once("upstream", checkpoint)  # untimed: brings the files into the page cache
    times = {"ours": [], "upstream": []}
    for r in range(args.rounds):
        for impl in (("upstream", "ours") if r % 2 == 0 else ("ours", "upstream")):
            times[impl].append(load_once(impl, checkpoint))
            print(f"round {r + 1}: {impl:8s} {times[impl][-1]:.2f} s", flush=True)
    ours, up = statistics.median(times["ours"]), statistics.median(times["upstream"])
    print(f"median ({args.variant}): ours {ours:.2f} s, upstream {up:.2f} s, upstream/ours {up / ours:.2f}")


if __name__ == "__main__":
    main()
