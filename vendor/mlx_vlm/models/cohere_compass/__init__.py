"""cohere_compass (North-Micro-Vision) for mlx-vlm, vendored by compass-compat."""

from .cohere_compass import (
    LanguageModel,
    Model,
    VisionModel,
    concat_image_features,
    split_image_features,
)
from .config import ModelConfig, TextConfig, VisionConfig
from .processing_cohere_compass import (
    CohereCompassImageProcessor,
    CohereCompassProcessor,
)

# compass-compat: no ``ImageProcessor`` export: mlx-vlm's loader would rebuild it from config.json
# alone and drop preprocessor_config.json (pixel bounds, mean/std).

__all__ = [
    "CohereCompassImageProcessor",
    "CohereCompassProcessor",
    "LanguageModel",
    "Model",
    "ModelConfig",
    "TextConfig",
    "VisionConfig",
    "VisionModel",
    "concat_image_features",
    "split_image_features",
]
