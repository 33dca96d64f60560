"""CPU lanes: a loaded cohere_compass model's large matmuls and attention over one CPU stream per core.

:func:`apply` (the loader guard, on the CPU device only) gives the projections, rotaries and
attention modules lane subclasses that split the work by output rows (attention: KV-head groups,
then query blocks), bit-identical to the unsplit call; why and what it measures: docs/features.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

LANES_ENV = "COMPASS_COMPAT_CPU_LANES"
TAG = "compass_cpu_lanes"  # set on every lane class; ``_lanes_base`` is the module's own class
# Below this many weight elements a split costs more in scheduling than it saves.
_DEFAULT_MIN_ELEMENTS = 1 << 20
# Float32 copies of a quantized layer's scales and biases allowed in flight per lane.
_MAX_CAST_BYTES = 1 << 18
# Attention scores (float32) per block of queries (at least 32 rows): MLX's CPU kernel
# materialises [heads, queries, keys] (606 MiB for one 896x896 image).
_MAX_SCORE_BYTES = 1 << 22
_MAX_DEFAULT_LANES = 8

_lock = threading.Lock()
_count: Optional[int] = None
_min_elements = _DEFAULT_MIN_ELEMENTS
_local = threading.local()  # MLX streams belong to the thread that made them (mlx >= 0.31)
_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)
_EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)
_LINEAR_CALL = nn.Linear.__call__  # to tell when mlx-vlm's AWQ calibration has instrumented it


def _default_count() -> int:
    raw = os.environ.get(LANES_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{LANES_ENV}={raw!r}: expected a whole number of CPU lanes (1 = off)") from None
        if value < 1:
            raise ValueError(f"{LANES_ENV}={raw!r}: expected 1 or more (1 = off)")
        return value
    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), _MAX_DEFAULT_LANES))


def configure(count: Optional[int] = None, min_weight_elements: Optional[int] = None) -> int:
    """Set the number of CPU lanes (1: off; None: the environment's, else the core count) and the
    split threshold; returns the lane count now in force."""
    global _count, _min_elements
    with _lock:
        if count is not None and count < 1:
            raise ValueError(f"count must be 1 or more (1 = off), got {count}")
        _count = _default_count() if count is None else int(count)
        if min_weight_elements is not None:
            _min_elements = max(0, int(min_weight_elements))
        return _count


def lanes(weight_elements: int) -> Sequence[mx.Stream]:
    """The CPU streams to split a computation over, or ``()`` to run it unsplit."""
    if _count is None:
        configure()
    if weight_elements < _min_elements or _count < 2 or mx.default_device() != mx.cpu:
        return ()
    streams = _local.__dict__.setdefault("streams", [])
    while len(streams) < _count:
        streams.append(mx.new_stream(mx.cpu))
    return streams[:_count]


def _bounds(total: int, parts: int) -> List[int]:
    # Equal pieces, cut on multiples of 32 rows where the size allows it.
    step = -(-total // parts)
    step = -(-step // 32) * 32 if total >= 32 * parts else step
    return [min(total, i * step) for i in range(parts)] + [total]


def _rows(layer: nn.Module, x: mx.array, a: int, b: int, after: Optional[mx.array] = None) -> mx.array:
    """Output columns ``a:b`` of ``layer`` on ``x`` with the layer's own kernel; ``after``: an
    array a quantized piece's scales wait for (see :func:`linear`)."""
    if isinstance(layer, _QUANTIZED):
        scales, biases = layer["scales"][a:b], layer.get("biases")
        biases = None if biases is None else biases[a:b]
        if after is not None:
            scales, *rest = mx.depends([scales] if biases is None else [scales, biases], [after])
            biases = rest[0] if rest else None
        mode = {"mode": layer.mode} if hasattr(layer, "mode") else {}
        weight, group, bits = layer["weight"][a:b], layer.group_size, layer.bits
        out = mx.quantized_matmul(x, weight, scales=scales, biases=biases, group_size=group, bits=bits, **mode)
        return out + layer["bias"][a:b] if isinstance(layer, nn.QuantizedLinear) and "bias" in layer else out
    weight = layer["weight"][a:b]
    bias = layer["bias"][a:b] if isinstance(layer, nn.Linear) and "bias" in layer else None
    if weight.dtype == mx.float32 and x.ndim == 2:
        # The reference BLAS is ~2x slower with a transposed operand (x @ W.T); W @ x^T keeps
        # both row-contiguous (2.1x less CPU time per full-size vision block).
        x_t = mx.contiguous(x.T)
        return (weight @ x_t if bias is None else mx.addmm(bias[:, None], weight, x_t)).T
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def _plain(layer: nn.Module, x: mx.array) -> mx.array:
    base = getattr(layer, "_lanes_base", type(layer))
    return base.as_linear(layer, x) if issubclass(base, _EMBEDDINGS) else base.__call__(layer, x)


def linear(layer: nn.Module, x: mx.array, float32_quantized: bool = True) -> mx.array:
    """``layer(x)`` (``as_linear`` for embeddings) of an ``nn.Linear`` / ``nn.QuantizedLinear`` /
    ``nn.Embedding`` / ``nn.QuantizedEmbedding``, split over the lanes on the CPU.

    ``float32_quantized``: half-precision activations of a quantized layer run in float32, cast
    back (MLX's CPU ``quantized_matmul`` is 7-9x slower in bfloat16). Unsplit, a layer is its own
    call, except float32 weights with 2-D activations (:func:`_rows`) and quantized layers whose
    scales' float32 copies would be large (the tied 262144-row head: 67 MB), chained in pieces."""
    if mx.default_device() != mx.cpu:
        return _plain(layer, x)
    out_dtype = None
    if float32_quantized and x.dtype in (mx.bfloat16, mx.float16) and isinstance(layer, _QUANTIZED):
        x, out_dtype = x.astype(mx.float32), x.dtype
    # mlx-vlm's AWQ (convert --quant-method awq) records each projection's inputs through
    # nn.Linear.__call__; split pieces never reach it, so while it is instrumented the call is whole.
    if getattr(layer, "_lanes_base", None) is nn.Linear and nn.Linear.__call__ is not _LINEAR_CALL:
        return _plain(layer, x)
    weight, cast_bytes = layer["weight"], 0
    elements = weight.size
    if isinstance(layer, _QUANTIZED):
        elements *= 32 // layer.bits
        scales = layer["scales"]
        cast_bytes = 8 * scales.size if x.dtype == mx.float32 and scales.dtype != mx.float32 else 0
    streams = lanes(elements)
    if not streams and cast_bytes <= _MAX_CAST_BYTES:
        plain = x.ndim != 2 or isinstance(layer, _QUANTIZED) or weight.dtype != mx.float32
        out = _plain(layer, x) if plain else _rows(layer, x, 0, weight.shape[0])
        return out if out_dtype is None else out.astype(out_dtype)
    streams = streams or (None,)
    per_lane = max(1, -(-cast_bytes // (_MAX_CAST_BYTES * len(streams))))
    cuts = _bounds(weight.shape[0], len(streams) * per_lane)
    parts: List[mx.array] = []
    last: List[Optional[mx.array]] = [None] * len(streams)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        if b <= a:
            continue
        lane = i % len(streams)
        with mx.stream(streams[lane]) if streams[lane] is not None else contextlib.nullcontext():
            part = _rows(layer, x, a, b, last[lane] if per_lane > 1 else None)
            last[lane] = part
            parts.append(part if out_dtype is None else part.astype(out_dtype))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _query_rows(row_bytes: int) -> int:
    return max(32, _MAX_SCORE_BYTES // row_bytes // 32 * 32)


def _in_blocks(q: mx.array, rows: int, attend: Callable[[mx.array, Any], mx.array], mask: Any) -> mx.array:
    # MLX allocates an op's output when it queues it, ahead of the kernels: chained, about one
    # block's scores are in flight instead of every block's.
    by_row = isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] != 1
    blocks: List[mx.array] = []
    for r in range(0, q.shape[2], rows):
        qb = q[:, :, r : r + rows]
        if blocks:
            qb = mx.depends([qb], [blocks[-1]])[0]
        blocks.append(attend(qb, mask[..., r : r + rows, :] if by_row else mask))
    return blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=2)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` (q [B, Hq, L, D], k/v [B, Hkv, S, D]), the heads
    split over the lanes in KV-head groups, the queries in blocks of ~``_MAX_SCORE_BYTES`` scores
    (a string mask, "causal", is aligned to the last query: not cut by rows)."""
    sdpa = mx.fast.scaled_dot_product_attention
    if mx.default_device() != mx.cpu:
        return sdpa(q, k, v, scale=scale, mask=mask)
    batch, hq, length, dim = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    per_head_mask = isinstance(mask, mx.array) and mask.ndim >= 3 and mask.shape[-3] != 1
    streams = lanes(length * keys * dim * hq) if hkv > 1 and not per_head_mask else ()
    if length <= 32 and not streams:
        return sdpa(q, k, v, scale=scale, mask=mask)  # decode steps, short chunks: one block
    cuts = _bounds(hkv, min(len(streams), hkv)) if streams else [0, hkv]
    group = hq // hkv
    widest = max(b - a for a, b in zip(cuts, cuts[1:]))
    rows = length if isinstance(mask, str) else _query_rows(batch * widest * group * keys * 4)
    if not streams and rows >= length:
        return sdpa(q, k, v, scale=scale, mask=mask)
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        if b <= a:
            continue
        with mx.stream(streams[i]) if streams else contextlib.nullcontext():
            kv = k[:, a:b], v[:, a:b]
            heads = q[:, a * group : b * group]
            parts.append(_in_blocks(heads, rows, lambda qb, m: sdpa(qb, *kv, scale=scale, mask=m), mask))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def quantized_attention(q: mx.array, attend: Callable[[mx.array, Any], mx.array], mask: Any) -> mx.array:
    """``attend(q, mask)`` over a quantized KV cache (the pin's helper bound to its packed keys and
    values), a long chunk's queries in blocks as :func:`attention` takes them."""
    if mx.default_device() != mx.cpu or q.shape[2] <= 32 or not isinstance(mask, mx.array):
        return attend(q, mask)
    rows = _query_rows(q.shape[0] * q.shape[1] * mask.shape[-1] * 4)
    return attend(q, mask) if rows >= q.shape[2] else _in_blocks(q, rows, attend, mask)


class _Lanes:
    compass_cpu_lanes = True  # TAG: the tag of every lane class (a subclass of the module's own)


class _LaneLinear(_Lanes):
    def __call__(self, x: mx.array) -> mx.array:
        return linear(self, x, self._lanes_float32)


class _LaneEmbedding(_Lanes):
    def as_linear(self, x: mx.array) -> mx.array:
        return linear(self, x, self._lanes_float32)


class _LaneRoPE(_Lanes):
    """``nn.RoPE`` with one cos/sin table per offset and shape (per thread; MLX's CPU rope builds
    ~20 primitives a call): ``mx.fast.rope`` of ones then zeros, exactly cos and sin, bit-identical.
    Traditional layout, partial rotation, other shapes and devices take the plain call."""

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.traditional or x.ndim != 4 or x.shape[-1] != self.dims or mx.default_device() != mx.cpu:
            return nn.RoPE.__call__(self, x, offset)
        memo: Dict[Any, Any] = _local.__dict__.setdefault("rope", {})
        last = memo.get("offset")
        if last is not offset and not (type(offset) is int and type(last) is int and last == offset):
            memo.clear()
            memo["offset"] = offset
        batch = x.shape[0] if isinstance(offset, mx.array) and offset.size > 1 else 1
        length, half = x.shape[2], self.dims // 2
        key = (self.dims, self.base, self.scale, batch, length, x.dtype)
        if key not in memo:
            probe = mx.concatenate([mx.ones((half,), x.dtype), mx.zeros((half,), x.dtype)])
            both = nn.RoPE.__call__(self, mx.broadcast_to(probe, (batch, 1, length, self.dims)), offset)
            memo[key] = (both[..., :half], both[..., half:])
        x1, x2 = x[..., :half], x[..., half:]
        # Broadcast once per shape too: each multiply would otherwise add its own broadcast.
        if key + x1.shape not in memo:
            memo[key + x1.shape] = tuple(mx.broadcast_to(t, x1.shape) for t in memo[key])
        cos, sin = memo[key + x1.shape]
        return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class _LaneAttention(_Lanes):
    """The model's ``attend`` through :func:`attention` (a quantized cache's packed keys: blocks)."""

    def attend(self, q: mx.array, k: Any, v: Any, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(k, mx.array):
            return attention(q, k, v, self.scale, mask)
        return quantized_attention(q, lambda qb, m: self._lanes_base.attend(self, qb, k, v, m, cache), mask)


_MIXINS = {nn.Linear: _LaneLinear, nn.QuantizedLinear: _LaneLinear, nn.RoPE: _LaneRoPE}
_MIXINS.update({kind: _LaneEmbedding for kind in _EMBEDDINGS})


@functools.lru_cache(maxsize=None)
def _lane_class(base: type, mixin: type, float32_quantized: bool) -> type:
    attrs = {"_lanes_base": base, "_lanes_float32": float32_quantized, "__module__": __name__}
    return type(f"Lanes{base.__name__}", (mixin, base), attrs)


def apply(model: nn.Module) -> nn.Module:
    """On the CPU device, give ``model``'s exact ``nn.Linear`` / ``nn.QuantizedLinear`` /
    embeddings (their ``as_linear``), ``nn.RoPE`` and attention modules (a class with ``attend``)
    their lane class, in place (parameters, names and ``isinstance`` unchanged); elsewhere nothing.
    The vision tower's quantized layers keep the activation dtype (the float32 rule is the
    decoder's). Idempotent; :func:`remove` undoes it."""
    if mx.default_device() != mx.cpu:
        return model
    for name, module in model.named_modules():
        kind = type(module)
        mixin = _MIXINS.get(kind, _LaneAttention if callable(getattr(kind, "attend", None)) else None)
        if mixin is not None and not getattr(module, TAG, False):
            module.__class__ = _lane_class(type(module), mixin, not name.startswith("vision_tower"))
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every lane module gets its own class back."""
    for _, module in model.named_modules():
        if getattr(module, TAG, False):
            module.__class__ = module._lanes_base
    return model
