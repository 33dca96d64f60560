"""Report (not assert) how far our processor's pixel_values are from transformers'
torchvision backend (`CohereCompassImageProcessor`), which needs torchvision.

The CPU torch==2.13.0 used by the test matrix has no matching torchvision; run this in
a throwaway env, never in CI:

    python3 -m venv /tmp/tvenv
    /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers pillow numpy
    /tmp/tvenv/bin/python scripts/reference/compare_torchvision_backend.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "vendor/mlx_vlm/models/cohere_compass/image_processing_cohere_compass.py"


def load_ours():
    spec = importlib.util.spec_from_file_location("compass_processing", MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def images():
    rng = np.random.default_rng(0)
    for name in sorted((ROOT / "tests/fixtures/images").glob("*.png")):
        yield name.name, Image.open(name).convert("RGB")
    yield "20x20 noise", Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    yield "grayscale 300x200", Image.fromarray(rng.integers(0, 256, (200, 300), dtype=np.uint8), "L")


def main() -> None:
    import transformers
    from transformers.models.cohere_compass import CohereCompassImageProcessor, CohereCompassImageProcessorPil

    ours_module = load_ours()
    config = dict(
        image_mean=[0.48, 0.46, 0.41],
        image_std=[0.27, 0.26, 0.28],
        size={"shortest_edge": 16384, "longest_edge": 602112},
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
    )
    ours = ours_module.CohereCompassImageProcessor(**config)
    torchvision_backend = CohereCompassImageProcessor(**config)
    pil_backend = CohereCompassImageProcessorPil(**config)
    print(f"transformers {transformers.__version__}")
    print("| image | grid | ours vs PIL backend | ours vs torchvision backend | PIL vs torchvision |")
    print("|---|---|---|---|---|")
    for name, image in images():
        a = ours([image])
        b = pil_backend([image], return_tensors="np")
        c = torchvision_backend([image], return_tensors="pt")
        pa, pb = np.asarray(a["pixel_values"]), np.asarray(b["pixel_values"])
        pc = c["pixel_values"].numpy()
        grids = [np.asarray(x).tolist() for x in (a["image_grid_thw"], b["image_grid_thw"], c["image_grid_thw"])]
        same_grid = grids[0] == grids[1] == grids[2]
        print(
            f"| {name} | {grids[0]}{'' if same_grid else ' (grids differ!)'} | {np.abs(pa - pb).max():.2e} | "
            f"{np.abs(pa - pc).max() if pa.shape == pc.shape else 'shape differs'} | "
            f"{np.abs(pb - pc).max() if pb.shape == pc.shape else 'shape differs'} |"
        )


if __name__ == "__main__":
    main()
