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
from .config import RopeSpec, TextConfig, grid_sequence
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


class Positions:
    """Where the tokens of one forward pass sit: a scalar offset or [3, B, L] ids."""

    def __init__(self, offset: int = 0, explicit: Optional[mx.array] = None):
        self.offset = offset
        self.explicit = explicit
        self._tables: Dict[int, Tuple[mx.array, mx.array]] = {}

    def cos_sin(self, rotary: MultimodalRotary):
        key = id(rotary)
        if key not in self._tables:
            self._tables[key] = rotary.cos_sin(self.explicit)
        return self._tables[key]


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


def is_batch_cache(c: Any) -> bool:
    """mlx-lm / mlx-vlm batch caches (``BatchKVCache``, ``BatchRotatingKVCache``):
    left-padded rows whose ``offset`` is a per-row ``mx.array``."""
    return c is not None and isinstance(getattr(c, "offset", None), mx.array) and c.offset.ndim == 1


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
    delta = getattr(cache, STORED_DELTA, None)
    if delta is None:
        return None
    if isinstance(delta, (int, np.integer)):
        return mx.array([int(delta)], dtype=mx.int32)
    return (delta if isinstance(delta, mx.array) else mx.array(np.asarray(delta))).reshape(-1).astype(mx.int32)


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
            setattr(self, STORED_DELTA, rows[mx.array(batch_indices).astype(mx.int32)].reshape(-1, 1))

    def extend(self, other: Any) -> None:
        mine, theirs = _delta_rows(self), _delta_rows(other)
        super().extend(other)  # type: ignore[misc]
        joined = None if mine is None or theirs is None else mx.concatenate([mine, theirs]).reshape(-1, 1)
        setattr(self, STORED_DELTA, joined)

    def extract(self, idx: int) -> Any:
        rows = _delta_rows(self)
        single = super().extract(idx)  # type: ignore[misc]
        if rows is not None:
            own = _REQUEST_CACHES.get(type(single))
            if own is not None:
                single.__class__ = own  # same state; keeps merge (and to_quantized) ours
            setattr(single, STORED_DELTA, int(rows[idx].item()))
        return single


