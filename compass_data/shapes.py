"""Synthetic shape pictures and their questions: the toy checkpoint's training and test data.

A scene is a picture of ``width x height`` pixels (each from 128 to 448; square or not) on a
light, slightly tinted background with one to three shapes, each of a different kind (circle,
square, triangle, star) and any of four colours, at continuous positions and sizes (a shape's
square cell is 18-45% of the picture's shorter side; shapes in one picture differ in size),
never overlapping. Every scene has one answer per question kind:

========  ================================  =====================================
kind      prompt                            answer
========  ================================  =====================================
describe  ``Describe this picture.``        ``A red circle and a blue square.``
count     ``How many shapes are there?``    ``Two.``
colour    ``What colour is the triangle?``  ``Green.``
where     ``Where is the red circle?``      ``[x1, y1, x2, y2]`` on the 0-1000 grid
========  ================================  =====================================

Shapes are listed left to right (by centre). A box is the shape's extent as drawn (its exact
geometry, :func:`pixel_box`), each x edge ``round(1000 * x / width)`` and each y edge
``round(1000 * y / height)``: the grid North-Micro-Vision answers in (:mod:`compass_data.boxes`).
Text-only prompts (:data:`TEXT_ANSWERS`) have fixed answers.

How a scene becomes pixels is a :class:`Look`: hard or anti-aliased edges, seeded noise, and
JPEG compression at a quality (Pillow's encoder). :func:`render` rasterizes with numpy (a pixel
is inside when its centre is; anti-aliased: the share of 4x4 sub-pixel centres inside, next
to the outline), not with
a drawing library, so the same seed gives the same bytes on every machine. The tests also draw
with :mod:`compass_data.shapes_pil` (Pillow's ``ImageDraw``), a second drawing path that
training never sees.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

SIZE = 192
"""Width and height of the demo picture, in pixels."""
MIN_SIDE, MAX_SIDE = 128, 448
"""Picture widths and heights drawn, in pixels (128 x 128 is the processor's minimum)."""
BUCKETS = {"128-223": (128, 223), "224-319": (224, 319), "320-448": (320, 448)}
"""Size buckets by a picture's longer side, in pixels (the accuracy tests report each)."""
KINDS = ("circle", "square", "triangle", "star")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
BACKGROUND = (245, 245, 240)
CELL = (0.18, 0.45)  # a shape's cell side, as a share of the picture's shorter side
MIN_CELL_PX = 30  # ... and at least this many pixels
GAP = 0.04  # least gap between two cells, as a share of the shorter side
JPEG_QUALITIES = (50, 70, 85, 95)
QUESTION_KINDS = ("describe", "count", "colour", "where")
NUMBER_WORDS = {1: "One", 2: "Two", 3: "Three"}
TEXT_ANSWERS = {
    "Say hello.": "Hello.",
    "Who are you?": "A toy model trained on pictures of shapes.",
    "What can you do?": "I can describe simple shapes in a picture.",
    "What is two plus two?": "Four.",
}
"""Text-only prompts and the fixed answers the toy was trained to give."""

# The shapes' geometry inside their square cell (shares of the cell's side), for every renderer.
CIRCLE_RADIUS = 0.47
SQUARE_INSET = 0.12
TRIANGLE = ((0.5, 0.04), (0.96, 0.92), (0.04, 0.92))
STAR_OUTER, STAR_INNER = 0.47, 0.47 * 0.45


@dataclass(frozen=True)
class Shape:
    """One shape: its kind, colour name, square cell ``(left, top, side)`` in pixels (floats) and
    a small per-channel offset of its colour (``shade``)."""

    kind: str
    colour: str
    left: float
    top: float
    side: float
    shade: Tuple[int, int, int] = (0, 0, 0)

    @property
    def centre(self) -> Tuple[float, float]:
        return self.left + self.side / 2, self.top + self.side / 2

    @property
    def rgb(self) -> Tuple[int, int, int]:
        return tuple(int(np.clip(c + d, 0, 255)) for c, d in zip(COLOURS[self.colour], self.shade))  # type: ignore[return-value]

    def polygon(self) -> List[Tuple[float, float]]:
        """The outline's vertices in pixels (a circle: none, see :data:`CIRCLE_RADIUS`)."""
        s, cx, cy = self.side, *self.centre
        if self.kind == "square":
            a, b = SQUARE_INSET * s, (1 - SQUARE_INSET) * s
            return [(self.left + a, self.top + a), (self.left + b, self.top + a)] + [
                (self.left + b, self.top + b),
                (self.left + a, self.top + b),
            ]
        if self.kind == "triangle":
            return [(self.left + u * s, self.top + v * s) for u, v in TRIANGLE]
        if self.kind == "star":
            radii = [(STAR_OUTER if i % 2 == 0 else STAR_INNER) * s for i in range(10)]
            return [
                (cx + r * math.sin(math.pi * i / 5), cy - r * math.cos(math.pi * i / 5)) for i, r in enumerate(radii)
            ]
        if self.kind == "circle":
            return []
        raise ValueError(f"unknown shape kind {self.kind!r}; expected one of {list(KINDS)}")


@dataclass(frozen=True)
class Question:
    """A prompt about a scene, the kind of question, the answer the toy should give and the
    shape the question names (colour and where questions)."""

    kind: str
    prompt: str
    answer: str
    subject: Optional[Shape] = None


@dataclass(frozen=True)
class Scene:
    """A picture's content; :func:`render` draws it, :func:`questions` asks about it."""

    shapes: Tuple[Shape, ...]
    width: int = SIZE
    height: int = SIZE
    background: Tuple[int, int, int] = BACKGROUND

    @property
    def size(self) -> Tuple[int, int]:
        return self.width, self.height

    def ordered(self) -> Tuple[Shape, ...]:
        """The shapes left to right (by centre, then top to bottom)."""
        return tuple(sorted(self.shapes, key=lambda s: (s.centre[0], s.centre[1])))


@dataclass(frozen=True)
class Look:
    """How a scene is turned into pixels beyond its geometry."""

    antialias: bool = False
    noise: float = 0.0  # standard deviation, in 0-255 steps
    noise_seed: int = 0
    jpeg: Optional[int] = None  # JPEG quality, or None for lossless


PLAIN = Look()


def random_size(rng: np.random.Generator, bucket: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
    """A picture size: square half the time; the longer side within ``bucket`` when given."""
    low, high = bucket or (MIN_SIDE, MAX_SIDE)
    longer = int(rng.integers(low, high + 1))
    shorter = longer if rng.random() < 0.5 else int(rng.integers(MIN_SIDE, longer + 1))
    return (longer, shorter) if rng.random() < 0.5 else (shorter, longer)


def random_scene(rng: np.random.Generator, size: Tuple[int, int] = (SIZE, SIZE)) -> Scene:
    """A scene of ``size = (width, height)`` drawn from ``rng``: 1-3 shapes of distinct kinds
    in non-overlapping cells of continuous positions and sizes."""
    width, height = size
    short = min(width, height)
    count = int(rng.integers(1, 4))
    kinds = rng.permutation(len(KINDS))[:count]
    tint = tuple(int(v) for v in rng.integers(-10, 11, size=3))
    background = tuple(int(np.clip(b + t, 0, 255)) for b, t in zip(BACKGROUND, tint))
    shapes: List[Shape] = []
    for attempt in range(1000):
        if len(shapes) == count:
            break
        # Crowded pictures get smaller cells as attempts fail, so every count fits.
        shrink = 1.0 - 0.5 * attempt / 1000
        side = max(MIN_CELL_PX, float(rng.uniform(*CELL)) * short * shrink)
        left, top = float(rng.uniform(0, width - side)), float(rng.uniform(0, height - side))
        if all(not _cells_touch((left, top, side), (s.left, s.top, s.side), GAP * short) for s in shapes):
            colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
            shade = tuple(int(v) for v in rng.integers(-12, 13, size=3))
            shapes.append(
                Shape(KINDS[kinds[len(shapes)]], colour, round(left, 2), round(top, 2), round(side, 2), shade)
            )  # type: ignore[arg-type]
    else:
        raise AssertionError(f"could not place {count} shapes in {width}x{height}")
    return Scene(tuple(shapes), width, height, background)  # type: ignore[arg-type]


def random_look(rng: np.random.Generator) -> Look:
    """Hard or anti-aliased edges (half each), noise on half the pictures, JPEG on a third."""
    antialias = bool(rng.random() < 0.5)
    noise = float(round(rng.uniform(1.0, 6.0), 2)) if rng.random() < 0.5 else 0.0
    jpeg = int(rng.choice(JPEG_QUALITIES)) if rng.random() < 1 / 3 else None
    return Look(antialias, noise, int(rng.integers(2**31)), jpeg)


def _cells_touch(a: Tuple[float, float, float], b: Tuple[float, float, float], gap: float) -> bool:
    (ax, ay, aside), (bx, by, bside) = a, b
    return ax < bx + bside + gap and bx < ax + aside + gap and ay < by + bside + gap and by < ay + aside + gap


def _inside(shape: Shape, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Which points ``(xs, ys)`` (pixel coordinates) lie inside ``shape``."""
    if shape.kind == "circle":
        cx, cy = shape.centre
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= (CIRCLE_RADIUS * shape.side) ** 2
    verts = shape.polygon()
    # Even-odd rule: count the edges a ray to the right crosses.
    inside = np.zeros(np.broadcast(xs, ys).shape, dtype=bool)
    for (x1, y1), (x2, y2) in zip(verts, verts[1:] + verts[:1]):
        crosses = (y1 > ys) != (y2 > ys)
        with np.errstate(divide="ignore", invalid="ignore"):
            x_at = x1 + (ys - y1) * (x2 - x1) / (y2 - y1)
        inside ^= crosses & (xs < x_at)
    return inside


def coverage(shape: Shape, size: Tuple[int, int], samples: int = 1) -> np.ndarray:
    """``(height, width)`` float array: the share of each pixel inside ``shape``, from
    ``samples x samples`` sub-pixel centres (1: the pixel's centre only, 0 or 1). Sub-pixels
    are looked at only next to the outline: pixels whose centre and four neighbours' centres
    agree count as wholly in or out."""
    region, share = _cell_coverage(shape, size, samples)
    out = np.zeros(size[::-1])
    out[region] = share
    return out


def _cell_coverage(shape: Shape, size: Tuple[int, int], samples: int):
    """(the slices of the cell's region, the coverage there): :func:`coverage` on the pixels
    that can be inside (the cell and a border of one)."""
    width, height = size
    x0, y0 = max(0, int(shape.left) - 1), max(0, int(shape.top) - 1)
    x1 = min(width, int(math.ceil(shape.left + shape.side)) + 2)
    y1 = min(height, int(math.ceil(shape.top + shape.side)) + 2)
    centres = _inside(shape, np.arange(x0, x1)[None, :] + 0.5, np.arange(y0, y1)[:, None] + 0.5)
    share = centres.astype(np.float64)
    if samples > 1:
        padded = np.pad(centres, 1, mode="edge")
        edge = np.zeros_like(centres)
        for dy, dx in ((0, 1), (2, 1), (1, 0), (1, 2)):
            edge |= padded[dy : dy + centres.shape[0], dx : dx + centres.shape[1]] != centres
        rows, cols = np.nonzero(edge)
        offsets = (np.arange(samples) + 0.5) / samples
        sub_x = (cols + x0)[:, None, None] + offsets[None, None, :]
        sub_y = (rows + y0)[:, None, None] + offsets[None, :, None]
        share[rows, cols] = _inside(shape, sub_x, sub_y).mean(axis=(1, 2))
    return (slice(y0, y1), slice(x0, x1)), share


def shape_mask(shape: Shape, size: Tuple[int, int] = (SIZE, SIZE)) -> np.ndarray:
    """Boolean ``(height, width)`` mask of the pixels whose centre lies inside ``shape``."""
    return coverage(shape, size) > 0


def render(scene: Scene, look: Look = PLAIN) -> np.ndarray:
    """The scene as a ``(height, width, 3)`` uint8 RGB array, drawn with numpy."""
    pixels = np.empty((scene.height, scene.width, 3), np.float32)
    pixels[:] = scene.background
    for shape in scene.shapes:
        region, share = _cell_coverage(shape, scene.size, 4 if look.antialias else 1)
        alpha = share[..., None].astype(np.float32)
        pixels[region] = pixels[region] * (1 - alpha) + np.asarray(shape.rgb, np.float32) * alpha
    return finish(pixels, look)


def finish(pixels: np.ndarray, look: Look) -> np.ndarray:
    """Add the look's seeded Gaussian noise, round to uint8, then JPEG-compress if asked."""
    if look.noise:
        noise = np.random.default_rng(look.noise_seed).standard_normal(pixels.shape, dtype=np.float32)
        pixels = pixels + np.float32(look.noise) * noise
    out = np.clip(np.round(pixels), 0, 255).astype(np.uint8)
    return jpeg_roundtrip(out, look.jpeg) if look.jpeg else out


def jpeg_roundtrip(pixels: np.ndarray, quality: int, **options) -> np.ndarray:
    """``pixels`` saved as JPEG at ``quality`` with Pillow and read back."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality, **options)
    return np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))


def pixel_box(shape: Shape) -> Tuple[float, float, float, float]:
    """The shape's exact extent in continuous pixel coordinates: ``(left, top, right, bottom)``."""
    if shape.kind == "circle":
        cx, cy = shape.centre
        r = CIRCLE_RADIUS * shape.side
        return cx - r, cy - r, cx + r, cy + r
    xs, ys = zip(*shape.polygon())
    return min(xs), min(ys), max(xs), max(ys)


def grid_box(shape: Shape, size: Tuple[int, int] = (SIZE, SIZE)) -> Tuple[int, int, int, int]:
    """:func:`pixel_box` on the model's 0-1000 grid of a picture of ``size = (width, height)``."""
    (width, height), (x1, y1, x2, y2) = size, pixel_box(shape)
    return tuple(
        min(1000, max(0, int(round(1000 * v / n)))) for v, n in ((x1, width), (y1, height), (x2, width), (y2, height))
    )  # type: ignore[return-value]


def _named(shape: Shape) -> str:
    return f"{shape.colour} {shape.kind}"


def describe(scene: Scene) -> str:
    items = [f"a {_named(s)}" for s in scene.ordered()]
    text = items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
    return text[0].upper() + text[1:] + "."


def questions(scene: Scene, rng: np.random.Generator) -> Dict[str, Question]:
    """One question of each kind; ``rng`` picks the shape the colour and where questions name."""
    ordered = scene.ordered()
    asked = ordered[int(rng.integers(len(ordered)))]
    boxed = ordered[int(rng.integers(len(ordered)))]
    return questions_about(scene, asked, boxed)


def questions_about(scene: Scene, asked: Shape, boxed: Shape) -> Dict[str, Question]:
    """The four questions, the colour one naming ``asked``'s kind, the where one ``boxed``."""
    box = ", ".join(str(v) for v in grid_box(boxed, scene.size))
    return {
        "describe": Question("describe", "Describe this picture.", describe(scene)),
        "count": Question("count", "How many shapes are there?", NUMBER_WORDS[len(scene.shapes)] + "."),
        "colour": Question("colour", f"What colour is the {asked.kind}?", asked.colour.capitalize() + ".", asked),
        "where": Question("where", f"Where is the {_named(boxed)}?", f"[{box}]", boxed),
    }


RENDERERS = ("numpy", "pil")
"""``numpy``: :func:`render` (training's); ``pil``: :func:`compass_data.shapes_pil.render`."""


@dataclass(frozen=True)
class Example:
    """A picture: its scene, look, the renderer that draws it, and its questions."""

    index: int
    scene: Scene
    questions: Dict[str, Question] = field(compare=False)
    look: Look = PLAIN
    renderer: str = "numpy"

    def pixels(self) -> np.ndarray:
        if self.renderer == "pil":
            from . import shapes_pil

            return shapes_pil.render(self.scene, self.look)
        if self.renderer != "numpy":
            raise ValueError(f"unknown renderer {self.renderer!r}; expected one of {list(RENDERERS)}")
        return render(self.scene, self.look)

    def sha256(self) -> str:
        return hashlib.sha256(self.pixels().tobytes()).hexdigest()


def examples(
    seed, count: int, *, bucket: Optional[Tuple[int, int]] = None, renderer: str = "numpy", varied: bool = True
) -> List[Example]:
    """``count`` pictures from ``seed`` (an int or a list of ints, as numpy's generators take);
    the same seed always gives the same pictures. ``bucket`` bounds the longer side; with
    ``varied=False`` every picture is a plain 192 x 192 one (hard edges, no noise, no JPEG)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        size = random_size(rng, bucket) if varied else (SIZE, SIZE)
        scene = random_scene(rng, size)
        look = random_look(rng) if varied else PLAIN
        out.append(Example(i, scene, questions(scene, rng), look, renderer))
    return out


def bucket_of(size: Sequence[int]) -> str:
    """The name of the :data:`BUCKETS` entry holding a picture of ``size``'s longer side."""
    longer = max(size)
    for name, (low, high) in BUCKETS.items():
        if low <= longer <= high:
            return name
    raise ValueError(f"a picture of {tuple(size)} is outside every size bucket {BUCKETS}")


TRAIN_SEED = 1
"""The training data's seed (``scripts/toy/train.py`` draws every training picture from it)."""
EVAL_SEED = 2
"""The held-out pictures' seed, never used in training; the tests use :data:`TEST_SEED`."""
TEST_SEED = 3
"""Seed of the pictures the tests ask about (recorded in the reference fixture)."""

DEMO_SCENE = Scene((Shape("square", "blue", 24, 8, 48), Shape("star", "yellow", 88, 96, 80)))
"""The bundled demo picture (``compass_compat/assets/demo.png``, ``scripts/package_data/demo_image.py``):
one the toy answers correctly (``scripts/toy/train.py --find-demo`` picked it)."""


def demo_questions(scene: Scene = DEMO_SCENE) -> Dict[str, Question]:
    """A demo picture's questions: the colour one names the rightmost shape, the where one the
    leftmost (for :data:`DEMO_SCENE`: the star and the square)."""
    ordered = scene.ordered()
    return questions_about(scene, ordered[-1], ordered[0])
