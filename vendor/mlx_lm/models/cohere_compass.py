"""cohere_compass for mlx-lm: the text decoder of the vendored mlx-vlm package, no vision.

compass-compat appends this directory to ``mlx_lm.models.__path__`` only when asked
(``COMPASS_COMPAT_MLX_LM=1`` or ``apply_patch(mlx_lm=True)``), so ``mlx_lm.load`` /
``generate`` / ``server`` can run text prompts on a cohere_compass checkpoint. Image
prompts need mlx-vlm: this model rotates every token from the cache offset alone (a
text prompt's MRoPE positions), which is wrong after an image prefill, whose tokens
continue from ``offset + rope_delta``.

The decoder classes are the vendored ones (one copy of the decoder), imported from the
live ``mlx_vlm.models.cohere_compass``; the module tree keeps mlx-vlm's names
(``language_model.model.*``), so both weight layouts and mlx-vlm's quantized
conversions load, and the vision tower's weights are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_vlm.models.cohere_compass import cohere_compass as _model
from mlx_vlm.models.cohere_compass import config as _config
from mlx_vlm.models.cohere_compass import language as _language

# The decoder must be the vendored one next to this file, never an upstream mlx-vlm's
# package of the same name (mlx-vlm >= 0.6.13 ships one with other classes).
_VENDOR = Path(__file__).resolve().parents[2]
if Path(_language.__file__).resolve().parents[3] != _VENDOR:
    raise ImportError(
        f"mlx_lm.models.cohere_compass needs compass-compat's vendored decoder from {_VENDOR}, "
        f"but mlx_vlm.models.cohere_compass is {_language.__file__}; "
        "set COMPASS_COMPAT_FORCE_VENDORED=1"
    )

# mlx-lm's loader calls ModelArgs.from_dict(config.json): the full config, as mlx-vlm reads it.
ModelArgs = _config.ModelConfig


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        # Head built as the config says; sanitize settles it against the stored weights.
        self.language_model = _language.LanguageModel(
            args.text_config, tie_word_embeddings=args.tie_word_embeddings
        )

    def __call__(
        self,
        inputs: mx.array,
        cache: Optional[List[Any]] = None,
        input_embeddings: Optional[mx.array] = None,
    ):
        return self.language_model(
            inputs, inputs_embeds=input_embeddings, cache=cache
        ).logits

    @property
    def layers(self):
        return self.language_model.model.layers

    def make_cache(self) -> List[Any]:
        # mlx-lm's own cache classes: its prompt cache, trimming and batching know them.
        window = self.args.text_config.sliding_window
        return [
            RotatingKVCache(max_size=window, keep=0)
            if layer.layer_type == "sliding_attention"
            else KVCache()
            for layer in self.layers
        ]

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Both layouts onto ``language_model.*`` as the vendored mlx-vlm model maps them
        (``settle_head``, ``weight_key``), the vision tower dropped (idempotent)."""
        tied = _model.settle_head(self.language_model, self.args, weights)
        out = {}
        for key, value in weights.items():
            key = _model.weight_key(key, tied)
            if key is not None and not key.startswith("vision_tower."):
                out[key] = value
        return out
