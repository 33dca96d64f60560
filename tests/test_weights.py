"""Both weight layouts, sanitize, and loading errors that name the offending key."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from compass_data import tiny
from tests.support.vendored import vendored

vendored()


def _load(path):
    from mlx_vlm.utils import load_model

    return load_model(path)


def _raw(path):
    return mx.load(str(path / "model.safetensors"))


def test_both_layouts_load_to_identical_parameters(tiny_ckpt_original, tiny_ckpt_mlx):
    a = dict(tree_flatten(_load(tiny_ckpt_original).parameters()))
    b = dict(tree_flatten(_load(tiny_ckpt_mlx).parameters()))
    assert a.keys() == b.keys()
    for key in a:
        assert mx.array_equal(a[key], b[key]), key


@pytest.mark.parametrize("layout", ["original", "mlx"])
def test_sanitize_is_idempotent(layout, tiny_ckpt_original, tiny_ckpt_mlx):
    path = tiny_ckpt_original if layout == "original" else tiny_ckpt_mlx
    model = _load(path)
    once = model.sanitize(_raw(path))
    twice = model.sanitize(once)
    assert once.keys() == twice.keys()
    assert all(mx.array_equal(once[k], twice[k]) for k in once)


def test_sanitize_drops_position_ids_and_tied_head(tiny_ckpt_original):
    model = _load(tiny_ckpt_original)
    raw = _raw(tiny_ckpt_original)
    embed = raw["model.language_model.embed_tokens.weight"]
    raw["lm_head.weight"] = embed
    raw["model.visual.position_ids"] = mx.arange(4)
    out = model.sanitize(raw)
    assert not [k for k in out if "position_ids" in k or "lm_head" in k]


def _broken_copy(src, tmp_path, edit):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    weights = _raw(dst)
    mx.eval(weights)  # mx.load is lazy: read everything before overwriting the file
    edit(weights)
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


def test_missing_tensor_is_named(tiny_ckpt_original, tmp_path):
    key = "model.language_model.layers.3.mlp.up_proj.weight"
    path = _broken_copy(tiny_ckpt_original, tmp_path, lambda w: w.pop(key))
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.up_proj\.weight"):
        _load(path)


def test_unexpected_post_attention_layernorm_is_named(tiny_ckpt_original, tmp_path):
    key = "model.language_model.layers.0.post_attention_layernorm.weight"
    path = _broken_copy(tiny_ckpt_original, tmp_path, lambda w: w.__setitem__(key, mx.ones((64,))))
    with pytest.raises(ValueError, match=r"post_attention_layernorm"):
        _load(path)


def test_wrong_shape_is_named(tiny_ckpt_original, tmp_path):
    key = "model.language_model.layers.1.self_attn.k_proj.weight"
    path = _broken_copy(tiny_ckpt_original, tmp_path, lambda w: w.__setitem__(key, mx.zeros((8, 64))))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj\.weight"):
        _load(path)


def test_untied_checkpoint_needs_and_uses_lm_head(tiny_ckpt_original, tmp_path, reference):
    from tests.support.parity import prefill

    head = (
        np.random.default_rng(0).standard_normal((tiny.PADDED_VOCAB_SIZE, tiny.TEXT["hidden_size"])).astype(np.float32)
        * 0.5
    )

    def add_head(w):
        w["lm_head.weight"] = mx.array(head)

    path = _broken_copy(tiny_ckpt_original, tmp_path, add_head)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    model = _load(path)
    assert np.array_equal(np.array(model.language_model.lm_head.weight), head)
    tied = _load(tiny_ckpt_original)
    case = reference("text_short")
    assert mx.abs(prefill(model, case) - prefill(tied, case)).max().item() > 1e-2


def test_bfloat16_checkpoint_generates_without_nan(tmp_path, reference):
    from compass_data.tiny import build_tiny_checkpoint
    from tests.support.parity import greedy, prefill

    model = _load(build_tiny_checkpoint(tmp_path / "bf16", dtype="bfloat16"))
    for name in ("text_medium", "img_448"):
        case = reference(name)
        logits = prefill(model, case)
        assert logits.dtype == mx.bfloat16
        assert not mx.isnan(logits).any().item()
        assert len(greedy(model, case, 8)) == 8
