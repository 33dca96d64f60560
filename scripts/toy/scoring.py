"""The toy's box scoring: a box answer hits when its first box overlaps the shape asked about with
IoU >= 0.5 (scripts/toy/accuracy.py, train.py and tests/test_toy.py score the same way)."""

from __future__ import annotations

from typing import Sequence, Tuple

from compass_data import boxes, shapes

HIT_IOU = 0.5


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``(x1, y1, x2, y2)`` boxes in the same coordinates (grid or
    pixels); 0 when they do not overlap or their union is empty."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def box_hit(text: str, subject: shapes.Shape, size: Tuple[int, int]) -> bool:
    """Does the first box in ``text``, scaled to the picture's own width and height, overlap
    ``subject``'s exact extent with IoU >= 0.5?"""
    found = boxes.find_boxes(text)
    return bool(found) and iou(boxes.to_pixels(found[0], tuple(size)), shapes.pixel_box(subject)) >= HIT_IOU
