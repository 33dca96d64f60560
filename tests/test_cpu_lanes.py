"""CPU lanes: a split matmul or attention equals the unsplit call bit for bit."""

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from scripts._lib.parity import prefill
from tests.lib.vendored import vendored

cpu_lanes = vendored("cpu_lanes")


@pytest.fixture
def lanes():
    """Yield a setter ``lanes(count)`` (threshold 0 so tiny layers split); restores after."""
    saved = (cpu_lanes._count, cpu_lanes._min_elements)

    def set_lanes(count: int) -> None:
        cpu_lanes.configure(count, min_weight_elements=0)

    yield set_lanes
    cpu_lanes._count, cpu_lanes._min_elements = saved


PLAIN_ATTENTION = mx.fast.scaled_dot_product_attention


def attention_calls(monkeypatch) -> list:
    """The query shapes of every scaled_dot_product_attention call from here on."""
    calls = []
    monkeypatch.setattr(
        cpu_lanes.mx.fast,
        "scaled_dot_product_attention",
        lambda *a, **kw: calls.append(a[0].shape) or PLAIN_ATTENTION(*a, **kw),
    )
    return calls


def _both(lanes, fn):
    lanes(1)
    one = fn()
    mx.eval(one)
    lanes(3)  # uneven split on purpose: 3 lanes over sizes that do not divide by 3
    split = fn()
    mx.eval(split)
    return one, split


def _layers():
    mx.random.seed(3)
    layers = {
        "linear_bias_bf16": nn.Linear(96, 200, bias=True),
        "linear_fp32": nn.Linear(96, 200, bias=False),
        "linear_bias_fp32": nn.Linear(96, 200, bias=True),
        "embedding_fp32": nn.Embedding(200, 96),
    }
    layers["linear_bias_bf16"].set_dtype(mx.bfloat16)
    q4 = nn.Linear(128, 200, bias=True)
    layers["quantized_4bit"] = nn.QuantizedLinear.from_linear(q4, group_size=64, bits=4)
    q8 = nn.Linear(128, 200, bias=False)
    layers["quantized_8bit"] = nn.QuantizedLinear.from_linear(q8, group_size=32, bits=8)
    layers["quantized_embedding"] = nn.QuantizedEmbedding.from_embedding(nn.Embedding(200, 128), 64, 4)
    return layers


