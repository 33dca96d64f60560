"""Text decoder of cohere_compass: Command-style parallel blocks, NoPE full layers,
interleaved MRoPE on sliding-window layers, tied head with ``logit_scale``."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

from ..base import LanguageModelOutput, scaled_dot_product_attention
from ..cache import KVCache
from ..cache import RotatingKVCache as _PinRotatingKVCache
from .config import RopeSpec, TextConfig
from .positions import (
    BatchRotatingKVCache,
    Issued,
    Positions,
    chunk_of,
    is_batch_cache,
    resolve,
    whole_prompt_positions,
)
from .speculative import refuse_speculative


def mrope_axis_table(section: Sequence[int], half_dim: int) -> np.ndarray:
    """Position axis (0=t, 1=h, 2=w) read by each of the ``half_dim`` frequency slots
    (interleaved MRoPE)."""
    j = np.arange(half_dim)
    axis = np.zeros(half_dim, dtype=np.int32)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class MultimodalRotary(nn.Module):
    """Interleaved MRoPE: mlx-lm's rope from an offset where the three axes are equal (text,
    decode), cos/sin of explicit positions (pictures)."""

    def __init__(self, spec: RopeSpec, head_dim: int):
        super().__init__()
        self.rope = initialize_rope(head_dim, base=spec.theta, traditional=False)
        half = head_dim // 2
        exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        self._inv_freq = mx.array(1.0 / spec.theta**exponents, dtype=mx.float32)
        self._axis = mx.array(mrope_axis_table(spec.mrope_section, half))

    def cos_sin(self, position_ids: mx.array) -> Tuple[mx.array, mx.array]:
        """cos/sin of shape [B, 1, L, head_dim] for positions [3, B, L]."""
        per_slot = position_ids[self._axis].astype(mx.float32)  # [half, B, L]
        angles = per_slot.transpose(1, 2, 0) * self._inv_freq  # [B, L, half]
        angles = mx.concatenate([angles, angles], axis=-1)[:, None]
        return mx.cos(angles), mx.sin(angles)

    def __call__(self, x: mx.array, positions: Positions) -> mx.array:
        if positions.explicit is None:
            return self.rope(x, offset=positions.offset)
        cos, sin = positions.cos_sin(self)
        out = x.astype(mx.float32) * cos + _rotate_half(x.astype(mx.float32)) * sin
        return out.astype(x.dtype)


def causal_mask(L: int, K: int, window: Optional[int]) -> Optional[mx.array]:
    """Boolean [L, K] mask for L queries whose keys end at the last query; None: all visible."""
    if L == 1 and (window is None or K <= window):
        return None
    q = mx.arange(K - L, K)[:, None]
    k = mx.arange(K)[None]
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    return mask


class Attention(nn.Module):
    def __init__(self, config: TextConfig, layer_type: str):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        spec = config.rope_for(layer_type)
        # Full-attention layers carry no positional encoding at all.
        self.rotary = MultimodalRotary(spec, self.head_dim) if spec else None
        self.window = (
            config.sliding_window if layer_type == "sliding_attention" else None
        )

    def __call__(self, x, positions: Positions, masks: "MaskBuilder", cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cache is not None:
            try:
                k, v = cache.update_and_fetch(k, v)
            except ValueError as err:
                # compass-compat: mx.quantize's own message names no setting a user can change.
                if "[quantize]" not in str(err) or not hasattr(cache, "group_size"):
                    raise
                raise KVCacheQuantizationError(
                    _kv_group_advice(self.head_dim, cache.group_size)
                ) from err
        if isinstance(k, mx.array):
            mask = masks.get(L, k.shape[2], self.window)
            out = mx.fast.scaled_dot_product_attention(
                q, k, v, scale=self.scale, mask=mask
            )
        else:  # packed keys of a quantized cache (generate's kv_bits): mlx-vlm's helper
            mask = masks.get(L, cache.offset, self.window)
            out = scaled_dot_product_attention(
                q, k, v, cache, scale=self.scale, mask=mask
            )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class KVCacheQuantizationError(ValueError):
    """Uniform KV-cache quantization (``kv_bits`` with ``kv_group_size``) cannot group this
    checkpoint's keys: ``mx.quantize`` takes groups of 32, 64 or 128 along ``head_dim``."""


