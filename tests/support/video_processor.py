"""What the video processor's recording and its tests share: the settings variants written into a
copy of the tiny checkpoint (scripts/reference/video_processor.py records with them;
tests/test_video_processor.py writes the same variants). The pixel packing is
tests/support/pixels.py's.
"""

from __future__ import annotations

import json
import pathlib
from typing import Dict

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
