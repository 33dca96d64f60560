"""The one lossless packing of recorded pixel values, which the recorders (``scripts/reference/``)
write and the fixture readers (``recorded.py``, ``tests/test_video_processor.py``) undo, and a clip
file's frames as the recordings read them.

numpy only (OpenCV for :func:`read_all_frames`): importable in every environment.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np


def pack_levels(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(codes, levels)``: pixel values [N, 3*T*P*P] float32 whose every value is one of at most
    256 per channel (8-bit samples, rescaled and normalised) as per-entry codes (uint8, same
    shape) into each channel's sorted distinct values (``levels`` [3, 256] float32, padded with
    the last). Lossless: the round trip is checked bit for bit."""
    n = values.shape[0]
    per_channel = values.reshape(n, 3, -1)
    levels = np.zeros((3, 256), dtype=np.float32)
    codes = np.zeros(per_channel.shape, dtype=np.uint8)
    for c in range(3):
        distinct = np.unique(per_channel[:, c])
        assert len(distinct) <= 256, "at most 256 levels per channel"
        levels[c, : len(distinct)] = distinct
        levels[c, len(distinct) :] = distinct[-1]
        codes[:, c] = np.searchsorted(distinct, per_channel[:, c])
    codes = codes.reshape(values.shape)
    assert np.array_equal(unpack_levels(codes, levels).view(np.uint32), values.view(np.uint32))
    return codes, levels


def unpack_levels(codes: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The pixel values :func:`pack_levels` packed."""
    n = codes.shape[0]
    per_channel = codes.reshape(n, 3, -1).astype(np.intp)
    return np.take_along_axis(levels[None], per_channel, axis=-1).reshape(codes.shape)


def pack_pixel_values(pixel_values: np.ndarray) -> Dict[str, np.ndarray]:
    """Lossless compact form of ``pixel_values`` [N, 3*2*P*P] of still images: the first temporal
    slot only (a still image's two are equal), packed by :func:`pack_levels`
    (``pixel_values_codes`` [N, 3*P*P] uint8, ``pixel_values_levels`` [3, 256]); checked here."""
    n = pixel_values.shape[0]
    frames = pixel_values.reshape(n, 3, 2, -1)
    assert np.array_equal(frames[:, :, 0], frames[:, :, 1]), "still image: both temporal slots equal"
    codes, levels = pack_levels(frames[:, :, 0].reshape(n, -1))
    packed = {"pixel_values_codes": codes, "pixel_values_levels": levels}
    assert np.array_equal(unpack_pixel_values(**packed).view(np.uint32), pixel_values.view(np.uint32))
    return packed


def unpack_pixel_values(pixel_values_codes: np.ndarray, pixel_values_levels: np.ndarray) -> np.ndarray:
    """The pixel values :func:`pack_pixel_values` packed: the stored slot, repeated for the second."""
    n = pixel_values_codes.shape[0]
    frame0 = unpack_levels(pixel_values_codes, pixel_values_levels).reshape(n, 3, 1, -1)
    return np.repeat(frame0, 2, axis=2).reshape(n, -1)


def read_all_frames(path) -> np.ndarray:
    """Every frame of a video file, (T, H, W, 3) uint8 RGB, read in order with OpenCV: the frames
    the recorders give the reference (which samples them itself) for a committed clip file."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    cap.release()
    return np.stack(frames)
