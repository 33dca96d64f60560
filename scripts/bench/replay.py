"""Time to first token for an 896x896 image prompt: uncached vs features replayed via encode_image.

Runs on the small default (random-weight) checkpoint; prints medians of interleaved runs.

    .venvs/mlxvlm-0.3.9/bin/python scripts/bench/replay.py [--model PATH] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image

import compass_compat  # noqa: F401  (applies the patch)


def first_token(model, input_ids, **kwargs) -> float:
    tic = time.perf_counter()
    out = model(input_ids, cache=model.language_model.make_cache(), **kwargs)
    mx.eval(mx.argmax(out.logits[0, -1]))
    return time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: build the tiny default checkpoint)")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template

    path = args.model
    if path is None:
        from compass_data.tiny import build_tiny_checkpoint

        path = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    model, processor = load(str(path))
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (896, 896, 3), dtype=np.uint8))
    prompt = apply_chat_template(processor, model.config, "Describe this image.", num_images=1)
    inputs = processor(text=[prompt], images=[image], return_tensors="np")
    ids = mx.array(inputs["input_ids"])
    pv = mx.array(inputs["pixel_values"])
    grid = mx.array(inputs["image_grid_thw"])

    def uncached():
        return first_token(model, ids, pixel_values=pv, image_grid_thw=grid)

    def replayed():
        return first_token(model, ids, pixel_values=None, image_grid_thw=grid, cached_image_features=features)

    tic = time.perf_counter()
    features = model.encode_image(pv, grid)
    mx.eval(features)
    encode_time = time.perf_counter() - tic
    uncached(), replayed()  # warm-up
    a, b = [], []
    for _ in range(args.runs):
        a.append(uncached())
        b.append(replayed())
    ua, rb = statistics.median(a), statistics.median(b)
    print(f"checkpoint: {path}")
    print(f"image 896x896 -> grid {np.asarray(inputs['image_grid_thw']).tolist()}, prompt {ids.shape[1]} tokens")
    print(f"encode_image (one-off): {encode_time * 1000:.1f} ms")
    print(f"time to first token, uncached: {ua * 1000:.1f} ms (median of {args.runs})")
    print(f"time to first token, replayed: {rb * 1000:.1f} ms (median of {args.runs})")
    print(f"replayed / uncached: {rb / ua:.2f}")


if __name__ == "__main__":
    main()
