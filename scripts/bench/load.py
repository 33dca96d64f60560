"""Load time of ours and upstream's cohere_compass, alone and alternating, fresh process each.

The benchmark's load row is a median of a few rounds taken between other workers, whose
gigabytes come and go; this isolates the load itself:

    .venvs/mlxvlm-0.7.10/bin/python scripts/bench/load.py               # bf16, 3 rounds
    .venvs/mlxvlm-0.7.10/bin/python scripts/bench/load.py --variant 4bit --rounds 5

Needs mlx-vlm >= 0.6.13 (upstream's own package) and the stand-in checkpoint of
``scripts/bench/build_fullsize.py`` (built on first use). Each load is a ``scripts/bench/fullsize.py`` worker
process that only loads: ``mlx_vlm.utils.load_model`` plus ``mx.eval`` of the parameters, timed
after its imports, as in the benchmark; the order alternates (upstream first in odd rounds).
Prints one line per load, then the medians and their ratio (upstream / ours: > 1 means ours
loads faster).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from scripts.bench import build_fullsize
from scripts.bench import fullsize as bench  # its Worker times the load and checks which implementation is live


def load_once(impl: str, variant: str, checkpoint: Path) -> float:
    worker = bench.Worker(impl, impl, variant, checkpoint, None, 0)
    worker.close()
    return worker.load_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=["bf16", "4bit"], default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", help="stand-in checkpoint cache (default: scripts/bench/build_fullsize.py's)")
    args = parser.parse_args()
    checkpoint = Path(build_fullsize.ensure_checkpoint(args.variant, args.dir))
    load_once("upstream", args.variant, checkpoint)  # untimed: brings the files into the page cache
    times = {"ours": [], "upstream": []}
    for r in range(args.rounds):
        for impl in ("upstream", "ours") if r % 2 == 0 else ("ours", "upstream"):
            times[impl].append(load_once(impl, args.variant, checkpoint))
            print(f"round {r + 1}: {impl:8s} {times[impl][-1]:.2f} s", flush=True)
    ours, up = statistics.median(times["ours"]), statistics.median(times["upstream"])
    print(f"median ({args.variant}): ours {ours:.2f} s, upstream {up:.2f} s, upstream/ours {up / ours:.2f}")


if __name__ == "__main__":
    main()
