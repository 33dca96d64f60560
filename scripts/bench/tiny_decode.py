"""Per-step decode overhead on the tiny checkpoint: ours (CPU lanes on, off) vs upstream.

    .venvs/mlxvlm-0.7.10/bin/python scripts/bench/tiny_decode.py                # ~1 min
    .venvs/mlxvlm-0.7.10/bin/python scripts/bench/tiny_decode.py --profile --graph

The tiny default checkpoint (``compass_data.tiny``, MLX layout, float32 unless ``--dtype``)
has layers far below the CPU-lane split threshold, so a decode step is a few hundred tiny ops
and what it costs is dispatch: Python building the graph, MLX scheduling each op. Three
``scripts/bench/fullsize.py`` workers stay loaded, in the mlx-vlm environment this runs in (>= 0.6.13,
which ships upstream's own ``cohere_compass``):

- ``ours-lanes``: the vendored package (forced), default lanes (the cores this process may use);
- ``ours-nolanes``: the same with ``COMPASS_COMPAT_CPU_LANES=1`` (splitting off);
- ``upstream``: mlx-vlm's own ``cohere_compass``.

Every round each worker prefills ``--prompt`` tokens and decodes ``--steps`` greedily with
mlx-lm's ``async_eval`` loop (bench.py's ``text`` op); the order rotates per round. Prints each
round, then medians: decode tokens/s, the host time spent building a step's graph (ms), the
process CPU time per step (all threads: a steadier figure than wall time on a shared machine),
and ours/upstream. ``--graph``: primitives in one decode step's graph (``mx.export_to_dot``).
``--profile``: cProfile of the host side of ``--profile-steps`` decode steps per worker, top
functions by own time (microseconds per step; profiling inflates them, compare rows, not totals).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np

from scripts.bench import fullsize as bench  # its worker runs the decode loop and checks which implementation is live

LANES_ENV = "COMPASS_COMPAT_CPU_LANES"
WORKERS = {  # name -> (implementation, CPU lanes setting; None = the default)
    "ours-lanes": ("ours", None),
    "ours-nolanes": ("ours", "1"),
    "upstream": ("upstream", None),
}


@contextlib.contextmanager
def lanes_env(value):
    saved = os.environ.get(LANES_ENV)
    if value is None:
        os.environ.pop(LANES_ENV, None)
    else:
        os.environ[LANES_ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LANES_ENV, None)
        else:
            os.environ[LANES_ENV] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=150, help="decode steps per round")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens before each round's decode")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--only", nargs="*", choices=sorted(WORKERS), help="run only these workers")
    parser.add_argument("--graph", action="store_true", help="count the primitives of one decode step")
    parser.add_argument("--profile", action="store_true", help="cProfile the host side of decode")
    parser.add_argument("--profile-steps", type=int, default=300)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    from compass_data.tiny import build_tiny_checkpoint, tokenizer_vocab_size

    work = pathlib.Path(tempfile.mkdtemp(prefix="compass-tiny-decode-"))
    checkpoint = build_tiny_checkpoint(work / "tiny", layout="mlx", dtype=args.dtype)
    inputs = work / "inputs.npz"
    rng = np.random.default_rng(0)
    np.savez(
        inputs,
        text=rng.integers(10, tokenizer_vocab_size(), size=args.prompt).astype(np.int32),
        image_token_id=np.int64(-1),
    )

    names = args.only or list(WORKERS)
    workers = {}
    try:
        for name in names:
            impl, lanes = WORKERS[name]
            with lanes_env(lanes):
                workers[name] = bench.Worker(name, impl, args.dtype, checkpoint, inputs, 0)
        lane_counts = {n: w.call("stats")["cpu_lanes"] for n, w in workers.items()}
        load = os.getloadavg()[0]
        print(
            f"tiny checkpoint ({args.dtype}), {args.rounds} rounds x {args.steps} decode steps, "
            f"prompt {args.prompt}; CPU lanes {lane_counts} (upstream: n/a); load average {load:.2f}"
        )
        for w in workers.values():  # warm: first-call allocations and imports
            w.call("text", prompt=args.prompt, decode=20)
        results = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                res = workers[name].call("text", prompt=args.prompt, decode=args.steps)
                results[name].append(res)
                print(
                    f"round {r + 1}/{args.rounds} {name:13s} {res['decode_tps']:7.1f} tok/s  "
                    f"graph build {res['decode_build_ms']:.3f} ms/step  "
                    f"CPU {res['decode_cpu_ms']:.3f} ms/step",
                    flush=True,
                )
        med = {
            n: {k: statistics.median(x[k] for x in rs) for k in ("decode_tps", "decode_build_ms", "decode_cpu_ms")}
            for n, rs in results.items()
        }
        print()
        print("| worker | decode tok/s | graph build ms/step | CPU ms/step | tok/s vs upstream | CPU vs upstream |")
        print("|---|---|---|---|---|---|")
        up = med.get("upstream")
        for n in names:
            m = med[n]
            vs = f"{m['decode_tps'] / up['decode_tps']:.2f}" if up else "—"
            cpu_vs = f"{m['decode_cpu_ms'] / up['decode_cpu_ms']:.2f}" if up else "—"
            print(
                f"| {n} | {m['decode_tps']:.1f} | {m['decode_build_ms']:.3f} | {m['decode_cpu_ms']:.3f} | {vs} | {cpu_vs} |"
            )
        print("(medians over rounds; CPU: process CPU time, every thread, per decode step)")
        print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")

        if args.graph:
            print("\nprimitives in one decode step's graph:")
            for n, w in workers.items():
                g = w.call("decode_graph", prompt=args.prompt)
                top = ", ".join(f"{k} {v}" for k, v in list(g["by_op"].items())[:12])
                print(f"  {n:13s} {g['nodes']:5d} nodes: {top}")
        if args.profile:
            for n, w in workers.items():
                p = w.call("decode_profile", prompt=args.prompt, steps=args.profile_steps, top=args.top)
                print(
                    f"\ncProfile {n}: {args.profile_steps} steps, {1e3 * p['total_s'] / p['steps']:.3f} ms "
                    "host time per step (profiled)"
                )
                print(f"  {'own us/step':>11s} {'cum us/step':>11s} {'calls/step':>10s}  function")
                for row in p["top"]:
                    print(
                        f"  {row['own_us_per_step']:11.1f} {row['cum_us_per_step']:11.1f} "
                        f"{row['calls_per_step']:10.1f}  {row['function']}"
                    )
    finally:
        for w in workers.values():
            w.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
