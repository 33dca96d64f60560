"""CPU lanes (compass_compat.cpu_lanes): what a user sees is the plain model's output, bit for bit;
the lanes are applied when a checkpoint is loaded on the CPU, and nothing is installed elsewhere."""

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from compass_compat import cpu_lanes
from scripts._lib.parity import case_inputs, prefill
from tests.lib.vendored import vendored


@pytest.fixture
def lanes():
    """Yield a setter ``lanes(count)`` (threshold 0 so tiny layers split); restores after."""
    saved = (cpu_lanes._count, cpu_lanes._min_elements)

    def set_lanes(count: int) -> None:
        cpu_lanes.configure(count, min_weight_elements=0)

    yield set_lanes
    cpu_lanes._count, cpu_lanes._min_elements = saved


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


def _plain(layer, x):
    return layer.as_linear(x) if "Embedding" in type(layer).__name__ else layer(x)


@pytest.mark.parametrize("name", sorted(_layers()))
@pytest.mark.parametrize("shape", [(7,), (2, 5), (1, 1)], ids=["2d", "3d", "decode-step"])
def test_split_linear_is_bit_identical(lanes, name, shape):
    layer = _layers()[name]
    dim = layer["weight"].shape[1] * (32 // layer.bits if hasattr(layer, "bits") else 1)
    dtype = mx.bfloat16 if name.endswith("bf16") else mx.float32
    x = mx.random.normal(shape + (dim,), key=mx.random.key(1)).astype(dtype)
    one, split = _both(lanes, lambda: cpu_lanes.linear(layer, x))
    assert one.shape == shape + (200,)
    assert mx.array_equal(one, split).item(), f"{name}: split differs by {mx.abs(one - split).max().item()}"
    cpu_lanes.configure(2, min_weight_elements=1 << 20)  # the default threshold: unsplit
    assert mx.array_equal(cpu_lanes.linear(layer, x), split).item()
    assert mx.allclose(one, _plain(layer, x), atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("count", [1, 2])
def test_quantized_layer_takes_float32_activations_on_the_cpu(lanes, dtype, count):
    """The decoder's quantized layers compute half-precision activations in float32 (cast back);
    the vision tower's keep the activation dtype."""
    layer = _layers()["quantized_4bit"]
    x = mx.random.normal((1, 3, 128), key=mx.random.key(5)).astype(dtype)
    lanes(count)
    got = cpu_lanes.linear(layer, x)
    assert got.dtype == dtype
    assert mx.array_equal(got, layer(x.astype(mx.float32)).astype(dtype)).item()
    assert mx.array_equal(cpu_lanes.linear(layer, x, float32_quantized=False), layer(x)).item()


@pytest.mark.parametrize("count", [1, 2])
def test_quantized_layer_in_small_chained_pieces_is_bit_identical(lanes, monkeypatch, count):
    """bfloat16 scales with float32 activations: pieces small enough to keep casts in flight low."""
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(512, 128), 64, 4)
    embedding.set_dtype(mx.bfloat16)  # scales and biases, as in a converted bf16 checkpoint
    x = mx.random.normal((3, 128), key=mx.random.key(9))
    whole = embedding.as_linear(x)
    lanes(count)
    monkeypatch.setattr(cpu_lanes, "_MAX_CAST_BYTES", 512 * 2 * 2 * 4 // 8)  # -> 8 pieces in all
    assert mx.array_equal(whole, cpu_lanes.linear(embedding, x)).item()


@pytest.mark.parametrize("mask", [None, "causal", "array"], ids=["no-mask", "causal", "bool-array"])
@pytest.mark.parametrize("length", [1, 9])
def test_split_attention_is_bit_identical(lanes, mask, length):
    q = mx.random.normal((1, 8, length, 16), key=mx.random.key(5))
    k = mx.random.normal((1, 4, 9, 16), key=mx.random.key(6))
    v = mx.random.normal((1, 4, 9, 16), key=mx.random.key(7))
    if mask == "array":
        mask = mx.arange(9)[None] <= mx.arange(9 - length, 9)[:, None]
    one, split = _both(lanes, lambda: cpu_lanes.attention(q, k, v, 0.25, mask))
    assert mx.array_equal(one, split).item()
    plain = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert mx.array_equal(one, plain).item()


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
    assert mx.array_equal(whole, cpu_lanes.attention(q, k, v, 0.25, mask)).item()


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


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("offset", [0, 1001, 70000, "per-row"])
@pytest.mark.parametrize("length", [1, 37])
def test_rope_with_shared_table_is_bit_identical(dtype, offset, length):
    plain = nn.RoPE(128, traditional=False, base=50000.0)
    laned = cpu_lanes.apply(nn.Sequential(nn.RoPE(128, traditional=False, base=50000.0))).layers[0]
    if offset == "per-row":
        offset = mx.array([5, 1001, 70000])  # a batch cache's per-row offsets
    for heads in (4, 2, 6):  # q, k and a merged q|k all reuse the one table
        x = mx.random.normal((3, heads, length, 128), key=mx.random.key(heads)).astype(dtype)
        want, got = plain(x, offset=offset), laned(x, offset=offset)
        assert got.dtype == want.dtype and mx.array_equal(got, want).item()


def test_rope_where_no_table_applies_is_the_plain_rotation():
    x = mx.random.normal((1, 4, 3, 64), key=mx.random.key(4))
    for rope, inp in [
        (nn.RoPE(64, traditional=True, base=1e4), x),  # traditional layout
        (nn.RoPE(32, traditional=False, base=1e4), x),  # partial rotation
        (nn.RoPE(64, traditional=False, base=1e4), x[0]),  # 3-D input
    ]:
        want = rope(inp, offset=5)
        laned = cpu_lanes.apply(nn.Sequential(rope)).layers[0]
        assert mx.array_equal(laned(inp, offset=5), want).item()


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


# ---------------------------------------------------------------- a loaded model, with and without
@pytest.fixture
def ours():
    """The loader guard installs lanes on the vendored package's models: skip where upstream's is live."""
    vendored()


def _laned(model) -> list:
    return [name for name, m in model.named_modules() if getattr(m, cpu_lanes.TAG, False)]


def _outputs(model, reference, case, steps=3):
    """Prefill logits, the next ``steps`` greedy ids and logits, and the picture's encoding."""
    ref = reference(case)
    cache = model.language_model.make_cache()
    logits = [prefill(model, ref, cache)[-1]]
    ids = []
    for _ in range(steps):
        ids.append(int(mx.argmax(logits[-1]).item()))
        logits.append(model.language_model(mx.array([[ids[-1]]]), cache=cache).logits[0, -1])
    out = {"logits": mx.stack(logits), "ids": ids}
    _, pixels, extra = case_inputs(ref)
    if pixels is not None:
        out["encoded"] = model.encode_image(pixels, extra["image_grid_thw"])
    mx.eval(out["logits"], out.get("encoded"))
    return out


@pytest.mark.parametrize("case", ["text_long", "img_two"])
def test_loaded_model_answers_the_same_with_lanes_as_without(lanes, ours, tiny_ckpt_mlx, reference, case):
    """Loaded on the CPU the model has its lanes: logits, greedy ids and encode_image's output are
    the same split over the lanes as unsplit, bit for bit, and the plain model's (the lanes
    removed). The vision tower's float32 projections of 2-D activations take transposed operands
    on the CPU (faster on the reference BLAS), equal to the plain call within float32 rounding."""
    from mlx_vlm.utils import load_model

    lanes(2)  # threshold 0: every layer splits
    model = load_model(tiny_ckpt_mlx)
    assert _laned(model)
    split = _outputs(model, reference, case)
    cpu_lanes.configure(1, min_weight_elements=1 << 20)
    unsplit = _outputs(model, reference, case)
    plain = _outputs(cpu_lanes.remove(model), reference, case)
    assert not _laned(model)
    assert split["ids"] == unsplit["ids"] == plain["ids"]
    for key in ("logits", "encoded"):
        if key in plain:
            assert mx.array_equal(split[key], unsplit[key]).item(), key
            if case.startswith("text"):
                assert mx.array_equal(split[key], plain[key]).item(), key
            assert mx.allclose(split[key], plain[key], atol=1e-5, rtol=1e-5).item(), key
    assert np.abs(np.array(split["logits"][0]) - reference(case)["prefill_logits"][-1]).max() < 1e-4


def test_lanes_applied_to_every_projection_rotary_and_attention_on_cpu_load(ours, tiny_ckpt_mlx):
    from mlx_vlm.utils import load_model

    model = load_model(tiny_ckpt_mlx)
    laned = set(_laned(model))
    expected = {
        name
        for name, m in model.named_modules()
        if type(m).__name__ in ("Linear", "QuantizedLinear", "Embedding", "RoPE", "Attention")
        or name.endswith(("q_proj", "embed_tokens", "self_attn", "attn", ".rope"))
    }
    assert expected and expected <= laned
    assert not any(n == "vision_tower.patch_embed.proj" for n in laned)  # the Conv3d is its own


def test_no_lanes_when_the_default_device_is_not_the_cpu(ours, monkeypatch, tiny_ckpt_mlx):
    """Metal and CUDA loads get the model as mlx-vlm builds it: no lane class anywhere."""
    from mlx_vlm.utils import load_model

    gpu = mx.Device(mx.gpu)
    monkeypatch.setattr(cpu_lanes.mx, "default_device", lambda: gpu)
    model = load_model(tiny_ckpt_mlx)
    monkeypatch.undo()
    assert _laned(model) == []
    assert all(type(m).__module__ != cpu_lanes.__name__ for _, m in model.named_modules())


def test_threads_share_lanes(lanes, ours, tiny_ckpt_mlx, reference):
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