def _merged(batch_class: Any, caches: Sequence[Any]) -> Any:
    """``batch_class.merge(caches)`` with the requests' rope deltas carried into the batch."""
    batch = batch_class.merge(caches)
    rows = [_delta_rows(c) for c in caches]
    if all(r is not None for r in rows):
        setattr(batch, STORED_DELTA, mx.concatenate(rows).reshape(-1, 1))
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
    """Decoder plus the MRoPE state that mlx-vlm's generate loops expect.

    Positions of one forward pass come, in this order, from: ``position_ids``
    given by the caller (``[3, B, L]`` or ``[B, L]``, the whole prompt or this
    chunk); else cache offset + rope delta, where the delta is the ``rope_deltas``
    argument, else the one kept with this request's cache (``STORED_DELTA`` on its
    first layer), else the one the last prefill left in ``_rope_deltas`` (hosts that
    rebuild caches between prefill and decode), else 0. A cache at column 0 starts
    new sequences. Every forward keeps the delta its tokens used with the cache and
    in ``_rope_deltas``; docs/model-contract.md has the whole contract.
    """

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
        # Names and meaning as Qwen-VL language models in mlx-vlm: hosts read and reset them.
        self._rope_deltas: Optional[mx.array] = None
        # The deltas array get_input_embeddings made, and its one value when every row has it.
        self._known_deltas: Tuple[Optional[mx.array], Optional[int]] = (None, None)
        self._text_deltas: Optional[mx.array] = None
        self._position_ids: Optional[mx.array] = None
        self._chunk_sources: Dict[str, Tuple[Any, int]] = {}
        # The positions get_input_embeddings placed after a cached prefix, and that prefix's length.
        self._placed: Tuple[Optional[mx.array], int] = (None, 0)

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
        """MRoPE position ids ``[3, B, L]`` and rope deltas ``[B, 1]`` of a prompt.

        The Qwen-VL language-model method mlx-vlm 0.7.x calls to prime positions
        before it trims a prompt to its uncached suffix. Image and video tokens are
        found by ``image_token_id`` / ``video_token_id``; padding
        (``attention_mask == 0``) gets position 0.
        """
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
        # compass-compat: mlx-vlm 0.7.x primes a restored prefix's suffix with these whole-prompt
        # positions and passes them with every chunk: they start at column 0, not where first seen.
        self._chunk_sources["position_ids"] = (positions, 0)
        return positions, mx.array(deltas.reshape(-1, 1))

    def remember_deltas(self, deltas: mx.array, values: Sequence[int], text: bool = False) -> None:
        """Record that ``deltas`` (an array a host will pass back) holds ``values``, so the
        positions it gives need no device read and take the scalar-offset rope; ``text``: the
        zeros of a text-only prompt, which say nothing about a cache it continues."""
        single = {int(v) for v in values}
        self._known_deltas = (deltas, single.pop() if len(single) == 1 else None)
        self._text_deltas = deltas if text else None

    def _chunk_start(self, kind: str, full: mx.array, L: int, columns: int) -> int:
        """Where this forward's L tokens start in an array that covers more than them.

        mlx-vlm >= 0.4 hands every prefill chunk the whole prompt's arrays; the
        start is the tokens processed since the array was first seen (positions from
        :meth:`get_rope_index` count from column 0: they cover the whole sequence).
        """
        source, base = self._chunk_sources.get(kind, (None, 0))
        if source is not full:
            self._chunk_sources[kind] = (full, columns)
            base = columns
        return columns - base

    def remember_prefix(self, position_ids: mx.array, prefix: int) -> None:
        """Record that ``position_ids`` (from ``get_input_embeddings``) follow ``prefix`` cached
        tokens: the ids were a prompt's suffix, placed by the whole prompt's token types."""
        self._placed = (position_ids, prefix)

    def _refuse_prompt_positions_after_a_prefix(self, position_ids: mx.array, columns: int) -> None:
        """Refuse positions from ``get_input_embeddings`` that do not follow the tokens the cache
        holds: a prompt's own positions (they count from its first token) on a cache that already
        holds other tokens, as when a host trims a prompt after a restored prefix cache and passes
        no whole-prompt ``mm_token_type_ids`` to place the rest; or a suffix's positions, placed
        after a prefix of another length. Served, they would be a wrong answer."""
        source = self._chunk_sources.get("position_ids", (None, 0))[0]
        if position_ids is source or position_ids is not self._position_ids:
            return
        placed, prefix = self._placed
        if position_ids is not placed:
            prefix = 0
        if columns == prefix:
            return
        if prefix:
            raise ValueError(
                f"position_ids follow a cached prefix of {prefix} tokens (the whole prompt's mm_token_type_ids "
                f"were passed with its last tokens), but the cache holds {columns} tokens: pass the cache "
                "restored to exactly the tokens before input_ids"
            )
        raise ValueError(
            f"position_ids count from this prompt's first token, but the cache already holds {columns} "
            "tokens: the prompt was cut after a restored prefix cache and a picture or video follows the "
            "cut. Pass the whole prompt's mm_token_type_ids, image_grid_thw and pixels (as mlx-vlm 0.4.4's "
            "PromptCacheState does) so the model can place the rest, or start a new prompt cache"
        )

    def _request_delta(self, first: Any, B: int) -> Optional[Any]:
        """The delta of the sequence(s) this cache continues: the one kept with the cache,
        else the last prefill's (``_rope_deltas``) when it has a row per sequence."""
        for delta in (getattr(first, STORED_DELTA, None), self._rope_deltas):
            if delta is None:
                continue
            rows = 1 if isinstance(delta, (int, np.integer)) else int(np.prod(delta.shape))
            # A batch filtered or extended since (rows changed) cannot use it row for row.
            if rows == B:
                return delta
        return None

    def _keep_delta(self, first: Any, delta: Any) -> None:
        """Keep ``delta`` with this request's cache (so two requests decoded in turn in one
        process never read each other's) and in ``_rope_deltas`` (hosts read it after prefill)."""
        # Kept as an mx.array: mlx-vlm 0.6.x's batch generator reads and resets it.
        self._rope_deltas = mx.array([[int(delta)]]) if isinstance(delta, (int, np.integer)) else delta
        if first is not None:
            try:
                setattr(first, STORED_DELTA, delta)
            except AttributeError:  # a cache class with __slots__: the module state alone
                pass

    def _unslice_positions(self, position_ids: Optional[mx.array], B: int, L: int, columns: int) -> Optional[mx.array]:
        """``[3, B, L]`` positions back from a batch host that cut their first axis as a batch axis.

        mlx-vlm 0.4.4's ``BatchGenerator`` slices every prompt array to ``[:batch]`` on axis 0
        and 0.6.3's ``batch_generate`` gives each row ``[:1]`` of it, so ``[3, B, L]`` arrives
        as ``[min(3, B), B, L]`` (its first axes) or ``[B, B, L]`` (the temporal axis B times;
        with B = 3 the shape even looks right). The prompt's own ``[3, B, L]`` is still in
        ``_position_ids`` (get_input_embeddings left it there); it is used when its temporal
        axis is the one given, else a wrong-shaped array is refused.
        """
        if position_ids is None or position_ids.ndim != 3:
            return position_ids
        if position_ids.shape[0] == 3 and (B != 3 or L == 1):
            return position_ids  # decode steps never need the (host-reading) check below
        full = self._position_ids
        if (
            full is not None
            and full is not position_ids
            and full.ndim == 3
            and full.shape[:2] == (3, position_ids.shape[1])
        ):
            window = full
            if position_ids.shape[-1] != full.shape[-1]:  # a host's per-chunk slice
                window = full[..., columns : columns + position_ids.shape[-1]]
            if window.shape[-1] == position_ids.shape[-1]:
                if position_ids.shape[0] != 3:
                    if mx.array_equal(position_ids[0], window[0]).item():
                        return window
                else:
                    # B = 3: only the temporal axis three times over (0.6.3), where the
                    # prompt's own axes differ, was cut.
                    temporal = mx.broadcast_to(window[:1], window.shape)
                    if mx.array_equal(position_ids, temporal).item() and not mx.array_equal(window, temporal).item():
                        return window
        if position_ids.shape[0] == 3:
            return position_ids
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}, but MRoPE positions are [3, batch, length] "
            f"(this batch: {B} rows of {L} tokens); pass the [3, B, L] array get_input_embeddings returned, "
            "sliced on its last axis only"
        )

    def _positions(
        self, B: int, L: int, offset: Any, position_ids: Optional[mx.array], delta: Optional[Any]
    ) -> Positions:
        if position_ids is not None:
            if position_ids.ndim == 2:
                position_ids = mx.broadcast_to(position_ids[None], (3,) + tuple(position_ids.shape))
            return Positions(explicit=position_ids)
        if delta is None:
            return Positions(offset=offset)
        if delta is self._known_deltas[0] and self._known_deltas[1] is not None:
            delta = self._known_deltas[1]  # one delta for every row, known without a device read
        if isinstance(delta, (int, np.integer)):
            return Positions(offset=offset + int(delta))
        delta = delta.reshape(-1) if isinstance(delta, mx.array) else mx.array(np.asarray(delta).reshape(-1))
        if delta.size not in (1, B):
            raise ValueError(f"rope_deltas has {delta.size} rows but the batch has {B}; pass one delta per row")
        # One offset per row: mx.fast.rope takes a [B] offset array.
        return Positions(offset=mx.broadcast_to(offset + delta.astype(mx.int32), (B,)))

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
        first = cache[0]
        batched = is_batch_cache(first)
        if batched:
            absorb_prompt_padding(cache, kwargs.get("attention_mask"), B, L, kwargs.get("prompt_padding"))
            # A copy: batch caches update ``offset`` in place (``offset += L``) in layer 0,
            # and every later layer must still rotate from where this chunk starts.
            offset = mx.array(first.offset)
            columns = first._offset if hasattr(first, "_offset") else getattr(first, "_idx", 0)
        else:
            offset = first.offset if first is not None else 0
            columns = offset
        fresh = first is None or columns == 0
        if fresh:
            self._rope_deltas = None

        position_ids = self._unslice_positions(position_ids, B, L, columns)
        if not batched:
            refuse_a_ring_cut_after_it_wrapped(cache, columns, L)
        if position_ids is not None and not batched:
            self._refuse_prompt_positions_after_a_prefix(position_ids, columns)
        if position_ids is not None and position_ids.shape[-1] != L:
            start = self._chunk_start("position_ids", position_ids, L, columns)
            position_ids = position_ids[..., start : start + L]
        if position_ids is not None and position_ids.ndim == 3 and position_ids.shape[1] != B:
            position_ids = _fill_text_rows(
                position_ids, B, L, offset, rope_deltas, kwargs.get("position_rows"), kwargs.get("visual_pos_masks")
            )
        if rope_deltas is not None and not isinstance(rope_deltas, (int, np.integer, mx.array)):
            rope_deltas = mx.array(rope_deltas)
        if fresh and hasattr(first, "__dict__"):
            vars(first).pop(DELTA_SINCE, None)
        if rope_deltas is not None and rope_deltas is self._text_deltas and not fresh:
            # mlx-vlm 0.4.x merges a text suffix's own (zero) deltas into its kwargs after a
            # restored prefix: the suffix continues the delta kept with the prefix's cache, if
            # that delta holds where the cache now ends (a cache a host trimmed back to before
            # a picture, as LM Studio's prompt cache does, keeps a delta that no longer does).
            kept = getattr(first, STORED_DELTA, None)
            since = getattr(first, DELTA_SINCE, None)
            if kept is not None and (
                since is None or int(since.item() if isinstance(since, mx.array) else since) <= columns
            ):
                rope_deltas = kept
        delta = rope_deltas if rope_deltas is not None else (None if fresh else self._request_delta(first, B))
        if rope_deltas is not None:
            self._keep_delta(first, rope_deltas)
        elif position_ids is not None:
            # The delta decode steps continue from (per row): last position + 1 - tokens so far.
            # Lazy, so no host sync; a later chunk of the same prompt overwrites it.
            last = position_ids.max(axis=(0, 2)) if position_ids.ndim == 3 else position_ids.max(axis=-1)
            self._keep_delta(first, (last + 1 - (offset + L)).reshape(-1, 1))
        else:
            self._keep_delta(first, (0 if B == 1 else mx.zeros((B, 1), mx.int32)) if delta is None else delta)
        if position_ids is not None and L > 1 and not batched and first is not None:
            # Prefill only: a decoded token follows the delta, and no lazy chain grows per step.
            _keep_delta_since(first, position_ids, columns, L)
        deepstack = deepstack_visual_embeds
        if deepstack is not None and deepstack.shape[1] != L:
            start = self._chunk_start("deepstack", deepstack, L, columns)
            deepstack = deepstack[:, start : start + L]
        positions = self._positions(B, L, offset, position_ids, delta)

        if batched:
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


