"""Text decoder of cohere_compass: Command-style parallel blocks, NoPE full layers,
interleaved MRoPE on sliding-window layers, tied head with ``logit_scale``."""

from __future__ import annotations

import functools
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

from .. import base as _pin_base
from ..base import LanguageModelOutput
from ..cache import KVCache
from ..cache import RotatingKVCache as _PinRotatingKVCache
from . import cpu_lanes
from .config import RopeSpec, TextConfig
from .positions import Issued, Kept, Positions, delta_rows, get_rope_index, is_batch_cache, kept, padding_rows, resolve
from .speculative import refuse_speculative


def mrope_axis_table(section: Sequence[int], half_dim: int) -> np.ndarray:
    """Position axis (0=t, 1=h, 2=w) read by each of the ``half_dim`` frequency slots.

    Interleaved layout: slot j reads h when ``j % 3 == 1 and j < 3*section[1]``,
    w when ``j % 3 == 2 and j < 3*section[2]``, t otherwise.
    """
    j = np.arange(half_dim)
    axis = np.zeros(half_dim, dtype=np.int32)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class MultimodalRotary:
    """Rotation of one sliding-layer kind, for either a scalar offset or explicit positions.

    Equal position axes (text, decode) reduce MRoPE to ordinary non-traditional
    RoPE, which goes through mlx-lm's rope (``mx.fast.rope``); only prompts whose
    axes differ (images) take the general cos/sin path.
    """

    def __init__(self, spec: RopeSpec, head_dim: int):
        self.spec = spec
        self.head_dim = head_dim
        self._fast = initialize_rope(head_dim, base=spec.theta, traditional=False)
        half = head_dim // 2
        self._inv_freq = mx.array(
            1.0 / (spec.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)),
            dtype=mx.float32,
        )
        self._axis = mx.array(mrope_axis_table(spec.mrope_section, half))

    def cos_sin(self, position_ids: mx.array) -> Tuple[mx.array, mx.array]:
        """cos/sin of shape [B, 1, L, head_dim] for positions [3, B, L]."""
        per_slot = position_ids[self._axis].astype(mx.float32)  # [half, B, L]
        angles = per_slot.transpose(1, 2, 0) * self._inv_freq  # [B, L, half]
        angles = mx.concatenate([angles, angles], axis=-1)[:, None]
        return mx.cos(angles), mx.sin(angles)

    def apply(self, x: mx.array, positions: "Positions") -> mx.array:
        if positions.explicit is None:
            # compass-compat: on the CPU one cos/sin table per forward (bit-identical).
            return cpu_lanes.rope(self._fast, x, positions.offset, positions._tables)
        cos, sin = positions.cos_sin(self)
        out = x.astype(mx.float32) * cos + _rotate_half(x.astype(mx.float32)) * sin
        return out.astype(x.dtype)


