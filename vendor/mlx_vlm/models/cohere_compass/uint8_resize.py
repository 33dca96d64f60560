"""torchvision's uint8 bicubic antialiased resize (the reference's video resize), in numpy, bit for bit.

Integer weights and round-shifts as torch's CPU uint8 kernel computes them; the integer sums as
float64 matrix products, exact below 2**53 (docs/processor.md, "The uint8 resize").
"""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Tuple

import numpy as np

# Output pixels per matrix product: the band of inputs they read stays small.
_BLOCK = 16


def _cubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2.0:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


class _AxisWeights(NamedTuple):
    # (out start, out stop, in start, in stop, weights) per band of output pixels.
    bands: Tuple[Tuple[int, int, int, int, np.ndarray], ...]
    precision: int


@functools.lru_cache(maxsize=64)
def _axis_weights(n_in: int, n_out: int) -> _AxisWeights:
    """Integer weights of one axis, as banded blocks of an (n_in, n_out) matrix."""
    scale = n_in / n_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    rows: List[Tuple[int, List[float]]] = []
    w_max = 0.0
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        size = min(int(center + support + 0.5), n_in) - lo
        w = [_cubic((j + lo - center + 0.5) * invscale) for j in range(size)]
        total = 0.0
        for v in w:
            total += v
        if total != 0.0:
            w = [v / total for v in w]
        w_max = max([w_max, *w])
        rows.append((lo, w))
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    unit = 1 << precision
    matrix = np.zeros((n_in, n_out))
    for i, (lo, w) in enumerate(rows):
        matrix[lo : lo + len(w), i] = [
            int(-0.5 + v * unit) if v < 0 else int(0.5 + v * unit) for v in w
        ]
    bands = []
    for a in range(0, n_out, _BLOCK):
        b = min(a + _BLOCK, n_out)
        used = np.nonzero(matrix[:, a:b].any(axis=1))[0]
        lo, hi = (int(used[0]), int(used[-1]) + 1) if len(used) else (0, 1)
        bands.append((a, b, lo, hi, np.ascontiguousarray(matrix[lo:hi, a:b])))
    return _AxisWeights(tuple(bands), precision)


def _round_shift(sums: np.ndarray, precision: int) -> np.ndarray:
    """(sums + 2**(p-1)) >> p, clipped to uint8's range, in place (exact: powers of two)."""
    sums += 1 << (precision - 1)
    sums *= 1.0 / (1 << precision)
    np.floor(sums, out=sums)
    return np.clip(sums, 0, 255, out=sums)


def _resize_last_axis(rows: np.ndarray, n_out: int) -> np.ndarray:
    """float64 (R, n_in) of uint8 values -> (R, n_out) uint8 values (as float64): the horizontal pass."""
    weights = _axis_weights(rows.shape[1], n_out)
    out = np.empty((rows.shape[0], n_out))
    for a, b, lo, hi, block in weights.bands:
        np.matmul(rows[:, lo:hi], block, out=out[:, a:b])
    return _round_shift(out, weights.precision)


def _resize_rows(frames: np.ndarray, n_out: int) -> np.ndarray:
    """float64 (..., n_in, W) -> (..., n_out, W): the vertical pass, one product per band."""
    weights = _axis_weights(frames.shape[-2], n_out)
    out = np.empty(frames.shape[:-2] + (n_out, frames.shape[-1]))
    for a, b, lo, hi, block in weights.bands:
        np.matmul(block.T, frames[..., lo:hi, :], out=out[..., a:b, :])
    return _round_shift(out, weights.precision)


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """(T, C, H, W) uint8 -> (T, C, height, width) uint8, as torchvision's CPU bicubic
    antialiased resize of uint8 tensors computes it (horizontal pass first)."""
    count, channels, in_h, in_w = frames.shape
    if (in_h, in_w) == (height, width):
        return frames
    out = np.empty((count, channels, height, width), dtype=np.uint8)
    # A few frames at a time: float64 copies of whole clips would not fit in memory.
    step = max(1, (1 << 23) // max(1, channels * in_h * in_w))
    for start in range(0, count, step):
        x = frames[start : start + step].astype(np.float64)
        n = x.shape[0]
        if in_w != width:
            x = _resize_last_axis(x.reshape(n * channels * in_h, in_w), width).reshape(
                n, channels, in_h, width
            )
        if in_h != height:
            x = _resize_rows(x, height)
        out[start : start + n] = x
    return out