# Attribute of a request's first-layer cache holding the rope delta its tokens continue from.
STORED_DELTA = "compass_rope_deltas"
# ... and the first cache column from which that delta holds (past the last vision token).
DELTA_SINCE = "compass_rope_deltas_since"


def _keep_delta_since(first: Any, position_ids: mx.array, columns: int, L: int) -> None:
    """Keep with the cache where its delta starts to hold: past the last token of this chunk
    whose position does not follow the final delta (a vision token), else where it held
    before. Lazy (an mx scalar); read only when a restored prefix may continue it."""
    rows = position_ids.max(axis=0) if position_ids.ndim == 3 else position_ids  # [B, L]
    steps = rows - mx.arange(L)[None]  # constant over the tokens that follow one delta
    off = steps != steps[:, -1:]
    past_last_off = mx.max(mx.where(off, mx.arange(1, L + 1)[None], 0))
    before = getattr(first, DELTA_SINCE, None)
    since = mx.where(past_last_off > 0, columns + past_last_off, columns if before is None else before)
    try:
        setattr(first, DELTA_SINCE, since)
    except AttributeError:  # a cache class with __slots__
        pass


# Attribute of a request's first rotating cache: the most tokens it has held (its offset's high mark).
REACHED = "compass_reached"


def refuse_a_ring_cut_after_it_wrapped(cache: List[Any], columns: int, L: int) -> None:
    """Refuse a sliding-window cache set back to ``columns`` tokens after it held more than its
    window: its ring then holds the last tokens, not the first ``columns`` (mlx-vlm 0.4.4's
    ``PromptCacheState`` cuts every cache by slicing its keys to the reused prefix), and the
    answer would be wrong. Records the high mark for the next call."""
    ring = next((c for c in cache if c is not None and hasattr(c, "max_size")), None)
    if ring is None:
        return
    reached = getattr(ring, REACHED, 0)
    if 0 < columns < reached and reached > ring.max_size:
        raise ValueError(
            f"The sliding-window cache was set back to {columns} tokens after it held {reached}, past its "
            f"window of {ring.max_size}: it no longer holds the first {columns} tokens (mlx-vlm 0.4.x's "
            "PromptCacheState trims caches by slicing). Start a new PromptCacheState (a new chat) for this "
            "turn, or keep the conversation within the model's sliding_window"
        )
    try:
        setattr(ring, REACHED, columns + L)
    except AttributeError:  # a cache class with __slots__: nothing to check against later
        pass


