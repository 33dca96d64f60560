"""Write compass_compat/assets/demo_clip.avi, the clip the README's video example uses.

The demo scene of compass_data.shapes (a blue square and a yellow star, 192x192) with the star
sliding left, 8 frames at 4 frames per second, drawn by that module and written losslessly
(FFV1 in AVI, which OpenCV reads back bit-exact). The committed file is the source of truth;
rerun this only to change the clip:

    python scripts/package_data/demo_clip.py [OUT]
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

from compass_data import shapes

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "compass_compat" / "assets" / "demo_clip.avi"
FRAMES, FPS = 8, 4.0


def frames():
    square, star = shapes.DEMO_SCENE.shapes
    for i in range(FRAMES):
        moved = dataclasses.replace(star, left=star.left - 4 * i)
        yield shapes.render(dataclasses.replace(shapes.DEMO_SCENE, shapes=(square, moved)))


def main(argv) -> int:
    import cv2

    out = pathlib.Path(argv[1]) if len(argv) > 1 else OUT
    writer = cv2.VideoWriter(str(out), cv2.VideoWriter_fourcc(*"FFV1"), FPS, (192, 192))
    if not writer.isOpened():
        raise SystemExit("OpenCV cannot write FFV1 here")
    for frame in frames():
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    print(f"wrote {out} ({out.stat().st_size} bytes, {FRAMES} frames at {FPS:g} fps)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
