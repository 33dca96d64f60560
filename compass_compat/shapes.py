"""Synthetic shape pictures and their questions: the toy checkpoint's training and test data.

A scene is a 192x192 picture on a plain light background with one to three shapes, each of a
different kind (circle, square, triangle, star) and any of four colours, at positions and
sizes on an 8-pixel lattice, never overlapping. Every scene has one answer per question kind:

========  ================================  =====================================
kind      prompt                            answer
========  ================================  =====================================
describe  ``Describe this picture.``        ``A red circle and a blue square.``
count     ``How many shapes are there?``    ``Two.``
colour    ``What colour is the triangle?``  ``Green.``
where     ``Where is the red circle?``      ``[x1, y1, x2, y2]`` on the 0-1000 grid
========  ================================  =====================================

Shapes are listed left to right (by centre). A box is the drawn shape's pixel extent, each edge
``round(1000 * pixel_edge / size)``, the grid North-Micro-Vision answers in
(:mod:`compass_compat.boxes`). Text-only prompts (:data:`TEXT_ANSWERS`) have fixed answers.

Pixels are rasterized here with numpy (a pixel is inside when its centre is), not with a
drawing library, so the same seed gives the same bytes on every machine and Pillow version.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

SIZE = 192
"""Width and height of every picture, in pixels: a multiple of 32, so the processor keeps it."""
KINDS = ("circle", "square", "triangle", "star")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
BACKGROUND = (245, 245, 240)
LATTICE = 8  # positions and sizes are multiples of this many pixels
SIDES = (48, 64, 80)  # extent of a shape's square cell
QUESTION_KINDS = ("describe", "count", "colour", "where")
NUMBER_WORDS = {1: "One", 2: "Two", 3: "Three"}
TEXT_ANSWERS = {
    "Say hello.": "Hello.",
    "Who are you?": "A toy model trained on pictures of shapes.",
    "What can you do?": "I can describe simple shapes in a picture.",
    "What is two plus two?": "Four.",
}
"""Text-only prompts and the fixed answers the toy was trained to give."""


@dataclass(frozen=True)
class Shape:
    """One shape: its kind, colour name and square cell ``(left, top, side)`` in pixels."""

    kind: str
    colour: str
    left: int
    top: int
    side: int

    @property
    def centre(self) -> Tuple[float, float]:
        return self.left + self.side / 2, self.top + self.side / 2


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

    def ordered(self) -> Tuple[Shape, ...]:
        """The shapes left to right (by centre, then top to bottom)."""
        return tuple(sorted(self.shapes, key=lambda s: (s.centre[0], s.centre[1])))


def random_scene(rng: np.random.Generator) -> Scene:
    """A scene drawn from ``rng``: 1-3 shapes of distinct kinds in non-overlapping cells."""
    count = int(rng.integers(1, 4))
    kinds = rng.permutation(len(KINDS))[:count]
    shapes: List[Shape] = []
    while len(shapes) < count:
        side = int(rng.choice(SIDES))
        slots = (SIZE - side) // LATTICE + 1
        left, top = (int(v) * LATTICE for v in rng.integers(0, slots, size=2))
        candidate = (left, top, side)
        # A gap of at least one lattice step between cells keeps every shape whole and separate.
        if all(not _cells_touch(candidate, (s.left, s.top, s.side)) for s in shapes):
            colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
            shapes.append(Shape(KINDS[kinds[len(shapes)]], colour, left, top, side))
    return Scene(tuple(shapes))


def _cells_touch(a: Tuple[int, int, int], b: Tuple[int, int, int]) -> bool:
    (ax, ay, aside), (bx, by, bside) = a, b
    gap = LATTICE
    return ax < bx + bside + gap and bx < ax + aside + gap and ay < by + bside + gap and by < ay + aside + gap


def shape_mask(shape: Shape, size: int = SIZE) -> np.ndarray:
    """Boolean ``(size, size)`` mask of the pixels whose centre lies inside ``shape``."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    cx, cy = shape.centre
    r = shape.side / 2
    if shape.kind == "circle":
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= (r - 1) ** 2
    if shape.kind == "square":
        inset = shape.side * 0.1
        return (
            (xs >= shape.left + inset)
            & (xs <= shape.left + shape.side - inset)
            & (ys >= shape.top + inset)
            & (ys <= shape.top + shape.side - inset)
        )
    if shape.kind == "triangle":
        verts = [(cx, shape.top + 1), (shape.left + shape.side - 1, shape.top + shape.side - 1)]
        verts.append((shape.left + 1, shape.top + shape.side - 1))
        return _inside_polygon(xs, ys, verts)
    if shape.kind == "star":
        verts = []
        for i in range(10):
            radius = (r - 1) if i % 2 == 0 else (r - 1) * 0.45
            angle = math.pi * i / 5
            verts.append((cx + radius * math.sin(angle), cy - radius * math.cos(angle)))
        return _inside_polygon(xs, ys, verts)
    raise ValueError(f"unknown shape kind {shape.kind!r}; expected one of {list(KINDS)}")