def absorb_prompt_padding(
    cache: List[Any], attention_mask: Any, B: int, L: int, prompt_padding: Optional[Any] = None
) -> None:
    """Tell empty batch caches about left padding that only the prompt's arrays show.

    mlx-vlm 0.4.x-0.6.x ``batch_generate`` tokenizes its prompts left-padded to one length and
    hands the padded rows to its BatchGenerator as if they were real tokens (its caches get no
    left padding), with the processor's ``attention_mask`` among the prompt arrays. Unmasked,
    every row would attend to its padding, and decode positions (cache offset + the row's delta,
    which counts real tokens) would run ahead by the padding. Declaring the padding on the caches
    (mlx-lm's ``prepare(left_padding=)``) masks it from then on, also after rows are filtered, and
    makes their offsets count real tokens. The padding comes from ``prompt_padding``
    (get_input_embeddings' per-row count, whole however the prefill is cut), else from this
    chunk's ``attention_mask``. Padding the caches already know (mlx-vlm 0.7's generator strips
    the processor's padding and pads rows itself) is not added twice.
    """
    first = cache[0]
    if getattr(first, "keys", None) is not None or not hasattr(first, "left_padding"):
        return  # padding can only be declared before the first tokens go in
    if prompt_padding is not None and int(np.size(prompt_padding)) == B:
        lead = np.asarray(prompt_padding).reshape(-1)
    elif (
        attention_mask is not None and getattr(attention_mask, "ndim", 0) == 2 and tuple(attention_mask.shape) == (B, L)
    ):
        keep = np.asarray(attention_mask).astype(bool)
        lead = np.where(keep.any(axis=1), keep.argmax(axis=1), L)
    else:
        return
    extra = np.maximum(lead - np.asarray(first.left_padding).reshape(-1), 0)
    if not extra.any():
        return
    for c in cache:
        if hasattr(c, "prepare"):
            c.prepare(left_padding=extra.tolist())
        else:  # older mlx-lm batch caches: what prepare() does
            c.left_padding = c.left_padding + mx.array(extra)
            c.offset = c.offset - mx.array(extra)


