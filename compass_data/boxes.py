"""Boxes in generated text: find ``[x1, y1, x2, y2]`` on the model's 0-1000 grid, scale, draw.

North-Micro-Vision answers grounding questions with boxes ``[x1, y1, x2, y2]`` on a 0-1000
grid relative to the image: 0 is the left (top) edge, 1000 the right (bottom) edge, whatever
the image's pixel size.

Rules (the same for every caller, the CLI's ``--draw-boxes`` included):

- A box is a square-bracketed list of exactly four numbers separated by commas, whitespace
  anywhere around them: ``[12, 40, 600, 980]``, ``[ 12 ,40,600 , 980 ]``, across lines. Numbers
  are plain decimals (``12``, ``12.5``, ``-3``); no exponents, no thousands separators. The
  list may sit in prose, in JSON-like text (``{"bbox_2d": [12, 40, 600, 980]}``) or in a list
  of boxes (``[[12, 40, 600, 980], [0, 0, 10, 10]]``): only innermost brackets are read.
- A four-number list is *rejected*, not repaired, when a value is outside 0..1000 or when
  ``x1 > x2`` or ``y1 > y2``. Clamping or swapping would turn something that is not a box in
  the model's format (pixel coordinates, ``[x, y, w, h]``, four years) into a box it never
  meant. Equal edges (a zero-width or zero-height box) are accepted. :func:`scan_boxes` says
  why a list was rejected; :func:`find_boxes` returns the accepted boxes only.
- Lists with another number of elements, or with anything but numbers, are not boxes and are
  skipped silently (``[1]``, ``[1, 2, 3]``, ``["a", 1, 2, 3]``, eight numbers in one list).
- Boxes come back in the order they appear in the text; duplicates are kept.

Pixel coordinates (:func:`to_pixels`) are floats in continuous image coordinates, where pixel
column ``i`` covers ``[i, i + 1)``: grid 0 maps to 0 and grid 1000 to ``width`` (``height``),
the far edge of the last pixel, not ``width - 1``. That makes the scaling one exact
``value * width / 1000`` and keeps a full-image box ``[0, 0, 1000, 1000]`` equal to
``(0, 0, width, height)``. :func:`pixel_rect` gives the integer pixel indices a box covers
(inclusive on both ends, as PIL's ``ImageDraw.rectangle`` takes them): a full-image box is
``(0, 0, width - 1, height - 1)``.
"""

from __future__ import annotations

import math
import re
from typing import List, NamedTuple, Optional, Sequence, Tuple

from PIL import Image, ImageDraw, ImageFont

GRID = 1000
"""The model's coordinate grid: 0 is the left/top edge, ``GRID`` the right/bottom edge."""

_INNERMOST_LIST = re.compile(r"\[([^\[\]]*)\]")
_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


class GridBox(NamedTuple):
    """A box on the model's 0-1000 grid: left, top, right, bottom."""

    x1: float
    y1: float
    x2: float
    y2: float


class PixelBox(NamedTuple):
    """A box in continuous pixel coordinates (floats): left, top, right, bottom edges."""

    x1: float
    y1: float
    x2: float
    y2: float


class BoxMatch(NamedTuple):
    """One four-number list found in the text.

    ``values`` are the four numbers as written; ``start``/``end`` the span of the bracketed
    list in the text; ``problem`` is None for a box, else why it was rejected.
    """

    values: Tuple[float, float, float, float]
    start: int
    end: int
    problem: Optional[str]

    @property
    def box(self) -> Optional[GridBox]:
        return GridBox(*self.values) if self.problem is None else None


def _problem(x1: float, y1: float, x2: float, y2: float) -> Optional[str]:
    outside = [v for v in (x1, y1, x2, y2) if not 0 <= v <= GRID]
    if outside:
        return f"{format_number(outside[0])} is outside 0..{GRID}"
    if x1 > x2:
        return f"x1 > x2 ({format_number(x1)} > {format_number(x2)})"
    if y1 > y2:
        return f"y1 > y2 ({format_number(y1)} > {format_number(y2)})"
    return None


def scan_boxes(text: str) -> List[BoxMatch]:
    """Every bracketed list of exactly four numbers in ``text``, accepted or rejected, in order."""
    found = []
    for match in _INNERMOST_LIST.finditer(text):
        parts = [p.strip() for p in match.group(1).split(",")]
        if len(parts) != 4 or not all(_NUMBER.fullmatch(p) for p in parts):
            continue
        values = tuple(float(p) for p in parts)
        found.append(BoxMatch(values, match.start(), match.end(), _problem(*values)))
    return found


def find_boxes(text: str) -> List[GridBox]:
    """The boxes in ``text`` (the rules are in the module docstring), in order of appearance."""
    return [m.box for m in scan_boxes(text) if m.problem is None]


def _check_size(size: Tuple[int, int]) -> Tuple[int, int]:
    width, height = size
    if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        raise ValueError(f"image size must be two positive ints (width, height), got {size!r}")
    return width, height


