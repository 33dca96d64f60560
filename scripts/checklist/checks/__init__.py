"""The checks, one module per kind, and which item each one decides."""

from __future__ import annotations

from typing import Dict

from .base import Check, result
from .checkpoints import check_layouts, check_quantized
from .detokenizer import check_padding_ids
from .fresh_interpreter import check_model_config, check_processor_without_torch
from .package import check_ships, check_vendored_imports
from .parity import check_image, check_text
from .replay import check_cached_replay
from .surface import check_feature_surface
from .video import check_video

CHECKS: Dict[int, Check] = {
    1: check_ships,
    2: check_text,
    3: check_image,
    4: check_cached_replay,
    5: check_model_config,
    6: check_processor_without_torch,
    7: check_vendored_imports,
    8: check_quantized,
    9: check_layouts,
    10: check_padding_ids,
    11: check_video,
    12: check_feature_surface,
}

__all__ = ["CHECKS", "Check", "result"]
