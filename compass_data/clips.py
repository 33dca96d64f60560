"""Deterministic synthetic video clips: moving coloured shapes on a gradient background.

The video fixtures (``scripts/reference/video_processor.py``) and their tests draw the same
clips from ``(frames, height, width, seed)`` instead of storing frames. Only integer numpy
arithmetic is used, so every machine and numpy version gives the same bytes
(:func:`clip_sha256` is recorded with each fixture to prove it).
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["clip_sha256", "make_clip"]

_PALETTE = np.array(
    [(220, 40, 40), (40, 170, 60), (40, 80, 220), (235, 200, 30), (150, 60, 190), (20, 190, 200)],
    dtype=np.int64,
)


def _bounce(start: np.ndarray, velocity: np.ndarray, span: np.ndarray, frames: int) -> np.ndarray:
    """Positions [frames, n] moving at ``velocity`` pixels per frame, reflected inside [0, span]."""
    t = np.arange(frames, dtype=np.int64)[:, None]
    period = np.maximum(2 * span, 1)
    p = (start + velocity * t) % period
    return np.where(p > span, period - p, p)


def make_clip(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A clip as a ``(frames, height, width, 3)`` uint8 array.

    A seeded diagonal gradient background with a rectangle, a disc and a diagonal band moving
    at seeded integer speeds (bouncing off the borders), so consecutive frames differ and
    every frame has flat areas, hard edges and gradients.
    """
    if frames < 0 or height < 1 or width < 1:
        raise ValueError(f"a clip needs frames >= 0 and a positive size, got {frames}x{height}x{width}")
    rng = np.random.default_rng([23, seed])
    base = rng.integers(30, 200, size=3)
    slope = rng.integers(20, 56, size=3)
    y = np.arange(height, dtype=np.int64)[:, None]
    x = np.arange(width, dtype=np.int64)[None, :]
    background = base + (slope * (x * 2 + y)[..., None]) // (2 * width + height)  # [H, W, 3], < 256
    clip = np.broadcast_to(background.astype(np.uint8), (frames, height, width, 3)).copy()

    side = max(2, min(height, width) // 4)
    colours = _PALETTE[rng.permutation(len(_PALETTE))[:3]]
    span = np.array([max(width - side, 0), max(height - side, 0)], dtype=np.int64)
    speed = max(1, min(height, width) // 24)
    starts = rng.integers(0, np.maximum(span, 1), size=(3, 2))
    velocities = rng.integers(1, 3 * speed + 1, size=(3, 2)) * rng.choice([-1, 1], size=(3, 2))
    xs = _bounce(starts[:, 0], velocities[:, 0], span[0], frames)  # [T, 3] left edges
    ys = _bounce(starts[:, 1], velocities[:, 1], span[1], frames)  # [T, 3] top edges
    yy, xx = y[None], x[None]  # [1, H, 1], [1, 1, W]

    def at(i: int):
        return xs[:, i, None, None], ys[:, i, None, None]

    left, top = at(0)
    rect = (xx >= left) & (xx < left + side) & (yy >= top) & (yy < top + side * 2 // 3)
    left, top = at(1)
    r = side // 2
    disc = (2 * (xx - left) - 2 * r + 1) ** 2 + (2 * (yy - top) - 2 * r + 1) ** 2 <= 4 * r * r
    left, top = at(2)
    band = (np.abs((xx - left) - (yy - top)) <= max(1, side // 8)) & (xx >= left) & (xx < left + side)
    for mask, colour in zip((rect, disc, band), colours):
        clip[mask] = colour.astype(np.uint8)
    return clip


def clip_sha256(frames: int, height: int, width: int, seed: int = 0) -> str:
    """sha256 of :func:`make_clip`'s bytes (recorded with fixtures; tests check they still match)."""
    return hashlib.sha256(make_clip(frames, height, width, seed).tobytes()).hexdigest()
