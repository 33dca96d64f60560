"""Config parsing: tolerant of unknown keys, strict about values the model cannot run."""

import pytest

from compass_data import tiny
from tests.support.reference_head import REFERENCE_HEAD
from tests.support.vendored import vendored

cfg = vendored("config")

# Stray top-level keys next to per-type entries, as on the hub config: ignored.
PUBLISHED_ROPE = dict(tiny.mrope_parameters([24, 20, 20], theta=50000), rope_theta=10000, rope_type="default")


def text(**kw):
    base = dict(
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters=PUBLISHED_ROPE,
    )
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
    # As transformers 5.24 does (the model's description says the key is ignored; the reference honours it).
    assert text().head_dim == 2048 // 16
    assert text(head_dim=96, rope_parameters={"full_attention": None}).head_dim == 96


def test_layer_types_default_to_full_attention():
    c = text(layer_types=None, num_hidden_layers=3)
    assert c.layer_types == ["full_attention"] * 3


def test_unknown_keys_are_ignored():
    c = cfg.ModelConfig.from_dict(
        {
            "model_type": "cohere_compass",
            "fusion_config": {"patch_embeddings": True},
            "something_new": 1,
            "text_config": dict(
                hidden_size=64,
                num_attention_heads=4,
                num_hidden_layers=1,
                surprise=True,
                rope_parameters={"rope_theta": 10000, "mrope_section": [4, 2, 2]},
            ),
            "vision_config": {"model_type": "cohere_compass", "unknown": 3},
        }
    )
    assert c.text_config.hidden_size == 64
    assert c.vision_config.model_type == "cohere_compass_vision"  # very old checkpoints: accepted


def tie_config(top, text):
    """A ModelConfig with the top-level / text_config tie_word_embeddings keys (None: absent)."""
    params = {"text_config": {} if text is None else {"tie_word_embeddings": text}}
    if top is not None:
        params["tie_word_embeddings"] = top
    return cfg.ModelConfig.from_dict(params)


@pytest.mark.parametrize("top, text, stored", sorted(REFERENCE_HEAD, key=str))
def test_tie_follows_the_reference_else_the_text_config_key(top, text, stored):
    got = tie_config(top, text).head_tied(stored)
    reference = REFERENCE_HEAD[top, text, stored]
    if reference == "random":  # the reference would run a random head: text_config decides
        assert got is (True if text else None)
    else:
        assert got is (reference == "embedding")


def test_a_stored_head_equal_to_the_embedding_is_tied_when_the_top_level_key_says_so():
    # The reference ties a stored lm_head equal to the embedding only under a true top-level key.
    assert tie_config(True, None).head_tied(True, same_as_embedding=True) is True
    assert tie_config(None, True).head_tied(True, same_as_embedding=True) is False


def test_model_is_built_from_the_key_the_config_writer_meant():
    # Before the weights are seen: the top-level key, else text_config's (published: both true).
    assert tie_config(True, False).tie_word_embeddings is True
    assert tie_config(False, True).tie_word_embeddings is False
    assert tie_config(None, True).tie_word_embeddings is True
    assert tie_config(None, None).tie_word_embeddings is False
    assert tie_config(None, True).declared_tie_word_embeddings is None


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(layer_types=["sliding_attention"] * 3), "layer_types has 3 entries"),
        (dict(layer_types=["sliding_attention"] * 3 + ["local"]), "unknown types"),
        (dict(rope_parameters={"sliding_attention": {"rope_theta": 1, "mrope_section": [24, 20, 19]}}), "sums to 63"),
        (dict(num_key_value_heads=5), "multiple of num_key_value_heads"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_type 'yarn'"),
        (
            dict(hidden_size=2050),
            r"hidden_size \(2050\) must be divisible by num_attention_heads \(16\), or give head_dim",
        ),
        (dict(head_dim=63), "head_dim must be a positive even number, got 63"),
        (dict(sliding_window=None), "sliding_window must be a positive integer when layer_types contains sliding"),
        (dict(rope_parameters={"rope_theta": 1.0, "mrope_section": [32, 32]}), r"mrope_section must have 3 entries"),
    ],
)
def test_bad_values_raise_value_error_naming_the_key(kw, words):
    with pytest.raises(ValueError, match=words):
        text(**kw)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(hidden_size=30, num_heads=4), r"vision_config\.hidden_size \(30\) must be divisible by num_heads \(4\)"),
        (dict(num_position_embeddings=2000), "num_position_embeddings must be a square number"),
        (
            dict(depth=2, deepstack_visual_indexes=[1, 2]),
            r"deepstack_visual_indexes \[2\] lie outside the 2 vision blocks",
        ),
    ],
)
def test_bad_vision_values_raise_value_error_naming_the_key(kw, words):
    with pytest.raises(ValueError, match=words):
        cfg.VisionConfig.from_dict(kw)


def test_wrong_model_type_is_refused():
    with pytest.raises(ValueError, match="model_type 'qwen2_vl'"):
        cfg.ModelConfig.from_dict({"model_type": "qwen2_vl"})