def _inside_polygon(xs: np.ndarray, ys: np.ndarray, verts: Sequence[Tuple[float, float]]) -> np.ndarray:
    # Even-odd rule: count the edges a ray to the right crosses.
    inside = np.zeros(xs.shape, dtype=bool)
    for (x1, y1), (x2, y2) in zip(verts, list(verts[1:]) + [verts[0]]):
        crosses = (y1 > ys) != (y2 > ys)
        with np.errstate(divide="ignore", invalid="ignore"):
            x_at = x1 + (ys - y1) * (x2 - x1) / (y2 - y1)
        inside ^= crosses & (xs < x_at)
    return inside


def render(scene: Scene, size: int = SIZE) -> np.ndarray:
    """The scene as a ``(size, size, 3)`` uint8 RGB array."""
    pixels = np.empty((size, size, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    for shape in scene.shapes:
        pixels[shape_mask(shape, size)] = COLOURS[shape.colour]
    return pixels


def pixel_box(shape: Shape, size: int = SIZE) -> Tuple[int, int, int, int]:
    """The drawn shape's extent in continuous pixel coordinates: ``(left, top, right, bottom)``."""
    mask = shape_mask(shape, size)
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def grid_box(shape: Shape, size: int = SIZE) -> Tuple[int, int, int, int]:
    """:func:`pixel_box` on the model's 0-1000 grid."""
    return tuple(int(round(1000 * v / size)) for v in pixel_box(shape, size))  # type: ignore[return-value]


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
    box = ", ".join(str(v) for v in grid_box(boxed))
    return {
        "describe": Question("describe", "Describe this picture.", describe(scene)),
        "count": Question("count", "How many shapes are there?", NUMBER_WORDS[len(scene.shapes)] + "."),
        "colour": Question("colour", f"What colour is the {asked.kind}?", asked.colour.capitalize() + ".", asked),
        "where": Question("where", f"Where is the {_named(boxed)}?", f"[{box}]", boxed),
    }


@dataclass(frozen=True)
class Example:
    """A picture with its scene and its questions."""

    index: int
    scene: Scene
    questions: Dict[str, Question]

    def pixels(self) -> np.ndarray:
        return render(self.scene)

    def sha256(self) -> str:
        return hashlib.sha256(self.pixels().tobytes()).hexdigest()


def examples(seed: int, count: int) -> List[Example]:
    """``count`` pictures from ``seed``; the same seed always gives the same pictures."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        scene = random_scene(rng)
        out.append(Example(i, scene, questions(scene, rng)))
    return out


TRAIN_SEED = 1
"""The training data's seed (``scripts/train_toy.py`` draws every training picture from it)."""
EVAL_SEED = 2
"""The held-out pictures' seed, never used in training; the tests use :data:`TEST_SEED`."""
TEST_SEED = 3
"""Seed of the 50 pictures the tests ask about (recorded in the reference fixture)."""

DEMO_SCENE = Scene((Shape("square", "blue", 24, 8, 48), Shape("star", "yellow", 88, 96, 80)))
"""The bundled demo picture (``compass_compat/assets/demo.png``, ``scripts/make_demo_image.py``):
one the toy answers correctly (``scripts/train_toy.py --find-demo`` picked it)."""


def demo_questions(scene: Scene = DEMO_SCENE) -> Dict[str, Question]:
    """A demo picture's questions: the colour one names the rightmost shape, the where one the
    leftmost (for :data:`DEMO_SCENE`: the star and the square)."""
    ordered = scene.ordered()
    return questions_about(scene, ordered[-1], ordered[0])
