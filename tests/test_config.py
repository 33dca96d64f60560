"""Config parsing: tolerant of unknown keys, strict about values the model cannot run."""

import pytest

from vendored import vendored

cfg = vendored("config")

PUBLISHED_ROPE = {
    "sliding_attention": {
        "rope_type": "default",
        "rope_theta": 50000,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
    "full_attention": None,
    # Stray top-level keys next to per-type entries, as on the hub config: ignored.
    "rope_theta": 10000,
    "rope_type": "default",
}


def text(**kw):
    base = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=4,
                layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_parameters=PUBLISHED_ROPE)
    base.update(kw)
    return cfg.TextConfig.from_dict(base)


def test_published_rope_block_per_layer_type():
    c = text()
    assert c.rope_for("sliding_attention") == cfg.RopeSpec(theta=50000.0, mrope_section=(24, 20, 20))
    assert c.rope_for("full_attention") is None


def test_missing_layer_type_entry_means_no_rotation():
    c = text(rope_parameters={"sliding_attention": {"rope_theta": 50000, "mrope_section": [24, 20, 20]}})
    assert c.rope_for("full_attention") is None


def test_flat_rope_applies_to_every_layer_type():
    c = text(rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    assert c.rope_for("full_attention") == c.rope_for("sliding_attention")
    assert c.rope_for("full_attention").theta == 1234.0
    bare = text(rope_parameters=None, rope_theta=777.0)
    assert bare.rope_for("full_attention").theta == 777.0


def test_mrope_section_defaults_like_the_reference():
    c = text(rope_parameters={"sliding_attention": {"rope_theta": 50000}, "full_attention": None})
    assert c.rope_for("sliding_attention").mrope_section == (24, 20, 20)


def test_head_dim_is_derived_unless_the_key_is_given():
    # As transformers 5.24 does (SPEC says the key is ignored; the reference honours it).
    assert text().head_dim == 2048 // 16
    assert text(head_dim=96, rope_parameters={"full_attention": None}).head_dim == 96


def test_layer_types_default_to_full_attention():
    c = text(layer_types=None, num_hidden_layers=3)
    assert c.layer_types == ["full_attention"] * 3


def test_unknown_keys_are_ignored():
    c = cfg.ModelConfig.from_dict({
        "model_type": "cohere_compass", "fusion_config": {"patch_embeddings": True}, "something_new": 1,
        "text_config": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, surprise=True,
                            rope_parameters={"rope_theta": 10000, "mrope_section": [4, 2, 2]}),
        "vision_config": {"model_type": "cohere_compass", "unknown": 3},
    })
    assert c.text_config.hidden_size == 64
    assert c.vision_config.model_type == "cohere_compass_vision"  # very old checkpoints: accepted


def test_tie_decision_is_the_top_level_key():
    tied = cfg.ModelConfig.from_dict({"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}})
    untied = cfg.ModelConfig.from_dict({"text_config": {"tie_word_embeddings": True}})
    assert tied.tie_word_embeddings is True
    assert untied.tie_word_embeddings is False  # the reference's top-level default


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(layer_types=["sliding_attention"] * 3), "layer_types has 3 entries"),
        (dict(layer_types=["sliding_attention"] * 3 + ["local"]), "unknown types"),
        (dict(rope_parameters={"sliding_attention": {"rope_theta": 1, "mrope_section": [24, 20, 19]}}), "sums to 63"),
        (dict(num_key_value_heads=5), "multiple of num_key_value_heads"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_type 'yarn'"),
    ],
)
def test_bad_values_raise_value_error_naming_the_key(kw, words):
    with pytest.raises(ValueError, match=words):
        text(**kw)


def test_wrong_model_type_is_refused():
    with pytest.raises(ValueError, match="model_type 'qwen2_vl'"):
        cfg.ModelConfig.from_dict({"model_type": "qwen2_vl"})