@pytest.mark.parametrize("name", sorted(_layers()))
@pytest.mark.parametrize("shape", [(7,), (2, 5)], ids=["2d", "3d"])
def test_split_linear_is_bit_identical(lanes, name, shape):
    layer = _layers()[name]
    dim = layer["weight"].shape[1] * (32 // layer.bits if hasattr(layer, "bits") else 1)
    dtype = mx.bfloat16 if name.endswith("bf16") else mx.float32
    x = mx.random.normal(shape + (dim,), key=mx.random.key(1)).astype(dtype)
    one, split = _both(lanes, lambda: cpu_lanes.linear(layer, x))
    assert one.shape == shape + (200,)
    assert mx.array_equal(one, split).item(), f"{name}: split differs by {mx.abs(one - split).max().item()}"
    # And the unsplit path is the layer's own call.
    plain = layer.as_linear(x) if "embedding" in name else layer(x)
    assert mx.allclose(one, plain, atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("mask", [None, "causal", "array"], ids=["no-mask", "causal", "bool-array"])
def test_split_attention_is_bit_identical(lanes, mask):
    key = mx.random.key(5)
    q = mx.random.normal((1, 8, 9, 16), key=key)
    k = mx.random.normal((1, 4, 9, 16), key=mx.random.key(6))
    v = mx.random.normal((1, 4, 9, 16), key=mx.random.key(7))
    if mask == "array":
        mask = mx.tril(mx.ones((9, 9), dtype=mx.bool_))
    one, split = _both(lanes, lambda: cpu_lanes.attention(q, k, v, 0.25, mask))
    assert mx.array_equal(one, split).item()
    assert mx.allclose(one, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)).item()


def _attention_inputs(hq, hkv, length, keys, dim, dtype, batch=2):
    q = mx.random.normal((batch, hq, length, dim), key=mx.random.key(11)).astype(dtype)
    k = mx.random.normal((batch, hkv, keys, dim), key=mx.random.key(12)).astype(dtype)
    v = mx.random.normal((batch, hkv, keys, dim), key=mx.random.key(13)).astype(dtype)
    return q, k, v


_MASKS = {
    "none": lambda L, S: None,
    # Causal over the last L of S keys, as the decoder builds it with a cache.
    "causal-2d": lambda L, S: mx.arange(S)[None] <= mx.arange(S - L, S)[:, None],
    "window-4d": lambda L, S: (
        (mx.arange(S)[None] <= mx.arange(S - L, S)[:, None]) & (mx.arange(S)[None] > mx.arange(S - L, S)[:, None] - 37)
    )[None, None],
    # Padding only: one row broadcast over every query.
    "padding": lambda L, S: (mx.arange(S) >= 5)[None, None, None, :],
    "per-head-additive": lambda L, S: mx.random.normal((1, 8, L, S), key=mx.random.key(14)),
}


@pytest.mark.parametrize("mask_kind", sorted(_MASKS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("count", [1, 3])
def test_attention_in_query_blocks_is_bit_identical(lanes, monkeypatch, mask_kind, dtype, count):
    q, k, v = _attention_inputs(8, 4, 100, 130, 16, dtype)
    mask = _MASKS[mask_kind](100, 130)
    if mask is not None and mask.dtype != mx.bool_:
        mask = mask.astype(dtype)  # an additive mask must match the activations
    whole = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    lanes(count)
    monkeypatch.setattr(cpu_lanes, "_MAX_SCORE_BYTES", 1)  # the smallest blocks: 32 rows
    calls = attention_calls(monkeypatch)
    blocked = cpu_lanes.attention(q, k, v, 0.25, mask)
    mx.eval(blocked)
    # 100 queries -> 4 blocks (32, 32, 32, 4) per head group.
    assert sorted({shape[2] for shape in calls}) == [4, 32]
    assert mx.array_equal(whole, blocked).item()


def test_attention_blocks_bound_peak_memory(lanes, monkeypatch):
    """The scores of all blocks never exist at once (MLX queues ~10 ops ahead of its kernels)."""
    q, k, v = _attention_inputs(16, 16, 1536, 1536, 16, mx.float32, batch=1)
    mx.eval(q, k, v)
    scores = 16 * 1536 * 1536 * 4  # heads x queries x keys, float32: 144 MiB

    def peak(budget):
        monkeypatch.setattr(cpu_lanes, "_MAX_SCORE_BYTES", budget)
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = cpu_lanes.attention(q, k, v, 0.25)
        mx.eval(out)
        return mx.get_peak_memory() - base

    for count in (1, 2):
        lanes(count)
        whole = peak(1 << 40)
        blocked = peak(1)  # 32-row blocks of 3 MiB (one lane) or 1.5 MiB (two)
        assert whole >= scores, (count, whole)
        assert blocked < scores // 3, (count, blocked)


@pytest.mark.parametrize("case", ["text_long", "img_two"])
def test_split_model_logits_equal_unsplit_and_reference(lanes, tiny_ckpt_mlx, reference, case):
    from mlx_vlm.utils import load_model

    model = load_model(tiny_ckpt_mlx)
    ref = reference(case)
    one, split = _both(lanes, lambda: prefill(model, ref))
    assert mx.array_equal(one, split).item()
    assert np.abs(np.array(split) - ref["prefill_logits"]).max() < 1e-4


def test_threads_share_lanes(lanes, tiny_ckpt_mlx, reference):
    from mlx_vlm.utils import load_model

    ref = reference("img_448")
    lanes(2)
    expected = np.array(prefill(load_model(tiny_ckpt_mlx), ref))
    results, errors = {}, []

    def run(i):
        # MLX arrays belong to the thread's streams: each thread loads its own model.
        try:
            results[i] = np.array(prefill(load_model(tiny_ckpt_mlx), ref))
        except Exception as exc:  # reported below with the thread number
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i in range(4):
        np.testing.assert_array_equal(results[i], expected)


def test_lane_count_from_environment(monkeypatch, lanes):
    monkeypatch.setenv(cpu_lanes.LANES_ENV, "1")
    assert cpu_lanes.configure() == 1
    assert cpu_lanes.lanes(1 << 30) == ()
    monkeypatch.setenv(cpu_lanes.LANES_ENV, "2")
    assert cpu_lanes.configure() == 2
    assert len(cpu_lanes.lanes(1 << 30)) == 2
    for bad in ("zero", "0", "-2"):
        monkeypatch.setenv(cpu_lanes.LANES_ENV, bad)
        with pytest.raises(ValueError, match=cpu_lanes.LANES_ENV):
            cpu_lanes.configure()
    with pytest.raises(ValueError, match="1 or more"):
        cpu_lanes.configure(0)


def test_small_layers_are_not_split(lanes):
    cpu_lanes.configure(2, min_weight_elements=1 << 20)
    assert cpu_lanes.lanes((1 << 20) - 1) == ()
    assert len(cpu_lanes.lanes(1 << 20)) == 2


@pytest.mark.parametrize("count", [1, 2])
def test_quantized_layer_in_small_chained_pieces_is_bit_identical(lanes, monkeypatch, count):
    """bfloat16 scales with float32 activations: pieces small enough to keep casts in flight low."""
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(512, 128), 64, 4)
    embedding.set_dtype(mx.bfloat16)  # scales and biases, as in a converted bf16 checkpoint
    assert embedding["scales"].dtype == mx.bfloat16
    x = mx.random.normal((3, 128), key=mx.random.key(9))
    whole = embedding.as_linear(x)
    lanes(count)
    monkeypatch.setattr(cpu_lanes, "_MAX_CAST_BYTES", 512 * 2 * 2 * 4 // 8)  # -> 8 pieces in all
    calls = []
    original = mx.quantized_matmul
    monkeypatch.setattr(cpu_lanes.mx, "quantized_matmul", lambda *a, **k: calls.append(1) or original(*a, **k))
    split = cpu_lanes.linear(embedding, x)
    mx.eval(split)
    assert len(calls) == 8
    assert mx.array_equal(whole, split).item()


# ---------------------------------------------------------------- the unsplit path is the plain call
def _graph(*outputs) -> str:
    """The graph of ``outputs`` as ``mx.export_to_dot`` writes it, node ids renumbered in order
    of appearance (arrays are already lettered in order): equal strings, equal graphs."""
    import os
    import re
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *outputs)
        with open(path) as f:
            text = f.read()
    finally:
        os.unlink(path)
    ids = {}
    return re.sub(r"\b\d{6,}\b", lambda m: str(ids.setdefault(m.group(0), len(ids))), text)


def _plain(layer, x):
    return layer.as_linear(x) if "embedding" in type(layer).__name__.lower() else layer(x)


@pytest.fixture
def no_pieces(monkeypatch):
    """Fail if ``linear`` cuts a layer into row pieces (``_rows``); yields the calls made."""
    calls = []
    original = cpu_lanes._rows
    monkeypatch.setattr(
        cpu_lanes, "_rows", lambda layer, x, a, b, after=None: calls.append((a, b)) or original(layer, x, a, b, after)
    )
    return calls


@pytest.mark.parametrize("name", sorted(_layers()))
@pytest.mark.parametrize("count", [1, 2])
def test_small_layer_is_the_plain_call(lanes, no_pieces, name, count):
    """Below the threshold (or with one lane) a decoder projection is ``layer(x)``: the same graph,
    no row pieces, and the same bits as the split result."""
    layer = _layers()[name]
    dim = layer["weight"].shape[1] * (32 // layer.bits if hasattr(layer, "bits") else 1)
    dtype = mx.bfloat16 if name.endswith("bf16") else mx.float32
    x = mx.random.normal((1, 1, dim), key=mx.random.key(2)).astype(dtype)  # a decode step's [B, L, D]
    lanes(3)
    split = cpu_lanes.linear(layer, x)
    mx.eval(split)
    assert len(no_pieces) == 3
    no_pieces.clear()
    cpu_lanes.configure(count, min_weight_elements=1 << 20)
    small = cpu_lanes.linear(layer, x)
    assert _graph(small) == _graph(_plain(layer, x))
    assert no_pieces == []
    assert mx.array_equal(small, split).item()
    # With a cast, only the cast is added.
    cast = cpu_lanes.linear(layer, x, out_dtype=mx.float16)
    assert _graph(cast) == _graph(_plain(layer, x).astype(mx.float16))


def test_large_layer_with_one_lane_is_the_plain_call(lanes, no_pieces):
    layer = nn.Linear(1024, 1024, bias=False)  # exactly the default threshold (2^20 elements)
    x = mx.random.normal((1, 1, 1024), key=mx.random.key(4))
    cpu_lanes.configure(2, min_weight_elements=1 << 20)
    split = cpu_lanes.linear(layer, x)
    mx.eval(split)
    assert len(no_pieces) == 2
    no_pieces.clear()
    cpu_lanes.configure(1, min_weight_elements=1 << 20)
    whole = cpu_lanes.linear(layer, x)
    assert no_pieces == [] and _graph(whole) == _graph(layer(x))
    assert mx.array_equal(whole, split).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_quantized_layer_takes_float32_activations_on_the_cpu(lanes, dtype):
    """The float32 rule lives in ``linear``: half-precision activations of a quantized layer go
    through ``quantized_matmul`` in float32, the result cast back; opted out, the plain call."""
    layer = _layers()["quantized_4bit"]
    x = mx.random.normal((1, 3, 128), key=mx.random.key(5)).astype(dtype)
    lanes(1)
    got = cpu_lanes.linear(layer, x)
    assert got.dtype == dtype
    assert _graph(got) == _graph(layer(x.astype(mx.float32)).astype(dtype))
    assert _graph(cpu_lanes.linear(layer, x, float32_quantized=False)) == _graph(layer(x))


def test_float32_2d_activations_keep_the_transposed_operands(lanes, no_pieces):
    """Vision-tower shape ([N, D], float32 weights): one piece over all rows, as before."""
    layer = nn.Linear(96, 200, bias=True)
    x = mx.random.normal((7, 96), key=mx.random.key(1))
    cpu_lanes.configure(2, min_weight_elements=1 << 20)
    whole = cpu_lanes.linear(layer, x)
    assert no_pieces == [(0, 200)]
    lanes(3)
    assert mx.array_equal(whole, cpu_lanes.linear(layer, x)).item()


def test_decode_attention_is_one_plain_call(lanes, monkeypatch):
    q, k, v = _attention_inputs(8, 4, 1, 40, 16, mx.float32, batch=1)
    calls = attention_calls(monkeypatch)
    lanes(2)  # threshold 0: split over the lanes by KV-head groups
    split = cpu_lanes.attention(q, k, v, 0.25, None)
    assert calls == [(1, 4, 1, 16), (1, 4, 1, 16)]
    calls.clear()
    for count in (1, 2):
        cpu_lanes.configure(count, min_weight_elements=1 << 20)
        out = cpu_lanes.attention(q, k, v, 0.25, None)
        assert calls == [(1, 8, 1, 16)]
        calls.clear()
        assert _graph(out) == _graph(PLAIN_ATTENTION(q, k, v, scale=0.25, mask=None))
        assert mx.array_equal(out, split).item()


def _decode_logits(model, ref, steps=3):
    cache = model.language_model.make_cache()
    logits = [prefill(model, ref, cache)[-1]]
    for token in ref["greedy_ids"][: steps - 1]:
        logits.append(model.language_model(mx.array([[int(token)]]), cache=cache).logits[0, -1])
    out = mx.stack(logits)
    mx.eval(out)
    return out


@pytest.mark.parametrize("count", [1, 2])
def test_tiny_model_decode_takes_the_plain_path(lanes, no_pieces, tiny_ckpt_mlx, reference, count):
    """Default threshold: every tiny-model layer is the plain call, bit-identical to all split."""
    from mlx_vlm.utils import load_model

    model = load_model(tiny_ckpt_mlx)
    ref = reference("text_long")
    lanes(2)
    split = _decode_logits(model, ref)
    assert no_pieces
    no_pieces.clear()
    cpu_lanes.configure(count, min_weight_elements=1 << 20)
    plain = _decode_logits(model, ref)
    assert no_pieces == []
    assert mx.array_equal(plain, split).item()


def test_off_the_cpu_the_dispatch_adds_no_op(lanes, monkeypatch, tiny_ckpt_mlx):
    """With MLX's default device reported as the GPU, the decoder's graph (a 3-token chunk and a
    decode step, every layer and the head) is exactly the graph of the same model with
    ``cpu_lanes`` replaced by the plain calls (``layer(x)``, ``as_linear`` for the tied head,
    ``mx.fast.scaled_dot_product_attention``), which is what upstream's layers call. The graph is
    still built on the CPU stream; only the Python branches see another device."""
    from mlx_vlm.utils import load_model

    lm = load_model(tiny_ckpt_mlx).language_model
    lanes(2)  # threshold 0: on the CPU, everything would split

    def graphs():
        cache = lm.make_cache()
        mx.eval(lm(mx.array([[5, 6, 7, 8]]), cache=cache).logits)
        mx.eval([c.state for c in cache])
        chunk = lm(mx.array([[9, 10, 11]]), cache=cache).logits
        out = [_graph(chunk)]
        mx.eval(chunk)
        mx.eval([c.state for c in cache])
        return out + [_graph(lm(mx.array([[12]]), cache=cache).logits)]

    gpu = mx.Device(mx.gpu)
    monkeypatch.setattr(mx, "default_device", lambda: gpu)
    dispatched = graphs()
    monkeypatch.setattr(cpu_lanes, "linear", lambda layer, x, out_dtype=None: _plain(layer, x))
    monkeypatch.setattr(
        cpu_lanes,
        "attention",
        lambda q, k, v, scale, mask=None: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
    )
    assert graphs() == dispatched


# ---------------------------------------------------------------- rope with one table per forward
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("offset", [0, 1001, 70000, "per-row"])
@pytest.mark.parametrize("length", [1, 37])
def test_rope_with_shared_table_is_bit_identical(dtype, offset, length):
    rope = nn.RoPE(128, traditional=False, base=50000.0)
    if offset == "per-row":
        offset = mx.array([5, 1001, 70000])  # a batch cache's per-row offsets
    tables = {}
    for heads in (4, 2, 6):  # q, k, and a merged q|k all reuse the one table
        x = mx.random.normal((3, heads, length, 128), key=mx.random.key(heads)).astype(dtype)
        plain = rope(x, offset=offset)
        shared = cpu_lanes.rope(rope, x, offset, tables)
        assert shared.dtype == plain.dtype and mx.array_equal(shared, plain).item()
    assert len({k[:7] for k in tables}) == 1  # one table (plus its broadcasts per shape)


def test_rope_table_made_once_per_forward(monkeypatch):
    ropes = [nn.RoPE(64, traditional=False, base=20000.0) for _ in range(3)]  # one per layer, equal
    calls = []
    original = mx.fast.rope
    monkeypatch.setattr(cpu_lanes.mx.fast, "rope", lambda x, *a, **kw: calls.append(x.shape) or original(x, *a, **kw))
    tables = {}
    x = mx.random.normal((1, 4, 1, 64), key=mx.random.key(3))
    outs = [cpu_lanes.rope(r, x, 9, tables) for r in ropes]
    assert calls == [(1, 1, 1, 64)]  # the probe only
    for out in outs:
        assert mx.array_equal(out, original(x, 64, traditional=False, base=20000.0, scale=1.0, offset=9)).item()


def test_rope_plain_call_where_no_table_applies(monkeypatch):
    x = mx.random.normal((1, 4, 3, 64), key=mx.random.key(4))
    cases = [
        (nn.RoPE(64, traditional=False, base=1e4), x, None),  # no tables given
        (nn.RoPE(64, traditional=True, base=1e4), x, {}),  # traditional layout
        (nn.RoPE(32, traditional=False, base=1e4), x, {}),  # partial rotation
        (nn.RoPE(64, traditional=False, base=1e4), x[0], {}),  # 3-D input
    ]
    for rope, inp, tables in cases:
        assert _graph(cpu_lanes.rope(rope, inp, 5, tables)) == _graph(rope(inp, offset=5))
        assert not tables  # None or still empty
    gpu = mx.Device(mx.gpu)
    monkeypatch.setattr(mx, "default_device", lambda: gpu)
    rope, tables = nn.RoPE(64, traditional=False, base=1e4), {}
    assert _graph(cpu_lanes.rope(rope, x, 5, tables)) == _graph(rope(x, offset=5)) and not tables
