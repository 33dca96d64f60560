"""cohere_compass (North-Micro-Vision): vision tower + deepstack + Command-style decoder."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, fields
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import ModelConfig, grid_sequence, weight_key
from .image_processing_cohere_compass import GRID_MEMO
from .language import LanguageModel
from .positions import (
    IMAGE,
    VIDEO,
    Issued,
    get_rope_index,
    leading_padding,
    padding_rows,
    publish_prompt,
    text_zeros,
    token_types,
)
from .vision import VisionModel

logger = logging.getLogger(__name__)

# Per modality (mm_token_type_ids value): its name and the get_input_embeddings arguments.
_NAMES = {IMAGE: "image", VIDEO: "video"}
_PIXELS = {IMAGE: "pixel_values", VIDEO: "pixel_values_videos"}
_GRIDS = {IMAGE: "image_grid_thw", VIDEO: "video_grid_thw"}
_CACHED = {IMAGE: "cached_image_features", VIDEO: "cached_video_features"}


@dataclass
class CompassEmbeddings:
    """What ``get_input_embeddings`` hands to the decoder (mlx-vlm 0.4.4's
    ``InputEmbeddingsFeatures`` has no position fields)."""

    inputs_embeds: mx.array
    position_ids: Optional[mx.array] = None
    rope_deltas: Optional[Any] = None
    deepstack_visual_embeds: Optional[mx.array] = None  # [B, L, K, D]
    visual_pos_masks: Optional[mx.array] = None
    attention_mask: Optional[mx.array] = None
    # Per row ([B]), kept whole while batch hosts cut sequence keys per prefill chunk: whether
    # ``position_ids`` carries the row (hosts join a key over the rows that have it), and the
    # left padding of the processor's padded prompt (``attention_mask`` zeros before the first token).
    position_rows: Optional[mx.array] = None
    prompt_padding: Optional[mx.array] = None

    @classmethod
    def of(
        cls, inputs_embeds: mx.array, mask: Optional[Any], **given: Any
    ) -> "CompassEmbeddings":
        """The per-row fields filled in from the others."""
        B = inputs_embeds.shape[0]
        padding = padding_rows(mask)
        lead = np.zeros(B, np.int32) if padding is None else leading_padding(padding)
        has_positions = given.get("position_ids") is not None
        return cls(
            inputs_embeds=inputs_embeds,
            attention_mask=mask,
            position_rows=mx.full((B,), has_positions, dtype=mx.bool_),
            prompt_padding=mx.array(lead.astype(np.int32)),
            **given,
        )

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def merged_tokens_per_image(grid_thw, merge_size: int) -> List[int]:
    return [
        t * (h // merge_size) * (w // merge_size) for t, h, w in grid_sequence(grid_thw)
    ]


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model_type = config.model_type
        self.language_model = LanguageModel(
            config.text_config,
            tie_word_embeddings=config.tie_word_embeddings,
            image_token_id=config.image_token_id,
            spatial_merge_size=config.vision_config.spatial_merge_size,
            video_token_id=config.video_token_id,
        )
        self.vision_tower = VisionModel(config.vision_config)

    @property
    def layers(self):
        return self.language_model.model.layers

    def encode_image(
        self, pixel_values: mx.array, image_grid_thw: Optional[Any] = None
    ) -> mx.array:
        """The vision tower's output for a host to cache and replay as
        ``cached_image_features``: ``[N, (1 + K) * D]``, a row per merged image token in prompt
        order, the merger's features then the K deepstack ones."""
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
        encoded = (
            mx.concatenate([features, *deepstack], axis=-1) if deepstack else features
        )
        FEATURE_SOURCES.mark(encoded, _pixel_fingerprint(pixel_values, image_grid_thw))
        return encoded

    def encode_video(
        self, pixel_values_videos: mx.array, video_grid_thw: Optional[Any] = None
    ) -> mx.array:
        """:meth:`encode_image` for videos, replayed as ``cached_video_features``."""
        return self.encode_image(pixel_values_videos, video_grid_thw)

    def encode_images(
        self, pixel_values: mx.array, image_grid_thw: Optional[Any] = None, **kwargs
    ) -> mx.array:
        """mlx-vlm 0.7.x's name for :meth:`encode_image` (grid passed as a keyword)."""
        return self.encode_image(pixel_values, image_grid_thw)

    def _unpack_features(self, cached: mx.array) -> Tuple[mx.array, List[mx.array]]:
        """(features [N, D], K deepstack [N, D]) from ``encode_image``'s array."""
        D = self.config.text_config.hidden_size
        K = len(self.config.vision_config.deepstack_visual_indexes)
        if not isinstance(cached, mx.array):
            join = " (join per-image arrays: mx.concatenate(parts, axis=0))"
            raise ValueError(
                "cached_image_features must be the mx.array returned by Model.encode_image, "
                f"got {type(cached).__name__}{join if isinstance(cached, (list, tuple)) else ''}"
            )
        if cached.ndim != 2 or cached.shape[-1] != (1 + K) * D:
            raise ValueError(
                f"cached_image_features has shape {list(cached.shape)}; this model's encode_image gives "
                f"[image tokens, {(1 + K) * D}] (features and {K} deepstack features of width {D}). "
                "Re-encode the images with this model's encode_image"
            )
        parts = mx.split(cached, 1 + K, axis=-1) if K else [cached]
        return parts[0], list(parts[1:])

    def get_input_embeddings(
        self,
        input_ids: Optional[mx.array] = None,
        pixel_values: Optional[mx.array] = None,
        cached_image_features: Optional[mx.array] = None,
        image_grid_thw: Optional[Any] = None,
        mask: Optional[mx.array] = None,
        mm_token_type_ids: Optional[Any] = None,
        pixel_values_videos: Optional[mx.array] = None,
        video_grid_thw: Optional[Any] = None,
        cached_video_features: Optional[mx.array] = None,
        **kwargs,
    ) -> CompassEmbeddings:
        """Token embeddings with image and video features scattered in, and MRoPE positions.

        Deepstack comes back dense, ``[B, L, K, D]`` with zeros off the vision tokens, so hosts
        slice and left-pad it like the embeddings."""
        self._warn_past_positions(input_ids)
        pixel_values, pixel_values_videos, mm_token_type_ids, mask, whole = (
            fit_training_batch(
                input_ids,
                pixel_values,
                pixel_values_videos,
                mm_token_type_ids,
                mask,
                [self.config.image_token_id, self.config.video_token_id],
            )
        )
        if pixel_values is not None:
            cached_image_features = self._image_features_for(
                pixel_values,
                image_grid_thw,
                cached_image_features,
                kwargs.get("vision_cache"),
                kwargs.get("_image_key"),
            )
        embeds = self.language_model.model.embed_tokens(input_ids)
        given = {
            IMAGE: (pixel_values, cached_image_features, image_grid_thw),
            VIDEO: (pixel_values_videos, cached_video_features, video_grid_thw),
        }
        given = {
            kind: parts
            for kind, parts in given.items()
            if parts[0] is not None or parts[1] is not None
        }
        if not given:
            return self._text_embeddings(
                input_ids, embeds, mask, kwargs.get("rope_deltas")
            )

        types = token_types(
            input_ids,
            mm_token_type_ids,
            self.config.image_token_id,
            self.config.video_token_id,
        )
        B, L, D = embeds.shape
        merged = embeds.reshape(B * L, D)
        K = len(self.config.vision_config.deepstack_visual_indexes)
        dense = mx.zeros((B * L, K, D), dtype=embeds.dtype) if K else None
        visual = {
            kind: self._visual_features(kind, *parts) for kind, parts in given.items()
        }
        grids: Dict[int, Any] = {kind: parts[2] for kind, parts in visual.items()}
        if whole is not None:
            given_grids = {IMAGE: image_grid_thw, VIDEO: video_grid_thw, **grids}
            whole = self._placeable(whole, visual, given_grids, self._merge)
        for kind in (IMAGE, VIDEO):
            flat = np.nonzero(types.reshape(-1) == kind)[0]
            if kind not in given:
                if len(flat):
                    raise ValueError(
                        f"The prompt has {len(flat)} {_NAMES[kind]} tokens but no {_NAMES[kind]} input: pass "
                        f"{_PIXELS[kind]} + {_GRIDS[kind]} (or {_CACHED[kind]}) for them"
                    )
                continue
            features, deepstack, _ = visual[kind]
            if whole is not None:
                # Features come for every picture of the prompt; the cached part's are not fed.
                rows = mx.array(whole.suffix_rows(kind).astype(np.uint32))
                features, deepstack = features[rows], [d[rows] for d in deepstack]
            if len(flat) != features.shape[0]:
                raise ValueError(
                    f"{_NAMES[kind].capitalize()} features and {_NAMES[kind]} tokens do not match: the prompt has "
                    f"{len(flat)} {_NAMES[kind]} tokens but the {_NAMES[kind]} features cover {features.shape[0]} "
                    f"tokens. Each {_NAMES[kind]} needs exactly one {_NAMES[kind]} placeholder, expanded by the "
                    f"processor, and replayed features must come from the same {_NAMES[kind]}s."
                )
            where = mx.array(flat.astype(np.uint32))
            merged[where] = features.astype(embeds.dtype)
            if deepstack:
                dense[where] = mx.stack(deepstack, axis=1).astype(embeds.dtype)

        # A whole prompt's positions follow from its types and grids alone (text advances by one).
        prefix, rope_types, rope_grids, rope_mask = (
            (whole.prefix, whole.types, whole.grids, whole.mask)
            if whole is not None
            else (0, types, grids, mask)
        )
        position_ids, deltas = get_rope_index(
            rope_types,
            rope_grids.get(IMAGE),
            self.config.image_token_id,
            self._merge,
            attention_mask=padding_rows(rope_mask),
            mm_token_type_ids=rope_types,
            video_grid_thw=rope_grids.get(VIDEO),
            video_token_id=self.config.video_token_id,
        )
        position_ids = position_ids[..., prefix:]
        if dense is not None:
            dense = dense.reshape(B, L, K, D)
        return self._with_positions(
            merged.reshape(B, L, D),
            mx.array(position_ids),
            deltas,
            dense,
            mx.array(types != 0),
            mask,
            prefix,
        )

    def _warn_past_positions(self, input_ids) -> None:
        """A prompt longer than the checkpoint's positions still runs, as the reference's does."""
        limit = self.config.text_config.max_position_embeddings
        if input_ids is not None and input_ids.shape[-1] > limit:
            logger.warning(
                f"cohere_compass: the prompt is {input_ids.shape[-1]:,} tokens, longer than this "
                f"checkpoint's max_position_embeddings ({limit:,}); the answer cannot be trusted"
            )

    @staticmethod
    def _placeable(
        whole: "WholePrompt",
        visual: Dict[int, Tuple],
        grids: Dict[int, Any],
        merge: int,
    ) -> Optional["WholePrompt"]:
        """``whole`` with its grids when they and the features cover every picture and video
        of the whole prompt, else None (the suffix is then embedded as a prompt of its own)."""
        for kind in (IMAGE, VIDEO):
            count = int(np.count_nonzero(whole.types == kind))
            if count == 0:
                continue
            if (
                grids.get(kind) is None
                or sum(merged_tokens_per_image(grids[kind], merge)) != count
            ):
                return None
            if kind in visual and visual[kind][0].shape[0] != count:
                return None
        return WholePrompt(whole.types, whole.mask, whole.prefix, grids)

    def _image_features_for(
        self, pixels, grid, cached, vision_cache, key
    ) -> Optional[mx.array]:
        """Features to replay for these pixels, or None to run the tower; mlx-vlm's
        ``vision_cache`` stores a miss. Features encoded from other pixels are never replayed."""
        if cached is not None and _encoded_from(cached, pixels, grid) is False:
            cached = None
        if cached is not None or vision_cache is None or key is None or grid is None:
            return cached
        hit = vision_cache.get(key)
        if isinstance(hit, mx.array) and _encoded_from(hit, pixels, grid):
            return hit
        features = self.encode_image(pixels, grid)
        mx.eval(features)
        vision_cache.put(key, features)
        return features

    def _visual_features(
        self,
        kind: int,
        pixels: Optional[mx.array],
        cached: Optional[mx.array],
        grid: Optional[Any],
    ) -> Tuple[mx.array, List[mx.array], Any]:
        """(features [N, D], K deepstack [N, D], grid) of one modality, from pixels or a replay."""
        if grid is None:
            given = _PIXELS[kind] if cached is None else _CACHED[kind]
            raise ValueError(
                f"{_GRIDS[kind]} must be provided with {given} (the processor returns it for the "
                f"prompt's {_NAMES[kind]}s): their positions depend on each {_NAMES[kind]}'s grid"
            )
        if cached is None:
            cached = self.encode_image(pixels, grid)
        features, deepstack = self._unpack_features(cached)
        return features, deepstack, grid

    def _with_positions(
        self, embeds, position_ids, deltas, deepstack, visual, mask, prefix=0
    ) -> CompassEmbeddings:
        """``prefix``: the cached tokens these positions follow (a prompt's suffix), else 0."""
        rope_deltas = publish_prompt(self.language_model, position_ids, deltas, prefix)
        return CompassEmbeddings.of(
            embeds,
            mask,
            position_ids=position_ids,
            rope_deltas=rope_deltas,
            deepstack_visual_embeds=deepstack,
            visual_pos_masks=visual,
        )

    def _text_embeddings(
        self, input_ids, embeds, mask, given_deltas=None
    ) -> CompassEmbeddings:
        """A text prompt: no positions (they follow the cache), a delta per row (a caller's as
        given: mlx-vlm 0.6.x primes a trimmed prompt's suffix with it, then takes this output's).
        Every field is per row: batching hosts join each key over the rows that carry it."""
        B, L, D = embeds.shape
        K = len(self.config.vision_config.deepstack_visual_indexes)
        deepstack = (
            mx.broadcast_to(mx.zeros((1, 1, K, D), embeds.dtype), (B, L, K, D))
            if K
            else None
        )
        visual = mx.zeros((B, L), dtype=mx.bool_)
        padding = padding_rows(mask)
        if padding is not None and not padding.all():
            # Left-padded rows of one fresh prompt batch: positions that skip the padding.
            position_ids, deltas = get_rope_index(
                np.array(input_ids), None, -1, self._merge, attention_mask=padding
            )
            return self._with_positions(
                embeds, mx.array(position_ids), deltas, deepstack, visual, mask
            )
        rope_deltas = given_deltas
        if rope_deltas is None:
            rope_deltas = text_zeros(self.language_model, B)
        return CompassEmbeddings.of(
            embeds,
            mask,
            rope_deltas=rope_deltas,
            deepstack_visual_embeds=deepstack,
            visual_pos_masks=visual,
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
        try:
            emb = self.get_input_embeddings(
                input_ids, pixel_values, mask=mask, **kwargs
            )
        except ValueError as error:
            if "function transformations" not in str(error):
                raise
            raise ValueError(
                "cohere_compass cannot run under mx.compile (or another function transformation): it "
                "places image features and MRoPE positions from the token ids on the host. Train without "
                "--compile (python -m mlx_vlm.train), and without ORPO on mlx-vlm 0.6.x, whose step is compiled"
            ) from error
        # A caller's positions and delta win (a prompt's later chunk, a host's own bookkeeping);
        # else an image prompt's own; a text chunk has none and follows the cache it continues.
        position_ids = kwargs.pop("position_ids", None)
        rope_deltas = kwargs.pop("rope_deltas", None)
        if position_ids is None and emb.position_ids is not None:
            position_ids = emb.position_ids
            rope_deltas = emb.rope_deltas if rope_deltas is None else rope_deltas
        for key in ("deepstack_visual_embeds", "visual_pos_masks", "inputs_embeds"):
            kwargs.pop(key, None)
        return self.language_model(
            input_ids,
            inputs_embeds=emb.inputs_embeds,
            mask=mask,
            cache=cache,
            position_ids=position_ids,
            rope_deltas=rope_deltas,
            deepstack_visual_embeds=emb.deepstack_visual_embeds,
            **kwargs,
        )

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Map both published layouts onto this module tree (idempotent), the head tied or not
        as :func:`settle_head` decides from what is stored."""
        tied = settle_head(self.language_model, self.config, weights)
        out = {}
        for key, value in weights.items():
            key = weight_key(key, tied)
            if key is not None:
                out[key] = value
        return self.vision_tower.sanitize(out)


_HEAD, _EMBED = "language_model.lm_head.", "language_model.model.embed_tokens."


def settle_head(
    language_model: nn.Module, config: ModelConfig, weights: Dict[str, Any]
) -> bool:
    """Tie or untie ``language_model``'s head as ``config.head_tied`` decides for ``weights``;
    runs before mlx-vlm quantizes and loads, so an added head is quantized like a stored one."""
    names = {weight_key(k, False): k for k in weights}
    head = {n[len(_HEAD) :]: k for n, k in names.items() if n and n.startswith(_HEAD)}
    embed = {part: names.get(_EMBED + part) for part in head}
    # Compared only where it decides (a stored head with the top-level key true), part by part.
    same = bool(head and config.declared_tie_word_embeddings) and all(
        embed[part] is not None
        and weights[key].shape == weights[embed[part]].shape
        and weights[key].dtype == weights[embed[part]].dtype
        and mx.array_equal(weights[key], weights[embed[part]]).item()
        for part, key in head.items()
    )
    tied = config.head_tied(bool(head), same)
    if tied is None or tied == language_model.tie_word_embeddings:
        return language_model.tie_word_embeddings
    if tied:
        language_model.pop("lm_head", None)
    else:
        text = config.text_config
        language_model.lm_head = nn.Linear(
            text.hidden_size, text.vocab_size, bias=False
        )
    language_model.tie_word_embeddings = config.tie_word_embeddings = tied
    return tied


class WholePrompt(NamedTuple):
    """The whole prompt's ``mm_token_type_ids`` (and 2-D mask) passed with ids that are its
    last tokens, the first ``prefix`` cached; ``grids`` once :meth:`Model._placeable` checks them."""

    types: np.ndarray
    mask: Optional[np.ndarray]
    prefix: int
    grids: Optional[Dict[int, Any]] = None

    def suffix_rows(self, kind: int) -> np.ndarray:
        """Which rows of the whole prompt's ``kind`` features (prompt order) the ids hold."""
        media = self.types == kind
        order = (np.cumsum(media.reshape(-1)) - 1).reshape(media.shape)
        return order[:, self.prefix :][media[:, self.prefix :]]


def fit_training_batch(
    input_ids, pixel_values, pixel_values_videos, mm_token_type_ids, mask, media_ids
):
    """Fit ``mm_token_type_ids`` and patches to the ids mlx-vlm's trainers pass (last id dropped,
    right padding or a GRPO completion appended, patches stacked ``[B, N, C]``); longer types
    marking exactly the ids' media tokens are a whole prompt's (a restored prefix's suffix),
    returned as a :class:`WholePrompt`. Any other shape is refused."""
    # compass-compat: upstream (0.7.10) ignores mm_token_type_ids and the patch count; we check both.
    if pixel_values is not None and pixel_values.ndim == 3:
        pixel_values = pixel_values.reshape(-1, pixel_values.shape[-1])
    if pixel_values_videos is not None and pixel_values_videos.ndim == 3:
        pixel_values_videos = pixel_values_videos.reshape(
            -1, pixel_values_videos.shape[-1]
        )
    B, L = input_ids.shape
    if mask is not None and getattr(mask, "ndim", 0) == 2 and mask.shape[1] == L + 1:
        mask = mask[:, :L]
    if mm_token_type_ids is None:
        return pixel_values, pixel_values_videos, None, mask, None
    types = np.asarray(mm_token_type_ids)
    types = types.reshape(1, -1) if types.ndim == 1 else types
    if types.ndim != 2 or types.shape[0] != B:
        raise ValueError(
            f"mm_token_type_ids has shape {list(types.shape)} for input_ids of shape {[B, L]}: it needs one "
            "row per prompt (mlx-vlm 0.6.x's trainer keeps only the first row when the prompts of a batch "
            "differ in length: train with --batch-size 1 there)"
        )
    T = types.shape[1]
    whole = None
    if T == L + 1 and not types[:, L].any():
        types = types[:, :L]
    elif T < L and not np.isin(np.asarray(input_ids)[:, T:], media_ids).any():
        types = np.pad(types, ((0, 0), (0, L - T)))
    elif T > L and np.array_equal(
        types[:, T - L :] != 0, np.isin(np.asarray(input_ids), media_ids)
    ):
        # mlx-vlm's prompt-cache reuse (PromptCacheState, APC; 0.4.4-0.7.10) trims the ids to the
        # suffix after the restored prefix and passes the whole prompt's types and mask.
        whole_mask = None
        if getattr(mask, "ndim", 0) == 2 and mask.shape[1] == T:
            whole_mask, mask = np.asarray(mask), mask[:, T - L :]
        whole = WholePrompt(types, whole_mask, T - L)
        types = types[:, T - L :]
    elif T != L:
        raise ValueError(
            f"mm_token_type_ids has {T} columns but input_ids has {L}. Pass the processor's outputs of one "
            "prompt together; a training batch may only drop the last token (never an image or video "
            "token) or add text after the prompt (padding, a sampled completion)"
        )
    return pixel_values, pixel_values_videos, types, mask, whole


def _pixel_fingerprint(pixels: Any, grid: Any) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(np.asarray(grid, dtype=np.int64)).tobytes())
    array = np.asarray(pixels)
    digest.update(str((array.dtype, array.shape)).encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _encoded_from(features: Any, pixels: Any, grid: Any) -> Optional[bool]:
    """Whether this process encoded ``features`` from these pixels and grid (None: not known)."""
    known = FEATURE_SOURCES.get(features)
    return (
        None
        if known is None or grid is None
        else known == _pixel_fingerprint(pixels, grid)
    )


# Which pixels each live encode_image result came from: hosts cache features by path, so a file
# changed under it arrives with the old features.
FEATURE_SOURCES: Issued[str] = Issued()


def split_image_features(
    features: mx.array, image_grid_thw: Any, merge_size: int = 2
) -> List[mx.array]:
    """Split ``encode_image`` output into one array per image (prompt order)."""
    sizes = merged_tokens_per_image(image_grid_thw, merge_size)
    if sum(sizes) != features.shape[0]:
        raise ValueError(
            f"image_grid_thw describes {sum(sizes)} image tokens but the features have {features.shape[0]} rows"
        )
    bounds = np.cumsum([0] + sizes)
    return [features[int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:])]
