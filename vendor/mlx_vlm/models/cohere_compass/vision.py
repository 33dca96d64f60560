"""Vision tower for cohere_compass (placeholder)."""
import mlx.nn as nn


class VisionModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
