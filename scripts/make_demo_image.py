"""Draw compass_compat/assets/demo.png, the picture `python -m compass_compat generate` uses by default.

A 320x240 flat-colour scene (sky, sun, hills, a compass rose) drawn with PIL primitives only:
no randomness, no fonts, no antialiasing, 16-colour palette, so the PNG is a few KB and the
same script gives the same pixels. The committed file is the source of truth; rerun this
only to change the picture:

    python scripts/make_demo_image.py [OUT]
"""

from __future__ import annotations

import math
import pathlib
import sys

from PIL import Image, ImageDraw

WIDTH, HEIGHT = 320, 240
OUT = pathlib.Path(__file__).resolve().parents[1] / "compass_compat" / "assets" / "demo.png"


def star(cx: float, cy: float, outer: float, inner: float, points: int, phase: float):
    """Vertices of a star polygon (alternating outer / inner radius), clockwise from `phase`."""
    verts = []
    for i in range(2 * points):
        r = outer if i % 2 == 0 else inner
        a = phase + math.pi * i / points
        verts.append((round(cx + r * math.sin(a)), round(cy - r * math.cos(a))))
    return verts


def draw() -> Image.Image:
    im = Image.new("RGB", (WIDTH, HEIGHT), (120, 180, 235))  # sky
    d = ImageDraw.Draw(im)
    for i, color in enumerate([(135, 195, 240), (150, 205, 245), (170, 215, 248)]):
        d.rectangle([0, 40 * (i + 1), WIDTH, 40 * (i + 2)], fill=color)  # banded sky
    d.ellipse([236, 18, 292, 74], fill=(255, 205, 60))  # sun
    d.polygon([(0, 200), (70, 150), (150, 195), (230, 140), (320, 190), (320, 240), (0, 240)], fill=(70, 140, 70))
    d.polygon([(0, 240), (0, 220), (110, 185), (200, 225), (320, 205), (320, 240)], fill=(50, 110, 55))
    # Compass rose: a disc, an eight-point star, the north point in red.
    cx, cy = 96, 104
    d.ellipse([cx - 62, cy - 62, cx + 62, cy + 62], fill=(245, 240, 225), outline=(60, 60, 70), width=3)
    d.polygon(star(cx, cy, 50, 14, 4, math.pi / 4), fill=(150, 150, 160))
    d.polygon(star(cx, cy, 58, 12, 4, 0.0), fill=(40, 45, 60))
    d.polygon([(cx, cy - 58), (cx - 12, cy), (cx + 12, cy)], fill=(200, 40, 40))
    d.ellipse([cx - 6, cy - 6, cx + 6, cy + 6], fill=(245, 240, 225))
    return im.quantize(colors=16, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)


def main(argv) -> int:
    out = pathlib.Path(argv[1]) if len(argv) > 1 else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    draw().save(out, format="PNG", optimize=True)
    print(f"wrote {out} ({out.stat().st_size} bytes, {WIDTH}x{HEIGHT})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
