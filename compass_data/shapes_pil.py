"""A second way to draw :mod:`compass_data.shapes` scenes: Pillow's ``ImageDraw``.

The toy is trained on pictures from :func:`compass_data.shapes.render` (numpy, pixel centres
inside the exact outline). The tests also ask about pictures drawn here, a different path: the
outlines go through Pillow's own ellipse, rectangle and polygon fill rules; anti-aliased
pictures are drawn at four times the size and shrunk with Lanczos resampling (not averaged);
the noise is uniform (not Gaussian); JPEG keeps full colour resolution (4:4:4, not 4:2:0).
The geometry (:data:`~compass_data.shapes.CIRCLE_RADIUS` and the others) is the same, so the
answers, boxes included, are the same for a scene whichever way it is drawn.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

from . import shapes

SUPERSAMPLE = 4


def render(scene: shapes.Scene, look: shapes.Look = shapes.PLAIN) -> np.ndarray:
    """The scene as a ``(height, width, 3)`` uint8 RGB array, drawn with Pillow."""
    scale = SUPERSAMPLE if look.antialias else 1
    image = Image.new("RGB", (scene.width * scale, scene.height * scale), scene.background)
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        _draw(draw, shape, scale)
    if scale > 1:
        image = image.resize(scene.size, Image.LANCZOS)
    pixels = np.asarray(image)
    if look.noise:
        # Uniform noise of the look's standard deviation: half-width sqrt(3) * sd.
        spread = look.noise * 3**0.5
        noisy = pixels + np.random.default_rng(look.noise_seed).uniform(-spread, spread, pixels.shape)
        pixels = np.clip(np.round(noisy), 0, 255).astype(np.uint8)
    if look.jpeg:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=look.jpeg, subsampling=0)
        pixels = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
    return np.ascontiguousarray(pixels)


def _draw(draw: ImageDraw.ImageDraw, shape: shapes.Shape, scale: int) -> None:
    # Pillow also fills the pixels the outline touches: its shapes come out about half a pixel
    # larger on every side than the exact outline, whose centre they keep.
    def point(x: float, y: float):
        return (x * scale, y * scale)

    if shape.kind == "circle":
        left, top, right, bottom = shapes.pixel_box(shape)
        draw.ellipse([point(left, top), point(right, bottom)], fill=shape.rgb)
    else:
        draw.polygon([point(x, y) for x, y in shape.polygon()], fill=shape.rgb)
