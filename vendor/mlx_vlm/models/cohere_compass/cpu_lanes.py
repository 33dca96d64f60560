"""Large matmuls and attention spread over several CPU streams (compass-compat, CPU only).

MLX's CPU backend runs every stream on one thread, and its Linux wheels link the
single-threaded reference BLAS, so one matmul uses one core however many the
machine has. Splitting a layer's output rows (or attention heads) over one CPU
stream per core runs the pieces in parallel; every output element is computed
by the same kernel over the same inputs, so results are bit-identical to the
unsplit call (tests/test_cpu_lanes.py). Measured on a 2-core x86-64 machine,
mlx 0.32.4: a bfloat16 2048->6144 projection 10.0 -> 5.8 ms for one token and
590 -> 290 ms for 128 tokens. Attention also takes its queries in blocks on the
CPU, whatever the lane count, so the scores it materialises stay small. Layers that
are not split are the layer's own call (the graph upstream builds), and ``rope``
shares one cos/sin table per forward pass: on a small model a decode step's cost
is the number of primitives MLX schedules and the Python that builds them.

Chosen by device: only when MLX's default device is the CPU. Metal/CUDA take the
plain layer call. The lane count defaults to the cores this process may use on
Linux and to 1 elsewhere (macOS CPU BLAS is already multi-threaded);
``COMPASS_COMPAT_CPU_LANES`` or :func:`configure` overrides it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

LANES_ENV = "COMPASS_COMPAT_CPU_LANES"
# Below this many weight elements a split costs more in scheduling than it saves.
_DEFAULT_MIN_ELEMENTS = 1 << 20
# Float32 copies of a quantized layer's scales and biases allowed in flight per lane.
_MAX_CAST_BYTES = 1 << 18
# Attention scores (float32) per block of queries (at least 32 rows); see ``attention``.
_MAX_SCORE_BYTES = 1 << 22
_MAX_DEFAULT_LANES = 8

_lock = threading.Lock()
_count: Optional[int] = None
_min_elements = _DEFAULT_MIN_ELEMENTS
# MLX streams belong to the thread that made them (mlx >= 0.31), so each thread gets its own.
_local = threading.local()


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
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_DEFAULT_LANES))


def configure(count: Optional[int] = None, min_weight_elements: Optional[int] = None) -> int:
    """Set the number of CPU lanes (1 turns splitting off) and the split threshold.

    ``count=None`` re-reads the default (environment, then core count). Returns the
    lane count now in force. Affects only computations on the CPU device.
    """
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
    if weight_elements < _min_elements or mx.default_device() != mx.cpu:
        return ()
    if _count is None:
        configure()
    if _count < 2:
        return ()
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = []
    while len(streams) < _count:
        streams.append(mx.new_stream(mx.cpu))
    return streams[:_count]


def _bounds(total: int, parts: int) -> List[int]:
    # Equal pieces, cut on multiples of 32 rows where the size allows it.
    step = -(-total // parts)
    step = -(-step // 32) * 32 if total >= 32 * parts else step
    return [min(total, i * step) for i in range(parts)] + [total]


def _rows(layer: nn.Module, x: mx.array, a: int, b: int, after: Optional[mx.array] = None) -> mx.array:
    """Output columns ``a:b`` of ``layer`` applied to ``x``, with the layer's own kernel.

    ``after``: for quantized layers, an array the piece's scales wait for (see ``linear``).
    """
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        scales = layer["scales"][a:b]
        biases = layer.get("biases")
        biases = None if biases is None else biases[a:b]
        if after is not None:
            scales, biases = (
                mx.depends([scales, biases], [after])
                if biases is not None
                else (mx.depends([scales], [after])[0], None)
            )
        kwargs = {"mode": layer.mode} if hasattr(layer, "mode") else {}
        out = mx.quantized_matmul(
            x,
            layer["weight"][a:b],
            scales=scales,
            biases=biases,
            transpose=True,
            group_size=layer.group_size,
            bits=layer.bits,
            **kwargs,
        )
        if isinstance(layer, nn.QuantizedLinear) and "bias" in layer:
            out = out + layer["bias"][a:b]
        return out
    weight = layer["weight"][a:b]
    bias = layer["bias"][a:b] if isinstance(layer, nn.Linear) and "bias" in layer else None
    if weight.dtype == mx.float32 and x.ndim == 2:
        # Reference BLAS is ~2x slower with a transposed operand (x @ W.T); W @ x^T keeps
        # both operands row-contiguous (2.1x less CPU time per full-size vision block).
        x_t = mx.contiguous(x.T)
        return (weight @ x_t if bias is None else mx.addmm(bias[:, None], weight, x_t)).T
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


_SPLITTABLE = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
_EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)
_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)
# nn.Linear's own call, to tell when a caller has instrumented it (mlx-vlm's AWQ calibration).
_LINEAR_CALL = nn.Linear.__call__


def _whole(layer: nn.Module, x: mx.array) -> mx.array:
    if isinstance(layer, (nn.Embedding, nn.QuantizedEmbedding)):
        return layer.as_linear(x)
    return layer(x)


def linear(
    layer: nn.Module, x: mx.array, out_dtype: Optional[mx.Dtype] = None, float32_quantized: bool = True
) -> mx.array:
    """``layer(x)`` (``as_linear`` for embeddings), arranged for MLX's CPU backend.

    The one way the model's projections reach a layer. Handles ``nn.Linear``,
    ``nn.QuantizedLinear``, ``nn.Embedding`` and ``nn.QuantizedEmbedding``; other
    modules, and every module off the CPU, are called as is. ``out_dtype``: cast the
    result (piece by piece, so the uncast whole never exists).

    ``float32_quantized``: on the CPU a quantized layer given bfloat16 / float16
    activations runs in float32, the result cast back (to ``out_dtype`` if given).
    # compass-compat: MLX's CPU ``quantized_matmul`` is 7-9x slower with bfloat16 or float16
    # activations than with float32 (measured on mlx 0.32, x86-64: a 4-bit 6144x2048 layer
    # takes 254 ms for one bfloat16 token, 36 ms in float32); the graph around it keeps the
    # model dtype (KV cache, residual). Metal/CUDA and unquantized layers are unchanged.

    A layer that is not split (below the threshold, or one lane) is the layer's own
    call, the ops upstream's model builds, with two CPU exceptions that are what this
    function has always returned: float32 weights with 2-D activations (transposed
    operands, see ``_rows``) and quantized layers whose scales/biases would be cast
    to float32 in one large piece (chained pieces, below).
    """
    if (
        float32_quantized
        and x.dtype in (mx.bfloat16, mx.float16)
        and isinstance(layer, _QUANTIZED)
        and mx.default_device() == mx.cpu
    ):
        x, out_dtype = x.astype(mx.float32), x.dtype if out_dtype is None else out_dtype
    kind = type(layer)
    # compass-compat: mlx-vlm's AWQ (convert --quant-method awq) records each projection's inputs
    # by replacing nn.Linear.__call__; split pieces never reach it, so AWQ would fall back to
    # plain rounding without a word. While instrumented, float layers are called whole.
    if kind is nn.Linear and nn.Linear.__call__ is not _LINEAR_CALL:
        return layer(x) if out_dtype is None else layer(x).astype(out_dtype)
    if kind not in _SPLITTABLE or mx.default_device() != mx.cpu:
        out = _whole(layer, x)
        return out if out_dtype is None else out.astype(out_dtype)
    if _count is None:
        configure()
    weight = layer["weight"]
    quantized = kind in _QUANTIZED
    if quantized:
        elements = weight.size * (32 // layer.bits)
        # quantized_matmul casts the piece's scales and biases to float32 first; for the tied
        # head (262144 rows) that is 67 MB at once. Small pieces, each lane's waiting for its
        # previous one, keep the casts in flight to a few MB at unchanged speed.
        scales = layer["scales"]
        cast_bytes = 8 * scales.size if x.dtype == mx.float32 and scales.dtype != mx.float32 else 0
    else:
        elements, cast_bytes = weight.size, 0
    if (_count < 2 or elements < _min_elements) and cast_bytes <= _MAX_CAST_BYTES:
        # Unsplit: the plain call (no slices, no lane bookkeeping).
        if x.ndim != 2 or quantized or weight.dtype != mx.float32:
            out = layer.as_linear(x) if kind in _EMBEDDINGS else layer(x)
        else:
            out = _rows(layer, x, 0, weight.shape[0])
        return out if out_dtype is None else out.astype(out_dtype)
    streams = lanes(elements) or (None,)
    pieces = len(streams)
    per_lane = max(1, -(-cast_bytes // (_MAX_CAST_BYTES * pieces)))
    chained = per_lane > 1
    pieces *= per_lane
    cuts = _bounds(weight.shape[0], pieces)
    parts: List[mx.array] = []
    last = [None] * len(streams)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        if b <= a:
            continue
        lane = i % len(streams)
        stream = streams[lane]
        after = last[lane] if chained else None
        if stream is None:
            part = _rows(layer, x, a, b, after)
        else:
            with mx.stream(stream):
                part = _rows(layer, x, a, b, after)
        last[lane] = part
        parts.append(part if out_dtype is None else part.astype(out_dtype, stream=stream))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def rope(rope: nn.Module, x: mx.array, offset, tables: Optional[dict] = None) -> mx.array:
    """``rope(x, offset=offset)`` for an ``nn.RoPE``, arranged for MLX's CPU backend.

    MLX has no CPU rope kernel: each ``mx.fast.rope`` call is built from ~20 primitives, its
    cos/sin table included, which on a small model is a large share of a decode step. With
    ``tables`` (a dict the caller keeps for one forward pass, i.e. one offset) the table is
    made once per (dims, base, scale, length, dtype) and every call adds only the rotation
    (``x1*cos - x2*sin``, ``x1*sin + x2*cos``). The table is ``mx.fast.rope`` itself applied
    to a probe (ones, then zeros: exactly cos and sin), so results are bit-identical to the
    plain call (tests/test_cpu_lanes.py). Off the CPU, without ``tables``, for other rope
    classes, traditional layout or partial rotation, it is the plain call.
    """
    if (
        tables is None
        or type(rope) is not nn.RoPE
        or rope.traditional
        or x.ndim != 4
        or x.shape[-1] != rope.dims
        or mx.default_device() != mx.cpu
    ):
        return rope(x, offset=offset)
    batch = x.shape[0] if isinstance(offset, mx.array) and offset.size > 1 else 1
    length, half = x.shape[2], rope.dims // 2
    key = ("cpu_lanes.rope", rope.dims, rope.base, rope.scale, batch, length, x.dtype)
    table = tables.get(key)
    if table is None:
        probe = mx.broadcast_to(
            mx.concatenate([mx.ones((half,), x.dtype), mx.zeros((half,), x.dtype)]),
            (batch, 1, length, rope.dims),
        )
        both = rope(probe, offset=offset)
        table = tables[key] = (both[..., :half], both[..., half:])
    x1, x2 = x[..., :half], x[..., half:]
    # Broadcast once per shape too: each multiply would otherwise add its own broadcast nodes.
    shaped = tables.get(key + x1.shape)
    if shaped is None:
        shaped = tables[key + x1.shape] = tuple(mx.broadcast_to(t, x1.shape) for t in table)
    cos, sin = shaped
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``, arranged for MLX's CPU backend.

    q is [B, Hq, L, D], k/v [B, Hkv, S, D]. On the CPU, heads are split over the
    lanes (whole KV-head groups, so grouped-query attention stays grouped) and
    each lane takes its queries in blocks: the CPU kernel materialises the
    [heads, queries, keys] scores, 630 MB for one 896x896 image, and a block
    holds about ``_MAX_SCORE_BYTES`` of them (at least 32 rows). Rows are
    independent, so the result is bit-identical to the whole call. ``mask`` is
    None, a string, or an array broadcastable to [B, Hq, L, S].
    """
    if mx.default_device() != mx.cpu:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    batch, hq, length, _ = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    if _count is None:
        configure()
    if length <= 32 and (_count < 2 or hkv < 2 or length * keys * q.shape[3] * hq < _min_elements):
        # Unsplit and a single block (blocks hold at least 32 rows): decode steps, short chunks.
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    arr = isinstance(mask, mx.array)
    per_head_mask = arr and mask.ndim >= 3 and mask.shape[-3] != 1
    streams = lanes(length * keys * q.shape[3] * hq) if hkv > 1 and not per_head_mask else ()
    cuts = _bounds(hkv, min(len(streams), hkv)) if streams else [0, hkv]
    group = hq // hkv
    # A string mask ("causal") is aligned to the last query, so it cannot be cut by rows.
    rows = length
    if not isinstance(mask, str):
        row_bytes = batch * max(b - a for a, b in zip(cuts, cuts[1:])) * group * keys * 4
        rows = max(32, _MAX_SCORE_BYTES // row_bytes // 32 * 32)
    if not streams and rows >= length:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    by_row = arr and mask.ndim >= 2 and mask.shape[-2] != 1
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        if b <= a:
            continue
        with mx.stream(streams[i]) if streams else contextlib.nullcontext():
            blocks: List[mx.array] = []
            for r in range(0, length, rows):
                qb = q[:, a * group : b * group, r : r + rows]
                if blocks:
                    # MLX allocates an op's output when it queues the op, ahead of the
                    # kernels; unchained, every block's scores were allocated at once
                    # (measured), chained about ten.
                    qb = mx.depends([qb], [blocks[-1]])[0]
                blocks.append(
                    mx.fast.scaled_dot_product_attention(
                        qb,
                        k[:, a:b],
                        v[:, a:b],
                        scale=scale,
                        mask=mask[..., r : r + rows, :] if by_row else mask,
                    )
                )
            parts.append(blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=2))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def quantized_attention(q: mx.array, attend: Callable[..., mx.array], scale: float, mask=None) -> mx.array:
    """``attend(q, scale=scale, mask=mask)`` over a quantized KV cache, arranged for the CPU.

    ``attend`` is the pin's attention helper bound to the cache and its packed keys and values.
    Off the CPU, and for short query runs, it is the plain call. On the CPU a long chunk (a
    prefill after the cache was quantized) takes its queries in blocks of rows, as
    :func:`attention` does, so the float32 scores the helper materialises stay near
    ``_MAX_SCORE_BYTES``; rows are independent, so the blocks give the whole call's rows.
    ``mask``: None or an array broadcastable to [B, Hq, L, S] (a string mask is aligned to the
    last query and cannot be cut by rows).
    """
    length = q.shape[2]
    if mx.default_device() != mx.cpu or length <= 32 or not isinstance(mask, mx.array):
        return attend(q, scale=scale, mask=mask)
    row_bytes = q.shape[0] * q.shape[1] * mask.shape[-1] * 4
    rows = max(32, _MAX_SCORE_BYTES // row_bytes // 32 * 32)
    if rows >= length:
        return attend(q, scale=scale, mask=mask)
    by_row = mask.ndim >= 2 and mask.shape[-2] != 1
    blocks: List[mx.array] = []
    for r in range(0, length, rows):
        qb = q[:, :, r : r + rows]
        if blocks:
            qb = mx.depends([qb], [blocks[-1]])[0]  # one block's scores in flight at a time
        blocks.append(attend(qb, scale=scale, mask=mask[..., r : r + rows, :] if by_row else mask))
    return mx.concatenate(blocks, axis=2)