def causal_mask(L: int, K: int, window: Optional[int]) -> Optional[mx.array]:
    """Boolean [L, K] mask for L queries whose keys (chronological) end at the last query.

    A key is visible iff ``q - window < k <= q``. Returns None when every key is visible.
    """
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
        self._rotary = MultimodalRotary(spec, self.head_dim) if spec else None
        self.window = config.sliding_window if layer_type == "sliding_attention" else None

    def __call__(self, x, positions: Positions, masks: "MaskBuilder", cache=None):
        B, L, _ = x.shape
        q = cpu_lanes.linear(self.q_proj, x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = cpu_lanes.linear(self.k_proj, x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = cpu_lanes.linear(self.v_proj, x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self._rotary is not None:
            if mx.default_device() == mx.cpu:
                # compass-compat: one rotation for q and k on the CPU (elementwise: bit-identical).
                qk = self._rotary.apply(mx.concatenate([q, k], axis=1), positions)
                q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
            else:
                q = self._rotary.apply(q, positions)
                k = self._rotary.apply(k, positions)
        if cache is not None:
            try:
                k, v = cache.update_and_fetch(k, v)
            except ValueError as err:
                # compass-compat: mx.quantize's own message names no setting a user can change.
                if "[quantize]" not in str(err) or not hasattr(cache, "group_size"):
                    raise
                raise KVCacheQuantizationError(_kv_group_advice(self.head_dim, cache.group_size)) from err
        if isinstance(k, mx.array):
            out = cpu_lanes.attention(q, k, v, self.scale, masks.get(L, k.shape[2], self.window))
        else:
            # compass-compat: a quantized cache (generate's kv_bits) returns packed keys and
            # values, which only the pin's attention helper reads; the cache counts the keys.
            mask = masks.get(L, cache.offset, self.window)
            attend = functools.partial(_pin_attention(), keys=k, values=v, cache=cache)
            out = cpu_lanes.quantized_attention(q, attend, self.scale, mask)
        return cpu_lanes.linear(self.o_proj, out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class KVCacheQuantizationError(ValueError):
    """Uniform KV-cache quantization (``kv_bits`` with ``kv_group_size``) cannot group this
    checkpoint's keys: ``mx.quantize`` takes groups of 32, 64 or 128 along ``head_dim``."""


QUANTIZE_GROUPS = (128, 64, 32)  # the group sizes mx.quantize accepts


def _kv_group_advice(head_dim: int, group_size: int) -> str:
    fits = [g for g in QUANTIZE_GROUPS if head_dim % g == 0]
    head = f"kv_group_size {group_size} cannot group this checkpoint's keys (head_dim {head_dim})"
    if fits:
        return (
            f"{head}: pass kv_group_size={fits[0]} (the server's --kv-group-size), or use kv_quant_scheme='turboquant'"
        )
    return (
        f"{head}: mx.quantize groups by {', '.join(map(str, QUANTIZE_GROUPS))}, none of which divides "
        f"{head_dim}, so uniform KV quantization cannot run on it; use kv_quant_scheme='turboquant' "
        "(mlx-vlm >= 0.4.4) or run without kv_bits"
    )


def _pin_attention():
    """The pin's ``scaled_dot_product_attention(q, k, v, cache, scale, mask)``, which reads a
    quantized cache's packed keys and values (uniform: mlx-vlm >= 0.4.4's models/base.py, or
    mlx-lm's that 0.3.x imports there; TurboQuant where the pin ships it)."""
    attend = getattr(_pin_base, "scaled_dot_product_attention", None)
    if attend is None:
        raise NotImplementedError(
            "this mlx-vlm has no scaled_dot_product_attention in mlx_vlm.models.base, so cohere_compass "
            "cannot attend over a quantized KV cache: run without kv_bits"
        )
    return attend


class MaskBuilder:
    """Per-forward cache of masks, keyed by (queries, keys, window).

    A 2-D padding mask is only ever ANDed into the causal mask, never used in
    its place (mlx-vlm 0.3.x passes the processor's attention mask as ``mask``).
    Batch caches (left-padded rows, rotating buffers) make their own masks before
    any layer updates them; those are passed in as ``per_window``.
    """

    def __init__(self, padding: Optional[mx.array], per_window: Optional[Dict[Optional[int], mx.array]] = None):
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
        h = nn.silu(cpu_lanes.linear(self.gate_proj, x)) * cpu_lanes.linear(self.up_proj, x)
        return cpu_lanes.linear(self.down_proj, h)


class LayerNorm(nn.Module):
    """Weight-only LayerNorm whose statistics are computed in float32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        y = mx.fast.layer_norm(x.astype(mx.float32), self.weight.astype(mx.float32), None, self.eps)
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


def _delta_rows(cache: Any) -> Optional[mx.array]:
    """The rope delta kept with ``cache`` as one value per row (``[rows]``), or None."""
    state = kept(cache)
    return delta_rows(state.delta) if state is not None else None


def _keep_rows(cache: Any, rows: Any) -> None:
    setattr(cache, "compass_positions", Kept(delta=rows))


class _KeepsRowDeltas:
    """A batch cache made by ``merge`` of this model's request caches: each row's rope delta
    stays with its row through ``filter``, ``extend`` and ``extract``.

    Hosts that prefill requests one by one, merge their caches into a batch cache and decode
    with nothing but the cache (Rapid-MLX) would otherwise leave every row with no delta, or
    with one shared by the module (mlx-vlm's own models), and picture rows would decode at
    wrong positions."""

    def filter(self, batch_indices: Any) -> None:
        rows = _delta_rows(self)
        super().filter(batch_indices)  # type: ignore[misc]
        if rows is not None:
            _keep_rows(self, rows[mx.array(batch_indices).astype(mx.int32)].reshape(-1, 1))

    def extend(self, other: Any) -> None:
        mine, theirs = _delta_rows(self), _delta_rows(other)
        super().extend(other)  # type: ignore[misc]
        _keep_rows(self, None if mine is None or theirs is None else mx.concatenate([mine, theirs]).reshape(-1, 1))

    def extract(self, idx: int) -> Any:
        rows = _delta_rows(self)
        single = super().extract(idx)  # type: ignore[misc]
        if rows is not None:
            own = _REQUEST_CACHES.get(type(single))
            if own is not None:
                single.__class__ = own  # same state; keeps merge (and to_quantized) ours
            _keep_rows(single, int(rows[idx].item()))
        return single


def _merged(batch_class: Any, caches: Sequence[Any]) -> Any:
    """``batch_class.merge(caches)`` with the requests' rope deltas carried into the batch."""
    batch = batch_class.merge(caches)
    rows = [_delta_rows(c) for c in caches]
    if all(r is not None for r in rows):
        _keep_rows(batch, mx.concatenate(rows).reshape(-1, 1))
    return batch


# The pin's batch class for merged rotating caches (mlx-lm's before mlx-vlm 0.6). Only layer 0
# keeps the delta, and it is a sliding layer in the published layout; full-attention layers keep
# the pin's exact KVCache class, which mlx-vlm's prefix cache matches by exact type.
_PinBatchRotatingKVCache = getattr(sys.modules[_PinRotatingKVCache.__module__], "BatchRotatingKVCache", None)
BatchRotatingKVCache = (
    type("BatchRotatingKVCache", (_KeepsRowDeltas, _PinBatchRotatingKVCache), {"__module__": __name__})
    if _PinBatchRotatingKVCache is not None and hasattr(_PinRotatingKVCache, "merge")
    else None
)


class RotatingKVCache(_PinRotatingKVCache):
    """mlx-vlm's rotating cache of a sliding-window layer, kept in float when generate quantizes
    the KV cache (``kv_bits``): its memory is bounded by the window, and mlx-vlm has no quantized
    rotating cache (its ``to_quantized`` raises). Full-attention layers' ``KVCache`` quantize.
    ``merge`` (where the pin batches) carries each request's rope delta into the batch cache.
    The pin's class name is kept: hosts key caches by it (oMLX's cache type registry)."""

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
        def merge(cls, caches: Sequence[Any], prefix_lens: Optional[Sequence[int]] = None) -> Any:
            # prefix_lens: mlx-vlm's prefix cache passes it to caches' own merge; rows are whole here.
            return _merged(BatchRotatingKVCache, caches)


# What ``extract`` of a batch cache returns (the pin's class) -> this model's request cache.
_REQUEST_CACHES = {_PinRotatingKVCache: RotatingKVCache}


class LanguageModel(nn.Module):
    """Decoder plus the MRoPE state that mlx-vlm's generate loops expect: where each forward's
    positions come from is :mod:`.positions` (its docstring has the table); hosts read and reset
    ``_rope_deltas`` / ``_position_ids`` as on Qwen-VL language models in mlx-vlm."""

    # vMLX: decode positions it passes are offset + arange and need the request's delta added.
    decode_positions_add_request_rope_delta = True

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
            RotatingKVCache(max_size=self.config.sliding_window, keep=0)
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
        """MRoPE position ids ``[3, B, L]`` and rope deltas ``[B, 1]`` of a whole prompt: the
        Qwen-VL language-model method mlx-vlm 0.7.x calls to prime positions before it trims a
        prompt to its uncached suffix (it then passes them with every chunk: they count from
        column 0). Padding (``attention_mask == 0``) gets position 0."""
        for grid, token, name in (
            (image_grid_thw, self.image_token_id, "image_token_id"),
            (video_grid_thw, self.video_token_id, "video_token_id"),
        ):
            if grid is not None and token is None:
                raise ValueError(f"get_rope_index needs {name}: build LanguageModel through Model")
        position_ids, deltas = get_rope_index(
            np.array(input_ids),
            image_grid_thw,
            -1 if self.image_token_id is None else self.image_token_id,
            self.spatial_merge_size,
            attention_mask=padding_rows(attention_mask),
            video_grid_thw=video_grid_thw,
            video_token_id=self.video_token_id,
        )
        positions = mx.array(position_ids)
        self.issued.mark(positions, whole=True)
        return positions, mx.array(deltas.reshape(-1, 1))

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
        positions, deepstack = resolve(self, cache, B, L, position_ids, rope_deltas, deepstack_visual_embeds, kwargs)
        if is_batch_cache(cache[0]):
            per_window: Dict[Optional[int], mx.array] = {}
            for layer, c in zip(self.model.layers, cache):
                window = layer.self_attn.window
                if window not in per_window:
                    per_window[window] = c.make_mask(L, window_size=window, return_array=True)
            masks = MaskBuilder(None, per_window)
        else:
            padding = mask if (mask is not None and getattr(mask, "ndim", 0) == 2) else None
            if padding is not None and not isinstance(padding, mx.array):
                padding = mx.array(padding)  # the processor's numpy attention_mask (mlx-vlm 0.3.x)
            masks = MaskBuilder(padding)
        h = self.model(h, positions, masks, cache, deepstack)
        keep = kwargs.get("logits_to_keep") or 0
        if keep:
            h = h[:, -keep:]
        logits = cpu_lanes.linear(self.model.embed_tokens if self.tie_word_embeddings else self.lm_head, h)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        return LanguageModelOutput(logits=logits)

    @staticmethod
    def sanitize(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return weights
