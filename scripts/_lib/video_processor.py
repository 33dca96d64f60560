"""What the video processor's recording and its tests share: the settings variants written into a
copy of the tiny checkpoint, and the lossless packing of pixel values in tests/fixtures/video
(scripts/reference/video_processor.py records with them; tests/test_video_processor.py unpacks
and writes the same variants).
"""

from __future__ import annotations

import json
import pathlib
from typing import Dict, Tuple

import numpy as np

# --------------------------------------------------------------------------- settings variants
# Files written into a copy of the tiny checkpoint (the published folder has none of them);
# "tokenizer_config.json" entries update that file's keys.
VIDEO_SETTINGS = {
    "size": {"shortest_edge": 4096, "longest_edge": 262144},
    "image_mean": [0.48, 0.46, 0.41],
    "image_std": [0.27, 0.26, 0.28],
    "max_video_tokens": 8,
    "video_processor_type": "CohereCompassVideoProcessor",
}
VARIANTS: Dict[str, Dict[str, dict]] = {
    "default": {},
    "video_preprocessor_config": {"video_preprocessor_config.json": VIDEO_SETTINGS},
    # processor_config.json's block wins over video_preprocessor_config.json and preprocessor_config.json.
    "processor_config_video_block": {
        "video_preprocessor_config.json": VIDEO_SETTINGS,
        "processor_config.json": {
            "video_processor": {"size": {"shortest_edge": 8192, "longest_edge": 131072}, "fps": 4},
            "processor_class": "CohereCompassProcessor",
        },
    },
    "tokenizer_video_keys": {
        "tokenizer_config.json": {"size": {"shortest_edge": 4096, "longest_edge": 99999}, "fps": 1}
    },
}


def write_variant(folder: pathlib.Path, variant: str) -> None:
    """Write ``variant``'s files into the checkpoint copy ``folder`` (tests do the same)."""
    for name, content in VARIANTS[variant].items():
        path = folder / name
        if name == "tokenizer_config.json":
            content = {**json.loads(path.read_text(encoding="utf-8")), **content}
        path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def pack_pixels(pixel_values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [N, C*T*P*P], levels float32 [3, 256]): per channel, the sorted distinct values
    (padded with the last) and each entry's index into them. Lossless; checked."""
    n, width = pixel_values.shape
    per_channel = pixel_values.reshape(n, 3, -1)
    levels = np.zeros((3, 256), dtype=np.float32)
    codes = np.zeros(per_channel.shape, dtype=np.uint8)
    for c in range(3):
        distinct = np.unique(per_channel[:, c])
        assert len(distinct) <= 256, "at most 256 levels per channel"
        levels[c, : len(distinct)] = distinct
        levels[c, len(distinct) :] = distinct[-1]
        codes[:, c] = np.searchsorted(distinct, per_channel[:, c])
    codes = codes.reshape(n, width)
    assert np.array_equal(unpack_pixels(codes, levels).view(np.uint32), pixel_values.view(np.uint32))
    return codes, levels


def unpack_pixels(codes: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_pixels`."""
    n = codes.shape[0]
    per_channel = codes.reshape(n, 3, -1).astype(np.intp)
    return np.take_along_axis(levels[None], per_channel, axis=-1).reshape(n, -1)