def _fill_text_rows(
    position_ids: mx.array, B: int, L: int, offset: Any, deltas: Any, position_rows: Any, visual: Any
) -> mx.array:
    """``[3, B, L]`` positions from a batch whose picture rows alone brought positions.

    mlx-vlm 0.6+'s batch generator joins each prompt key over the rows that carry it; text rows
    carry no positions (they follow their cache), so the rows given are the picture rows, in
    order. Which rows those are comes from ``position_rows``, which every row carries and no
    host cuts per prefill chunk; a host that drops it leaves ``visual_pos_masks``, which tells
    only while it covers each picture row's vision tokens. Text rows take their cache offset
    plus their own rope delta.
    """
    if position_rows is not None and int(np.size(position_rows)) == B:
        rows = np.nonzero(np.array(position_rows).reshape(-1))[0]
    elif visual is not None:
        rows = np.nonzero(np.array(visual).reshape(B, -1).any(axis=1))[0]
    else:
        raise ValueError(
            f"position_ids has {position_ids.shape[1]} rows but the batch has {B}; pass one row per "
            "sequence (or the position_rows get_input_embeddings returned, to tell which rows they are)"
        )
    if len(rows) != position_ids.shape[1]:
        raise ValueError(
            f"position_ids has {position_ids.shape[1]} rows but {len(rows)} of the batch's {B} rows are "
            "marked as having positions; pass one row per sequence"
        )
    start = mx.array(offset).reshape(-1, 1)
    if deltas is not None and int(np.size(deltas)) == B:
        start = start + mx.array(deltas).reshape(-1, 1).astype(start.dtype)
    text = mx.broadcast_to(start + mx.arange(L), (B, L)).astype(position_ids.dtype)
    full = mx.array(mx.broadcast_to(text[None], (3, B, L)))
    full[:, mx.array(rows.astype(np.uint32))] = position_ids
    return full


def padding_rows(mask: Any) -> Optional[np.ndarray]:
    """A 2-D ``[B, L]`` attention mask as numpy (1 = token, 0 = padding), else None."""
    return np.array(mask) if mask is not None and getattr(mask, "ndim", 0) == 2 else None


IMAGE, VIDEO = 1, 2  # mm_token_type_ids values, as the processor writes them


