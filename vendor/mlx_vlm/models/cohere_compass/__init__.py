"""cohere_compass (North-Micro-Vision) for mlx-vlm, vendored by compass-compat."""

from .cohere_compass import LanguageModel, Model, VisionModel
from .config import ModelConfig, TextConfig, VisionConfig

# compass-compat: no ``ImageProcessor`` export: mlx-vlm's loader would rebuild it from config.json
# alone and drop preprocessor_config.json (pixel bounds, mean/std).

__all__ = [
    "LanguageModel",
    "Model",
    "ModelConfig",
    "TextConfig",
    "VisionConfig",
    "VisionModel",
]
