"""Rotation and masking units, checked against exact arithmetic."""

import mlx.core as mx
import numpy as np
import pytest

from compass_data import tiny
from tests.support.vendored import vendored

cfg = vendored("config")
lang = vendored("language")
positions = vendored("positions")


def test_interleaved_slot_table_for_the_published_section():
    axis = lang.mrope_axis_table((24, 20, 20), 64)
    assert [j for j in range(64) if axis[j] == 1] == list(range(1, 60, 3))
    assert [j for j in range(64) if axis[j] == 2] == list(range(2, 60, 3))
    assert [j for j in range(64) if axis[j] == 0] == list(range(0, 60, 3)) + [60, 61, 62, 63]


def test_rotate_half_is_halves_not_pairs():
    x = mx.array([1.0, 2.0, 3.0, 4.0])
    assert lang._rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]


def _rotary(head_dim=16, section=(4, 2, 2), theta=50000.0):
    return lang.MultimodalRotary(cfg.RopeSpec(theta=theta, mrope_section=section), head_dim)


def test_general_path_matches_the_formula():
    rot, rng = _rotary(), np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 5, 16)).astype(np.float32)
    pos = rng.integers(0, 40, size=(3, 1, 5))
    out = np.array(rot(mx.array(x), positions.Positions(explicit=mx.array(pos))))
    inv = 50000.0 ** (-np.arange(0, 16, 2) / 16)
    axis = lang.mrope_axis_table((4, 2, 2), 8)
    ang = np.stack([pos[axis[j], 0] * inv[j] for j in range(8)], axis=-1)  # [L, 8]
    ang = np.concatenate([ang, ang], -1)
    rot_half = np.concatenate([-x[..., 8:], x[..., :8]], -1)
    want = x * np.cos(ang) + rot_half * np.sin(ang)
    assert np.abs(out - want).max() < 1e-5


def test_equal_axes_fast_path_equals_general_path():
    rot = _rotary()
    x = mx.array(np.random.default_rng(1).standard_normal((1, 2, 7, 16)).astype(np.float32))
    ids = mx.broadcast_to((mx.arange(7) + 13)[None, None], (3, 1, 7))
    fast = rot(x, positions.Positions(offset=13))
    general = rot(x, positions.Positions(explicit=ids))
    assert mx.abs(fast - general).max().item() < 1e-5


@pytest.mark.parametrize("L, K, window", [(5, 5, None), (6, 6, 3), (4, 10, 4), (1, 20, 16), (3, 18, 16)])
def test_window_mask_is_q_minus_w_lt_k_le_q(L, K, window):
    mask = lang.causal_mask(L, K, window)
    got = np.ones((L, K), bool) if mask is None else np.broadcast_to(np.array(mask), (L, K))
    for i in range(L):
        q = K - L + i
        for k in range(K):
            want = k <= q and (window is None or k > q - window)
            assert got[i, k] == want, (i, k)


def _tiny_text():
    """The tiny checkpoint's text config cut to four layers, sliding (window 4) and full in turn."""
    layers = ["sliding_attention", "full_attention"] * 2
    base = dict(tiny.tiny_config()["text_config"], num_hidden_layers=4, layer_types=layers, sliding_window=4)
    return cfg.TextConfig.from_dict(base)


def test_full_layers_have_no_rotation_and_sliding_layers_do():
    model = lang.LanguageModel(_tiny_text())
    kinds = [(layer.layer_type, layer.self_attn.rotary is not None) for layer in model.layers]
    assert kinds == [("sliding_attention", True), ("full_attention", False)] * 2


def test_cache_kind_per_layer():
    caches = lang.LanguageModel(_tiny_text()).make_cache()
    names = [type(c).__name__ for c in caches]
    assert names == ["RotatingKVCache", "KVCache"] * 2
    assert caches[0].max_size == 4


def test_padding_mask_never_removes_causality():
    """A host running the model on the whole prompt may pass the processor's all-ones attention mask as ``mask``."""
    model = lang.LanguageModel(_tiny_text())
    mx.eval(model.parameters())
    ids = mx.array([[3, 9, 4, 1, 7, 2, 8]])
    plain = model(ids, cache=model.make_cache()).logits
    padded = model(ids, mask=mx.ones(ids.shape, dtype=mx.int32), cache=model.make_cache()).logits
    assert mx.array_equal(plain, padded)
    # and causality holds: the first logits do not see later tokens
    prefix = model(ids[:, :3], cache=model.make_cache()).logits
    assert mx.abs(prefix - plain[:, :3]).max().item() < 1e-5
