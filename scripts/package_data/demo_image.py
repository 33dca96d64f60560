"""Draw compass_compat/assets/demo.png, the picture `python -m compass_compat generate` uses by default.

The demo scene of compass_data.shapes (``DEMO_SCENE``: a blue square and a yellow star,
192x192), rasterized by that module, so it is a picture of the kind the toy default checkpoint
was trained on, and one it describes, counts, colours and boxes correctly (tests/test_toy.py). The committed file is the source of truth; rerun this only to change the picture:

    python scripts/package_data/demo_image.py [OUT]
"""

from __future__ import annotations

import pathlib
import sys

from PIL import Image

from compass_data import shapes

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "compass_compat" / "assets" / "demo.png"


def main(argv) -> int:
    out = pathlib.Path(argv[1]) if len(argv) > 1 else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(shapes.render(shapes.DEMO_SCENE)).save(out, format="PNG", optimize=True)
    print(f"wrote {out} ({out.stat().st_size} bytes, {shapes.SIZE}x{shapes.SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