QUANTIZE_GROUPS = (128, 64, 32)  # the group sizes mx.quantize accepts


def _kv_group_advice(head_dim: int, group_size: int) -> str:
    fits = [g for g in QUANTIZE_GROUPS if head_dim % g == 0]
    head = f"kv_group_size {group_size} cannot group this checkpoint's keys (head_dim {head_dim})"
    if fits:
        return f"{head}: pass kv_group_size={fits[0]} (the server's --kv-group-size), or use kv_quant_scheme='turboquant'"
    return (
        f"{head}: mx.quantize groups by {', '.join(map(str, QUANTIZE_GROUPS))}, none of which divides "
        f"{head_dim}, so uniform KV quantization cannot run on it; use kv_quant_scheme='turboquant' "
        "(mlx-vlm >= 0.4.4) or run without kv_bits"
    )


class MaskBuilder:
    """A forward's masks by (queries, keys, window); a 2-D padding mask is ANDed into the causal
    one; batch caches make theirs (``per_window``)."""

    def __init__(
        self,
        padding: Optional[mx.array],
        per_window: Optional[Dict[Optional[int], mx.array]] = None,
    ):
        self.padding = padding
        self.per_window = per_window or {}
        self._cache: Dict[Tuple[int, int, Optional[int]], Optional[mx.array]] = {}

    def get(self, L: int, K: int, window: Optional[int]):
        if window in self.per_window:
            return self.per_window[window]
        key = (L, K, window)
        if key not in self._cache:
            mask = causal_mask(L, K, window)
            if self.padding is not None and self.padding.shape[-1] == K:
                pad = self.padding.astype(mx.bool_)[:, None, None, :]
                mask = pad if mask is None else mask & pad
            self._cache[key] = mask
        return self._cache[key]


class MLP(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"text_config.hidden_act {config.hidden_act!r} is not supported; cohere_compass uses 'silu' (SwiGLU)"
            )
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LayerNorm(nn.Module):
    """Weight-only LayerNorm whose statistics are computed in float32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        y = mx.fast.layer_norm(
            x.astype(mx.float32), self.weight.astype(mx.float32), None, self.eps
        )
        return y.astype(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = Attention(config, layer_type)
        self.mlp = MLP(config)

    def __call__(self, x, positions, masks, cache=None):
        # Parallel block: both branches read the same normed input.
        n = self.input_layernorm(x)
        return x + self.self_attn(n, positions, masks, cache) + self.mlp(n)


class CompassTextModel(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config, t) for t in config.layer_types]
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        # A full-attention layer, whose cache offset counts every token (hosts such as vMLX
        # read per-row offsets there; a sliding layer's buffer wraps).
        full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
        self.fa_idx: Optional[int] = full[0] if full else None

    def __call__(self, h, positions, masks, cache, deepstack=None):
        """``deepstack``: ``[B, L, K, D]``, zero off the image tokens."""
        count = 0 if deepstack is None else deepstack.shape[2]
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, positions, masks, c)
            # Deepstack residuals go in after decoder layers 0..k-1 only.
            if i < count:
                h = h + deepstack[:, :, i].astype(h.dtype)
        return self.norm(h)


class RotatingKVCache(_PinRotatingKVCache):
    """A sliding layer's cache, kept in float under ``kv_bits`` (bounded by the window; mlx-vlm's
    ``to_quantized`` raises); ``merge`` carries the rows' deltas. Hosts key caches by its name."""

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "RotatingKVCache":
        # generate's kv_bits converts every layer in order, this sliding one before the
        # full-attention KVCache, whose mx.quantize error would name no setting to change.
        if self.keys is not None:
            head_dim = self.keys.shape[-1]
            if group_size not in QUANTIZE_GROUPS or head_dim % group_size:
                raise KVCacheQuantizationError(_kv_group_advice(head_dim, group_size))
        return self

    if BatchRotatingKVCache is not None:

        @classmethod
        def merge(
            cls, caches: Sequence[Any], prefix_lens: Optional[Sequence[int]] = None
        ) -> Any:
            # prefix_lens: mlx-vlm's prefix cache passes it to caches' own merge; rows are whole here.
            return BatchRotatingKVCache.merged(caches, RotatingKVCache)