def to_pixels(box: GridBox, size: Tuple[int, int]) -> PixelBox:
    """``box`` in continuous pixel coordinates of an image of ``size = (width, height)``.

    Floats, not rounded: grid 0 -> 0.0, grid 1000 -> ``width`` / ``height``; each value is
    ``value * width / 1000`` (``value * height / 1000`` for y), one correctly rounded division.
    """
    width, height = _check_size(size)
    x1, y1, x2, y2 = box
    return PixelBox(x1 * width / GRID, y1 * height / GRID, x2 * width / GRID, y2 * height / GRID)


def pixel_rect(box: GridBox, size: Tuple[int, int]) -> Tuple[int, int, int, int]:
    """The pixels ``box`` touches, as inclusive indices ``(left, top, right, bottom)``.

    Every pixel the continuous box overlaps is in; a zero-width (zero-height) box still covers
    one column (row). The result is inside the image: ``0 <= left <= right <= width - 1``.
    """
    width, height = _check_size(size)
    px = to_pixels(box, size)

    def span(lo: float, hi: float, n: int) -> Tuple[int, int]:
        first = min(math.floor(lo), n - 1)
        return first, max(first, min(math.ceil(hi) - 1, n - 1))

    left, right = span(px.x1, px.x2, width)
    top, bottom = span(px.y1, px.y2, height)
    return left, top, right, bottom


def format_number(value: float) -> str:
    """``12.0`` -> ``"12"``, ``12.5`` -> ``"12.5"``, ``76.8125`` -> ``"76.81"`` (two decimals at most)."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


PALETTE: Tuple[Tuple[int, int, int], ...] = (
    (255, 48, 48),
    (48, 224, 48),
    (64, 160, 255),
    (255, 214, 0),
    (255, 64, 255),
    (0, 232, 232),
)
"""Stroke colours, one per box in turn; each stroke is edged in black so it shows on any background."""

HALO = (0, 0, 0)


def default_stroke(size: Tuple[int, int]) -> int:
    """The coloured stroke's thickness for an image of ``size``: 2 px, more on large images."""
    return max(2, round(min(_check_size(size)) / 250))


def draw_boxes(
    image: Image.Image,
    boxes: Sequence[GridBox],
    labels: Optional[Sequence[Optional[str]]] = None,
    *,
    stroke: Optional[int] = None,
) -> Image.Image:
    """A copy of ``image`` with ``boxes`` (0-1000 grid) outlined; ``image`` itself is not changed.

    Each box is a coloured stroke ``stroke`` px thick (default :func:`default_stroke`) drawn
    inward from the box's :func:`pixel_rect`, with a 1 px black line on both sides of it (the
    outer one just outside the box), so it shows on light, dark and same-coloured backgrounds.
    ``labels[i]`` (if given and not None/empty) is written in a filled tag above box ``i``, or
    inside it when there is no room above. The copy is RGB, or RGBA when ``image`` has
    transparency; pixels away from the strokes and tags keep their values.
    """
    if labels is not None and len(labels) != len(boxes):
        raise ValueError(f"{len(labels)} labels for {len(boxes)} boxes")
    has_alpha = "A" in image.getbands() or "transparency" in image.info
    mode = "RGBA" if has_alpha else "RGB"
    out = image.copy() if image.mode == mode else image.convert(mode)
    thickness = default_stroke(out.size) if stroke is None else int(stroke)
    if thickness < 1:
        raise ValueError(f"stroke must be at least 1 px, got {stroke!r}")
    draw = ImageDraw.Draw(out)
    font = ImageFont.load_default()
    for i, box in enumerate(boxes):
        color = PALETTE[i % len(PALETTE)]
        left, top, right, bottom = pixel_rect(box, out.size)
        draw.rectangle((left - 1, top - 1, right + 1, bottom + 1), outline=HALO, width=thickness + 2)
        draw.rectangle((left, top, right, bottom), outline=color, width=thickness)
        label = labels[i] if labels is not None else None
        if label:
            _draw_tag(draw, font, str(label), left, top, thickness, color)
    return out


def _draw_tag(draw: ImageDraw.ImageDraw, font, label: str, left: int, top: int, thickness: int, color) -> None:
    x0, y0, x1, y1 = draw.textbbox((0, 0), label, font=font)
    pad = 2
    tag_w, tag_h = x1 - x0 + 2 * pad, y1 - y0 + 2 * pad
    above = top - 1 - tag_h  # the tag's top edge when it sits on the box's outer black line
    ty = above if above >= 0 else top + thickness + 1
    tx = left - 1
    draw.rectangle((tx, ty, tx + tag_w, ty + tag_h), fill=color, outline=HALO, width=1)
    draw.text((tx + pad + 1 - x0, ty + pad - y0 + 1), label, fill=HALO, font=font)
