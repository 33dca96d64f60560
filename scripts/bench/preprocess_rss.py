"""Peak resident memory of preprocessing one huge image with the cohere_compass processor.

Run it as its own process so the figure is clean (no other test's allocations):

    .venvs/mlxvlm-0.6.12/bin/python scripts/bench/preprocess_rss.py            # 20000x20000 RGB
    .venvs/mlxvlm-0.6.12/bin/python scripts/bench/preprocess_rss.py --side 5000 --max-pixels 602112

It builds the image in memory (a 20000x20000 file is refused before decoding by PIL's
decompression-bomb guard, in mlx-vlm's ``load_image`` and in the processor alike), then
resets the kernel's peak-RSS counter (``/proc/self/clear_refs``, Linux) and runs the image
processor once. It prints one JSON object: RSS before and after building the image, the peak
while preprocessing, the growth over the image itself, and the output grid and token count,
which max pixels bounds. ``--impl reference`` measures transformers' own PIL image processor
(transformers >= 5.21) on the same input instead, for comparison.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import sys
import time
from pathlib import Path

from compass_data import tiny

ROOT = Path(__file__).resolve().parents[2]
PROCESSING = ROOT / "vendor" / "mlx_vlm" / "models" / "cohere_compass" / "image_processing_cohere_compass.py"
MIB = 1024 * 1024

# The published preprocessor_config.json values; the size is set per run.
PUBLISHED = {k: v for k, v in tiny.PUBLISHED_IMAGE_PROCESSOR.items() if k != "size"}


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _image_processor(impl: str, min_pixels: int, max_pixels: int):
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    if impl == "reference":
        from transformers.models.cohere_compass.image_processing_pil_cohere_compass import (
            CohereCompassImageProcessorPil,
        )

        return CohereCompassImageProcessorPil(**PUBLISHED, size=size)
    spec = importlib.util.spec_from_file_location("compass_processing_rss", PROCESSING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CohereCompassImageProcessor(**PUBLISHED, size=size)


def measure(side: int, height: int, mode: str, impl: str, min_pixels: int, max_pixels: int) -> dict:
    from PIL import Image

    processor = _image_processor(impl, min_pixels, max_pixels)
    baseline = _status_kib("VmRSS")
    start = time.perf_counter()
    color = {"L": 128, "RGB": (200, 120, 40), "RGBA": (200, 120, 40, 128)}[mode]
    image = Image.new(mode, (side, height), color)  # filled, so every page is resident
    with_image = _status_kib("VmRSS")
    exact = _reset_peak()
    out = processor(image, return_tensors="np")
    peak = _status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = time.perf_counter() - start
    grid = [int(v) for v in out["image_grid_thw"][0]]
    merge = PUBLISHED["merge_size"]
    return {
        "impl": impl,
        "image": f"{side}x{height} {mode}",
        "image_rss_mib": round((with_image - baseline) / 1024, 1),  # PIL keeps RGB as 4 bytes a pixel
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "rss_before_image_mib": round(baseline / 1024, 1),
        "rss_with_image_mib": round(with_image / 1024, 1),
        "peak_rss_mib": round(peak / 1024, 1),
        "peak_over_image_mib": round((peak - with_image) / 1024, 1),
        "peak_exact": exact,
        "grid_thw": grid,
        "resized": [grid[1] * PUBLISHED["patch_size"], grid[2] * PUBLISHED["patch_size"]],
        "image_tokens": grid[0] * (grid[1] // merge) * (grid[2] // merge),
        "pixel_values_mib": round(out["pixel_values"].nbytes / MIB, 1),
        "seconds": round(seconds, 2),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=20000, help="image width (default 20000)")
    parser.add_argument("--height", type=int, default=None, help="image height (default: --side)")
    parser.add_argument("--mode", choices=("L", "RGB", "RGBA"), default="RGB")
    parser.add_argument("--impl", choices=("ours", "reference"), default="ours")
    parser.add_argument("--min-pixels", type=int, default=65536, help="default: published 65536")
    parser.add_argument("--max-pixels", type=int, default=16777216, help="default: published 16777216")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        parser.error("reads /proc/self/status: Linux only")
    result = measure(args.side, args.height or args.side, args.mode, args.impl, args.min_pixels, args.max_pixels)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
