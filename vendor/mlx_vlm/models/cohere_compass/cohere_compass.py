"""cohere_compass (North-Micro-Vision): vision tower + deepstack + Command-style decoder."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import ModelConfig, grid_sequence
from .language import LanguageModel, get_rope_index
from .processing_cohere_compass import GRID_MEMO
from .vision import VisionModel

# Keys of the dict returned by Model.encode_image (safetensors-friendly).
FEATURES, DEEPSTACK, GRID = "image_features", "deepstack_features", "image_grid_thw"


@dataclass
class CompassEmbeddings:
    """What ``get_input_embeddings`` hands to the decoder.

    Our own type: mlx-vlm 0.3.10-0.4.4's ``InputEmbeddingsFeatures`` has no
    position fields.
    """

    inputs_embeds: mx.array
    position_ids: Optional[mx.array] = None
    rope_deltas: Optional[Any] = None
    deepstack_visual_embeds: Optional[List[mx.array]] = None
    visual_pos_masks: Optional[mx.array] = None
    attention_mask: Optional[mx.array] = None

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def merged_tokens_per_image(grid_thw, merge_size: int) -> List[int]:
    return [t * (h // merge_size) * (w // merge_size) for t, h, w in grid_sequence(grid_thw)]


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model_type = config.model_type
        self.language_model = LanguageModel(
            config.text_config, tie_word_embeddings=config.tie_word_embeddings
        )
        self.vision_tower = VisionModel(config.vision_config)

    @property
    def layers(self):
        return self.language_model.model.layers

    def encode_image(
        self, pixel_values: mx.array, image_grid_thw: Optional[Any] = None
    ) -> Dict[str, mx.array]:
        """Run the vision tower once so a host can cache and replay the result.

        Args:
            pixel_values: ``[num_patches, C*T*P*P]`` as the processor returns them.
            image_grid_thw: ``[num_images, 3]`` patch grids of those images.

        Returns:
            ``{"image_features": [N, D], "deepstack_features": [K, N, D],
            "image_grid_thw": [num_images, 3]}`` with N the merged image tokens
            of all images in order. Pass it back as
            ``get_input_embeddings(..., cached_image_features=...)``; rows split
            per image with :func:`split_image_features` and join with
            :func:`concat_image_features`.
        """
        if image_grid_thw is None:
            # mlx-vlm 0.4.x-0.6.x call encode_image(pixel_values) with no grid.
            image_grid_thw = GRID_MEMO.recall(pixel_values)
        if image_grid_thw is None:
            raise ValueError(
                "cohere_compass.encode_image needs image_grid_thw (the processor returns it "
                "next to pixel_values): the patch grid cannot be recovered from pixels alone"
            )
        grid = mx.array(np.asarray(image_grid_thw, dtype=np.int32).reshape(-1, 3))
        dtype = self.vision_tower.patch_embed.proj.weight.dtype
        features, deepstack = self.vision_tower(pixel_values.astype(dtype), grid)
        stacked = mx.stack(deepstack) if deepstack else mx.zeros((0,) + features.shape, features.dtype)
        return {FEATURES: features, DEEPSTACK: stacked, GRID: grid}

    def encode_images(self, pixel_values: mx.array, image_grid_thw: Optional[Any] = None, **kwargs) -> Dict[str, mx.array]:
        """mlx-vlm 0.7.x's name for :meth:`encode_image` (grid passed as a keyword)."""
        return self.encode_image(pixel_values, image_grid_thw)

    @staticmethod
    def _check_features(cached: Dict[str, mx.array]) -> None:
        if not isinstance(cached, dict) or FEATURES not in cached or DEEPSTACK not in cached:
            raise ValueError(
                "cached_image_features must be the dict returned by Model.encode_image "
                f"(keys {FEATURES!r}, {DEEPSTACK!r}, {GRID!r})"
            )

    def get_input_embeddings(
        self,
        input_ids: Optional[mx.array] = None,
        pixel_values: Optional[mx.array] = None,
        cached_image_features: Optional[Dict[str, mx.array]] = None,
        image_grid_thw: Optional[Any] = None,
        mask: Optional[mx.array] = None,
        mm_token_type_ids: Optional[Any] = None,
        **kwargs,
    ) -> CompassEmbeddings:
        """Token embeddings with image features scattered in, plus MRoPE positions.

        Images come from ``pixel_values`` + ``image_grid_thw`` or, without running
        the tower, from ``cached_image_features`` (``encode_image``'s output).
        """
        embeds = self.language_model.model.embed_tokens(input_ids)
        if pixel_values is None and cached_image_features is None:
            return CompassEmbeddings(inputs_embeds=embeds, attention_mask=mask)

        if cached_image_features is not None:
            self._check_features(cached_image_features)
            encoded = cached_image_features
            if image_grid_thw is None:
                image_grid_thw = encoded.get(GRID)
        else:
            if image_grid_thw is None:
                raise ValueError("image_grid_thw must be provided with pixel_values")
            encoded = self.encode_image(pixel_values, image_grid_thw)
        features, deepstack = encoded[FEATURES], encoded[DEEPSTACK]

        ids = np.array(input_ids)
        if mm_token_type_ids is not None:
            is_image = np.array(mm_token_type_ids) == 1
        else:
            is_image = ids == self.config.image_token_id
        flat = np.nonzero(is_image.reshape(-1))[0]
        if len(flat) != features.shape[0]:
            raise ValueError(
                f"Image features and image tokens do not match: the prompt has {len(flat)} "
                f"image tokens but the image features cover {features.shape[0]} tokens. "
                "Each image needs exactly one image placeholder, expanded by the processor, "
                "and replayed features must come from the same images."
            )
        if GRID in encoded and image_grid_thw is not None:
            encoded_grid = np.asarray(encoded[GRID]).reshape(-1, 3).tolist()
            prompt_grid = np.asarray(image_grid_thw).reshape(-1, 3).tolist()
            if encoded_grid != prompt_grid:
                raise ValueError(
                    f"cached_image_features were encoded for image grids {encoded_grid} but the "
                    f"prompt's images have grids {prompt_grid}; re-encode the images"
                )
        B, L, D = embeds.shape
        where = mx.array(flat.astype(np.uint32))
        merged = embeds.reshape(B * L, D)
        merged[where] = features.astype(embeds.dtype)
        dense = []
        for k in range(deepstack.shape[0]):
            layer = mx.zeros((B * L, D), dtype=embeds.dtype)
            layer[where] = deepstack[k].astype(embeds.dtype)
            dense.append(layer.reshape(B, L, D))

        position_ids, deltas = get_rope_index(
            ids,
            image_grid_thw,
            self.config.image_token_id,
            self._merge,
            attention_mask=np.array(mask) if mask is not None and getattr(mask, "ndim", 0) == 2 else None,
            mm_token_type_ids=is_image.astype(np.int32),
        )
        rope_deltas = int(deltas[0]) if np.all(deltas == deltas[0]) else mx.array(deltas)
        return CompassEmbeddings(
            inputs_embeds=merged.reshape(B, L, D),
            position_ids=mx.array(position_ids),
            rope_deltas=rope_deltas,
            deepstack_visual_embeds=dense,
            visual_pos_masks=mx.array(is_image),
            attention_mask=mask,
        )

    @property
    def _merge(self) -> int:
        return self.config.vision_config.spatial_merge_size

    def __call__(
        self,
        input_ids: mx.array,
        pixel_values: Optional[mx.array] = None,
        mask: Optional[mx.array] = None,
        cache=None,
        **kwargs,
    ):
        emb = self.get_input_embeddings(input_ids, pixel_values, mask=mask, **kwargs)
        for key in ("position_ids", "rope_deltas", "deepstack_visual_embeds", "visual_pos_masks"):
            kwargs.pop(key, None)
        kwargs.pop("inputs_embeds", None)
        return self.language_model(
            input_ids,
            inputs_embeds=emb.inputs_embeds,
            mask=mask,
            cache=cache,
            position_ids=emb.position_ids,
            rope_deltas=emb.rope_deltas,
            deepstack_visual_embeds=emb.deepstack_visual_embeds,
            **kwargs,
        )

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Map both published layouts onto this module tree (idempotent).

        CohereLabs: ``model.language_model.*``, ``model.visual.*``, ``lm_head.*``;
        MLX conversions: ``language_model.model.*``, ``vision_tower.*``.
        """
        out = {}
        for key, value in weights.items():
            if key.endswith("position_ids"):
                continue
            if key.startswith("model.language_model."):
                key = key.replace("model.language_model.", "language_model.model.", 1)
            elif key.startswith("model.visual."):
                key = key.replace("model.visual.", "vision_tower.", 1)
            elif key.startswith("lm_head."):
                key = key.replace("lm_head.", "language_model.lm_head.", 1)
            if self.config.tie_word_embeddings and key.startswith("language_model.lm_head."):
                continue
            out[key] = value
        return self.vision_tower.sanitize(out)


def split_image_features(encoded: Dict[str, mx.array], merge_size: int = 2) -> List[Dict[str, mx.array]]:
    """Split ``encode_image`` output into one dict per image (prompt order)."""
    sizes = merged_tokens_per_image(encoded[GRID], merge_size)
    out, start = [], 0
    grid = encoded[GRID]
    for i, n in enumerate(sizes):
        out.append(
            {
                FEATURES: encoded[FEATURES][start : start + n],
                DEEPSTACK: encoded[DEEPSTACK][:, start : start + n],
                GRID: grid[i : i + 1],
            }
        )
        start += n
    return out


def concat_image_features(parts: List[Dict[str, mx.array]]) -> Dict[str, mx.array]:
    """Join per-image ``encode_image`` outputs, in prompt order, into one."""
    return {
        FEATURES: mx.concatenate([p[FEATURES] for p in parts], axis=0),
        DEEPSTACK: mx.concatenate([p[DEEPSTACK] for p in parts], axis=1),
        GRID: mx.concatenate([p[GRID] for p in parts], axis=0),
    }
