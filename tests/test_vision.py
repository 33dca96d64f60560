"""Vision tower vs transformers' CohereCompassVisionModel (torch CPU, float32, eager).

Both sides get the same seeded random weights; every expected value comes from
running the reference.
"""

import numpy as np
import pytest

from compass_data import tiny
from tests.support.vendored import by_path

pytestmark = pytest.mark.reference
torch = pytest.importorskip("torch", reason="needs the torch reference (0.7.10 env)")
modeling = pytest.importorskip(
    "transformers.models.cohere_compass.modeling_cohere_compass",
    reason="needs transformers with cohere_compass (5.21 or newer)",
)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from transformers import CohereCompassVisionConfig  # noqa: E402

TOL = 1e-4
vision = by_path("vision", "compass_vision_under_test")
VisionConfig = by_path("config", "compass_vision_under_test").VisionConfig

# The tiny checkpoint's: 64 position embeddings are an 8x8 table, resampled for every grid below.
TINY = tiny.vision_config()


def _reference(**overrides):
    cfg = CohereCompassVisionConfig(**{**TINY, **overrides}, attn_implementation="eager")
    model = modeling.CohereCompassVisionModel(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # Well-scaled random values everywhere, so biases, norms and the table all matter.
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif name == "pos_embed.weight":
                p.copy_(noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)
    return model


def _checkpoint(ref):
    return {f"vision_tower.{k}": mx.array(v.numpy()) for k, v in ref.state_dict().items()}


def _ours(ref, **overrides):
    model = vision.VisionModel(VisionConfig.from_dict({**TINY, **overrides}))
    holder = nn.Module()
    holder.vision_tower = model
    holder.load_weights(list(model.sanitize(_checkpoint(ref)).items()), strict=True)
    return model


def _pixels(grids, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((n, 3 * 2 * 16 * 16)).astype(np.float32)


def _ours_on_one_picture():
    """(our tower with the reference's weights, pixels of one 8x12-patch picture, its grids, the output)."""
    model = _ours(_reference())
    grids = [[1, 8, 12]]
    pixels = mx.array(_pixels(grids))
    return model, pixels, grids, model(pixels, grids)[0]


def _max_diffs(grids, **overrides):
    ref = _reference(**overrides)
    ours = _ours(ref, **overrides)
    pixels = _pixels(grids)
    with torch.no_grad():
        out = ref(torch.from_numpy(pixels), grid_thw=torch.tensor(grids))
    expected = [out.pooler_output.numpy()] + [d.numpy() for d in out.deepstack_features]
    feats, deep = ours(mx.array(pixels), mx.array(grids))
    got = [np.array(a) for a in [feats] + deep]
    assert [g.shape for g in got] == [e.shape for e in expected]
    return [float(np.abs(g - e).max()) for g, e in zip(got, expected)]


@pytest.mark.parametrize(
    "grids",
    [
        [[1, 28, 28]],  # 448x448
        [[1, 30, 40]],  # 480x640, non-square
        [[1, 28, 28], [1, 30, 40]],  # two sizes: block-diagonal attention
        [[1, 8, 8], [1, 8, 8], [1, 6, 10]],  # same-size images batched together
        [[2, 8, 12], [1, 6, 4]],  # t=2: per-frame attention, as the reference's cu_seqlens
    ],
    ids=["448x448", "640x480", "two-sizes", "same-size-pair", "t2"],
)
def test_matches_reference(grids):
    diffs = _max_diffs(grids)
    assert max(diffs) < TOL, diffs


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_block_activation_matches_reference(act):
    diffs = _max_diffs([[1, 12, 16]], hidden_act=act)
    assert max(diffs) < TOL, diffs


def test_rope_theta_matches_reference():
    diffs = _max_diffs([[1, 12, 16]], rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    assert max(diffs) < TOL, diffs


def test_config_is_read_not_assumed():
    # Guards the two tests above: a wrong theta or activation must be visible.
    ref = _reference(hidden_act="gelu", rope_parameters={"rope_theta": 100.0})
    grids = [[1, 12, 16]]
    pixels = mx.array(_pixels(grids))
    base, _ = _ours(ref, hidden_act="gelu", rope_parameters={"rope_theta": 100.0})(pixels, grids)
    for wrong in ({"hidden_act": "gelu_pytorch_tanh"}, {"rope_parameters": {"rope_theta": 1e4}}):
        other, _ = _ours(ref, **{"hidden_act": "gelu", **wrong})(pixels, grids)
        assert float(mx.abs(other - base).max()) > 10 * TOL, wrong


def test_grid_as_nested_list_and_bfloat16_run():
    model, pixels, grids, a = _ours_on_one_picture()
    b, _ = model(pixels, mx.array(grids))
    assert mx.array_equal(a, b)
    model.set_dtype(mx.bfloat16)
    c, deep = model(pixels, grids)
    assert c.dtype == mx.bfloat16 and all(d.dtype == mx.bfloat16 for d in deep)
    # bf16 keeps the answer roughly (weights and activations rounded to 8 bits).
    assert float(mx.abs(c.astype(mx.float32) - a).max()) < 0.1 * float(mx.abs(a).max())


def test_quantized_linears_still_run():
    # MLX conversions may quantize the tower's Linears; those must take the layer's own path.
    model, pixels, grids, a = _ours_on_one_picture()
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    assert isinstance(model.blocks[0].attn.qkv, nn.QuantizedLinear)
    b, deep = model(pixels, grids)
    assert b.shape == a.shape and len(deep) == len(TINY["deepstack_visual_indexes"])
    assert float(mx.abs(b - a).max()) < 0.05 * float(mx.abs(a).max())


def test_sanitize_transposes_torch_conv_once_and_drops_position_ids():
    ref = _reference()
    model = vision.VisionModel(VisionConfig.from_dict(TINY))
    weights = _checkpoint(ref)
    weights["vision_tower.position_ids"] = mx.arange(4)
    weights["vision_tower.pos_embed.position_ids"] = mx.arange(4)
    once = model.sanitize(weights)
    twice = model.sanitize(once)

    assert not any(k.endswith("position_ids") for k in once)
    assert once.keys() == twice.keys()
    assert all(mx.array_equal(once[k], twice[k]) for k in once)
    conv = ref.state_dict()["patch_embed.proj.weight"].numpy()  # [O, C, T, P, P]
    np.testing.assert_array_equal(np.array(once["vision_tower.patch_embed.proj.weight"]), conv.transpose(0, 2, 3, 4, 1))
    untouched = [k for k in weights if k != "vision_tower.patch_embed.proj.weight"]
    assert all(once[k] is weights[k] for k in untouched if k in once)


def test_sanitize_rejects_unknown_conv_layout():
    model = vision.VisionModel(VisionConfig.from_dict(TINY))
    with pytest.raises(ValueError, match="patch_embed.proj.weight"):
        model.sanitize({"vision_tower.patch_embed.proj.weight": mx.zeros((32, 3, 1, 16, 16))})


def test_strict_loading_rejects_missing_and_extra_keys():
    ref = _reference()
    model = vision.VisionModel(VisionConfig.from_dict(TINY))
    weights = {k[len("vision_tower.") :]: v for k, v in model.sanitize(_checkpoint(ref)).items()}
    model.load_weights(list(weights.items()), strict=True)

    missing = dict(weights)
    del missing["blocks.1.attn.qkv.bias"]
    with pytest.raises(ValueError, match="blocks.1.attn.qkv.bias"):
        model.load_weights(list(missing.items()), strict=True)
    extra = {**weights, "rotary_pos_emb.inv_freq": mx.zeros((4,))}
    with pytest.raises(ValueError, match="rotary_pos_emb.inv_freq"):
        model.load_weights(list(extra.items()), strict=True)


def test_parameter_names_are_exactly_the_references():
    from mlx.utils import tree_flatten

    ref = _reference()
    ours = vision.VisionModel(VisionConfig.from_dict(TINY))
    names = {k for k, _ in tree_flatten(ours.parameters())}
    assert names == set(ref.state_dict())


def test_unsupported_activation_names_the_key():
    with pytest.raises(ValueError, match="hidden_act"):
        vision.VisionModel(VisionConfig.from_dict({**TINY, "hidden_act": "relu"}))