class LanguageModel(nn.Module):
    """Decoder and head; each forward's positions come from :mod:`.positions` (its table)."""

    # vMLX: decode positions it passes are offset + arange and need the request's delta added.
    decode_positions_add_request_rope_delta = True
    # What make_cache builds, and a host-rebuilt first layer becomes (positions.resolve).
    sliding_cache_class = RotatingKVCache

    def __init__(
        self,
        config: TextConfig,
        tie_word_embeddings: bool = True,
        image_token_id: Optional[int] = None,
        spatial_merge_size: int = 2,
        video_token_id: Optional[int] = None,
    ):
        super().__init__()
        self.config = config
        self.model_type = config.model_type
        self.model = CompassTextModel(config)
        self.tie_word_embeddings = tie_word_embeddings
        if not tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logit_scale = config.logit_scale
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.spatial_merge_size = spatial_merge_size
        self._rope_deltas: Optional[mx.array] = None
        self._position_ids: Optional[mx.array] = None
        self.issued = Issued()

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self) -> List[Any]:
        return [
            self.sliding_cache_class(max_size=self.config.sliding_window, keep=0)
            if layer.layer_type == "sliding_attention"
            else KVCache()
            for layer in self.model.layers
        ]

    def get_rope_index(
        self,
        input_ids: mx.array,
        image_grid_thw: Optional[Any] = None,
        video_grid_thw: Optional[Any] = None,
        attention_mask: Optional[mx.array] = None,
    ) -> Tuple[mx.array, mx.array]:
        """A whole prompt's positions ``[3, B, L]`` and deltas ``[B, 1]`` (mlx-vlm primes a
        trimmed prompt's suffix with them)."""
        return whole_prompt_positions(
            self, input_ids, image_grid_thw, video_grid_thw, attention_mask
        )

    def __call__(
        self,
        inputs: Optional[mx.array] = None,
        inputs_embeds: Optional[mx.array] = None,
        mask: Optional[mx.array] = None,
        cache: Optional[List[Any]] = None,
        position_ids: Optional[mx.array] = None,
        rope_deltas: Optional[Any] = None,
        deepstack_visual_embeds: Optional[mx.array] = None,
        **kwargs,
    ) -> LanguageModelOutput:
        refuse_speculative(kwargs)
        h = self.model.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        B, L = h.shape[:2]
        if cache is None:
            cache = [None] * len(self.model.layers)
        positions = resolve(self, cache, B, L, position_ids, rope_deltas, kwargs)
        deepstack = chunk_of(self, deepstack_visual_embeds, positions.column, L)
        if is_batch_cache(cache[0]):
            per_window: Dict[Optional[int], mx.array] = {}
            for layer, c in zip(self.model.layers, cache):
                window = layer.self_attn.window
                if window not in per_window:
                    per_window[window] = c.make_mask(
                        L, window_size=window, return_array=True
                    )
            masks = MaskBuilder(None, per_window)
        else:
            # A 2-D padding mask; the processor's attention_mask is numpy.
            padding = mask if getattr(mask, "ndim", 0) == 2 else None
            masks = MaskBuilder(None if padding is None else mx.array(padding))
        h = self.model(h, positions, masks, cache, deepstack)
        keep = kwargs.get("logits_to_keep") or 0
        if keep:
            h = h[:, -keep:]
        logits = (
            self.model.embed_tokens.as_linear(h)
            if self.tie_word_embeddings
            else self.lm_head(h)
        )
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        return LanguageModelOutput(logits=logits)
