"""Item 3's probe: are the checkpoint folder's image files (pixel bounds, mean/std) honoured?"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np

from ..harness import PIXEL_TOL, Context
from ..report import error_text


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> Tuple[int, int]:
    """Target size: sides rounded to multiples of ``factor``, area within [min, max] pixels, exact arithmetic."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return h, w


def _solid_image(path: Path, size: Tuple[int, int], colour: Tuple[int, int, int]) -> Path:
    from PIL import Image

    if not path.is_file():
        Image.new("RGB", size, colour).save(path)
    return path


def preprocessor_probe(ctx: Context) -> Dict[str, Any]:
    """Is preprocessor_config.json honoured? Exact-arithmetic expectations from the file's values.

    The ``small_max_pixels`` checkpoint's tokenizer_config.json says min 16384 / max 65536
    pixels and its preprocessor_config.json a non-default mean/std. A solid 64x64 image must be scaled up to the min-pixel bound and
    normalise to exactly ``(v/255 - mean) / std``; the 640x480 fixture image must be scaled
    down under the max-pixel bound. The bounds are the folder's as transformers resolves them
    (``checkpoint_checks.pixel_bounds``: processor_config.json's block over this file,
    tokenizer_config.json's min/max_pixels over both), the resolution the processor uses.
    """
    from compass_compat.checkpoint_checks import pixel_bounds

    folder = ctx.checkpoint("small_max_pixels")
    bounds = pixel_bounds(folder)
    conf = bounds.image_config
    model, processor = ctx.load(folder)
    factor = conf["patch_size"] * conf["merge_size"]
    lo, hi = bounds.min_pixels, bounds.max_pixels
    colour = (200, 120, 40)
    probes = [
        ("solid 64x64", _solid_image(ctx.workdir / "solid_64x64.png", (64, 64), colour), (64, 64)),
        ("640x480", Path(ctx.reference.images_dir / "synth_640x480.png"), (480, 640)),
    ]
    meta = ctx.reference.cases[ctx.reference.names("image")[0]]
    template = meta["prompt"]
    out: Dict[str, Any] = {
        "problems": [],
        "file": {"min_pixels": lo, "max_pixels": hi, "image_mean": conf["image_mean"], "image_std": conf["image_std"]},
    }
    for label, image, (h, w) in probes:
        th, tw = smart_resize(h, w, factor, lo, hi)
        want_grid = [1, th // conf["patch_size"], tw // conf["patch_size"]]
        try:
            fed = ctx.prompt_path(model, processor, template, [str(image)], 1)["fed"]
        except Exception as exc:  # the error is the evidence
            out["problems"].append(f"{label}: {error_text(exc)}")
            continue
        grid = None if fed["image_grid_thw"] is None else np.asarray(fed["image_grid_thw"]).reshape(-1).tolist()
        out[label] = {"grid": grid, "expected_grid": want_grid}
        if grid != want_grid:
            out["problems"].append(f"{label}: grid {grid}, file's pixel bounds give {want_grid}")
        if label.startswith("solid") and fed["pixel_values"] is not None:
            mean = np.asarray(conf["image_mean"], np.float64)
            std = np.asarray(conf["image_std"], np.float64)
            want = (np.asarray(colour, np.float64) / 255.0 - mean) / std
            px = np.asarray(fed["pixel_values"], np.float64).reshape(
                -1, 3, conf["temporal_patch_size"], conf["patch_size"] ** 2
            )
            got = [float(px[:, c].mean()) for c in range(3)]
            err = max(float(np.max(np.abs(px[:, c] - want[c]))) for c in range(3))
            out[label].update(channel_values=got, expected=want.tolist(), max_abs=err)
            if not err <= PIXEL_TOL:
                out["problems"].append(
                    f"{label}: normalised channels {[round(v, 4) for v in got]}, the file's mean/std give "
                    f"{[round(v, 4) for v in want.tolist()]}"
                )
    return out
