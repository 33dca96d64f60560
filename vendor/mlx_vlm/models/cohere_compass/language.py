"""Text decoder for cohere_compass (placeholder)."""
import mlx.nn as nn


class LanguageModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
