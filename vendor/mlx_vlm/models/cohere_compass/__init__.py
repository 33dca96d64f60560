"""cohere_compass (North-Micro-Vision) for mlx-vlm, vendored by compass-compat."""

from . import processing_cohere_compass  # noqa: F401  (defines the torch-free processor)
from .cohere_compass import LanguageModel, Model, VisionModel
from .config import ModelConfig, TextConfig, VisionConfig

__all__ = [
    "LanguageModel",
    "Model",
    "ModelConfig",
    "TextConfig",
    "VisionConfig",
    "VisionModel",
]
