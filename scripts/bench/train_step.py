"""A training step's time through ``python -m mlx_vlm.train``: this project's model against upstream's own.

    PYTHONPATH=. nice .venvs/mlxvlm-0.7.10/bin/python scripts/bench/train_step.py [--short 40 --long 120 --repeats 3]

On an mlx-vlm that ships its own ``cohere_compass`` (0.7.10), the same trainer command, on the same
tiny checkpoint and shape dataset (``scripts/train/probe_modes.py``), runs with this project's
model (``COMPASS_COMPAT_FORCE_VENDORED=1``) and with upstream's, in alternation. Each is timed
for ``--short`` and ``--long`` iterations (LoRA, batch 1); the step time is the difference over
the extra iterations, so loading, the final save and the validation pass cancel out. Prints the
median step time of each and the ratio (ours / upstream's), from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from compass_data.tiny import build_tiny_checkpoint
from scripts.train import probe_modes

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = {"ours": "1", "upstream": "0"}  # COMPASS_COMPAT_FORCE_VENDORED


def run_seconds(force: str, model: pathlib.Path, data: pathlib.Path, iters: int, out: pathlib.Path) -> float:
    """Wall seconds of one trainer run of ``iters`` LoRA steps."""
    args = ["--model", str(model), "--data", str(data), "--iters", str(iters), "--batch-size", "1"]
    args += ["--steps-per-report", "1000", "--steps-per-eval", "100000", "--output-path", str(out)]
    env = dict(
        os.environ,
        COMPASS_COMPAT_AUTOPATCH="1",
        COMPASS_COMPAT_FORCE_VENDORED=force,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", probe_modes.NEW_CLI, *args], env=env, capture_output=True, text=True, cwd=out.parent
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"trainer run failed (FORCE_VENDORED={force}):\n{proc.stderr[-2000:]}")
    return seconds


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", type=int, default=40)
    parser.add_argument("--long", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path, help="also write the figures here")
    args = parser.parse_args(argv)
    import mlx.core as mx
    import mlx_vlm

    if probe_modes.cli() != probe_modes.NEW_CLI:
        raise SystemExit("needs mlx-vlm 0.7.x (python -m mlx_vlm.train) with its own cohere_compass")
    with tempfile.TemporaryDirectory(prefix="compass-train-step-") as tmp:
        work = pathlib.Path(tmp)
        model = build_tiny_checkpoint(work / "tiny", layout="original")
        data = probe_modes.write_datasets(work / "data")["sft"]
        steps: Dict[str, List[float]] = {name: [] for name in MODELS}
        for repeat in range(args.repeats):
            for name, force in MODELS.items():
                short = run_seconds(force, model, data, args.short, work / f"{name}-{repeat}-s")
                long = run_seconds(force, model, data, args.long, work / f"{name}-{repeat}-l")
                steps[name].append((long - short) / (args.long - args.short))
                print(
                    f"repeat {repeat} {name}: {args.short} steps {short:.2f} s, {args.long} steps {long:.2f} s",
                    flush=True,
                )
    median = {name: statistics.median(values) for name, values in steps.items()}
    ratio = median["ours"] / median["upstream"]
    print(
        f"\nmlx-vlm {mlx_vlm.__version__}, mlx {mx.__version__}, tiny checkpoint, LoRA, batch 1, "
        f"step = (t({args.long}) - t({args.short})) / {args.long - args.short}, median of {args.repeats}"
    )
    for name in MODELS:
        shown = ", ".join(f"{1000 * v:.1f}" for v in steps[name])
        print(f"{name:9s} {1000 * median[name]:.1f} ms/step  ({shown})")
    print(f"ratio ours / upstream: {ratio:.2f}")
    if args.json:
        record = {"mlx_vlm": mlx_vlm.__version__, "steps_s": steps, "median_s": median, "ratio": ratio}
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
