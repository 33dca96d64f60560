"""cohere_compass (North-Micro-Vision) for mlx-vlm, vendored by compass-compat."""

from .cohere_compass import (
    LanguageModel,
    Model,
    VisionModel,
    concat_image_features,
    split_image_features,
)
from .config import ModelConfig, TextConfig, VisionConfig
from .processing_cohere_compass import CohereCompassImageProcessor, CohereCompassProcessor

# compass-compat: no ``ImageProcessor`` export on purpose. mlx-vlm's loader would then
# rebuild the image processor from config.json alone and drop preprocessor_config.json
# (min/max pixels, mean/std); the processor built by AutoProcessor keeps them.

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