def _grid_runs(image_grid_thw, video_grid_thw) -> Dict[int, List[Tuple[int, int, int]]]:
    """The (t, h, w) grid each run of vision tokens takes, per token type, in prompt order.

    A video's temporal patches are separate runs (the processor puts a timestamp
    between them), so a video grid (t, h, w) gives t runs of grid (1, h, w).
    """
    images = list(grid_sequence(image_grid_thw)) if image_grid_thw is not None else []
    videos = list(grid_sequence(video_grid_thw)) if video_grid_thw is not None else []
    return {IMAGE: images, VIDEO: [(1, h, w) for t, h, w in videos for _ in range(t)]}


def get_rope_index(
    input_ids: np.ndarray,
    image_grid_thw,
    image_token_id: int,
    spatial_merge_size: int,
    attention_mask: Optional[np.ndarray] = None,
    mm_token_type_ids: Optional[np.ndarray] = None,
    video_grid_thw=None,
    video_token_id: Optional[int] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Qwen-VL position ids [3, B, L] and rope deltas [B] for a prompt with images or videos.

    Text advances all three axes by one; a run of vision tokens takes the (t, h, w)
    indices of its merged grid offset by the running position, and the next text
    token starts at the running position + max(h, w) / merge. Each temporal patch of
    a video is its own run with t = 1. Token types come from ``mm_token_type_ids``
    (0 text, 1 image, 2 video) when given, else from the image and video token ids.
    """
    input_ids = np.asarray(input_ids)
    B, L = input_ids.shape
    if mm_token_type_ids is not None:
        types = np.asarray(mm_token_type_ids)
    else:
        types = (input_ids == image_token_id).astype(np.int32)
        if video_token_id is not None:
            types[input_ids == video_token_id] = VIDEO
    runs = _grid_runs(image_grid_thw, video_grid_thw)
    taken = {IMAGE: 0, VIDEO: 0}
    m = spatial_merge_size
    position_ids = np.zeros((3, B, L), dtype=np.int32)
    deltas = np.zeros((B,), dtype=np.int64)
    for b in range(B):
        keep = np.asarray(attention_mask[b]).astype(bool) if attention_mask is not None else np.ones(L, dtype=bool)
        row_types = types[b][keep]
        pieces: List[np.ndarray] = []
        pos, i, n = 0, 0, len(row_types)
        while i < n:
            kind = int(row_types[i])
            if kind == 0:
                j = i
                while j < n and row_types[j] == 0:
                    j += 1
                pieces.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
                pos += j - i
                i = j
                continue
            t, h, w = _next_grid(runs, taken, kind)
            gh, gw = h // m, w // m
            count = t * gh * gw
            run = row_types[i : i + count]
            if len(run) != count or not np.all(run == kind):
                raise ValueError(
                    f"{_KIND_NAMES[kind].capitalize()} run {taken[kind] - 1} needs {count} tokens for grid "
                    f"({t}, {h}, {w}) but the prompt has a run of {int(np.sum(run == kind))}"
                )
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            pieces.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos)
            pos += max(gh, gw)
            i += count
        row = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int32)
        position_ids[:, b, keep] = row
        deltas[b] = (int(row.max()) + 1 - n) if n else 0
    for kind, grids in runs.items():
        if taken[kind] < len(grids):
            raise ValueError(
                f"{_GRID_NAMES[kind]} describes {_count_items(kind, grids)} but the prompt has "
                f"{_KIND_NAMES[kind]} tokens for fewer; each {_ITEM_NAMES[kind]} needs its own placeholder"
            )
    return position_ids, deltas


_KIND_NAMES = {IMAGE: "image", VIDEO: "video"}
_ITEM_NAMES = {IMAGE: "image", VIDEO: "video (one block per temporal patch)"}
_GRID_NAMES = {IMAGE: "image_grid_thw", VIDEO: "video_grid_thw"}


def _count_items(kind: int, grids) -> str:
    unit = "image(s)" if kind == IMAGE else "temporal patch(es)"
    return f"{len(grids)} {unit}"


def _next_grid(runs, taken, kind: int) -> Tuple[int, int, int]:
    grids = runs[kind]
    if taken[kind] >= len(grids):
        raise ValueError(
            f"The prompt has more {_KIND_NAMES[kind]} tokens than {_GRID_NAMES[kind]} describes "
            f"({_count_items(kind, grids)}); pass one grid row per {_KIND_NAMES[kind]}"
        )
    taken[kind] += 1
    return grids[taken[kind] - 1]
