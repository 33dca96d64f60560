"""Image path against transformers' recorded outputs: positions, vision features, logits, greedy ids."""

import mlx.core as mx
import numpy as np
import pytest

from scripts._lib.parity import (
    assert_decode_steps_match,
    assert_prefill_matches,
    chunked_prefill,
    greedy,
    image_kwargs,
    prefill,
)
from tests.lib.vendored import vendored

compass = vendored("cohere_compass")
positions = vendored("positions")

IMAGE_CASES = ["img_448", "img_640x480", "img_501x379", "img_two", "img_middle"]
TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_ckpt_original):
    from mlx_vlm.utils import load_model

    return load_model(tiny_ckpt_original)


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_position_ids_and_rope_delta_match_reference(model, reference, name):
    case = reference(name)
    pos, deltas = positions.get_rope_index(
        case["input_ids"],
        case["image_grid_thw"],
        model.config.image_token_id,
        model.config.vision_config.spatial_merge_size,
    )
    np.testing.assert_array_equal(pos, case["position_ids"])
    np.testing.assert_array_equal(deltas.reshape(-1), case["rope_deltas"].reshape(-1))


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_vision_and_deepstack_features_match_reference(model, reference, name):
    case = reference(name)
    enc = model.encode_image(mx.array(case["pixel_values"]), case["image_grid_thw"])
    ref_ds = case["deepstack_features"]
    # One row per image token: the merger's features, then each deepstack feature.
    assert enc.shape == (ref_ds.shape[1], (1 + ref_ds.shape[0]) * ref_ds.shape[2])
    parts = np.split(np.array(enc), 1 + ref_ds.shape[0], axis=-1)
    diff = np.abs(parts[0] - case["image_features"]).max()
    assert diff < TOL, f"image features off by {diff:.3g}"
    for k in range(ref_ds.shape[0]):
        d = np.abs(parts[1 + k] - ref_ds[k]).max()
        assert d < TOL, f"deepstack {k} off by {d:.3g}"


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_prefill_logits_match_reference(model, reference, name):
    assert_prefill_matches(model, reference(name), name, TOL)


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_decode_steps_and_greedy_ids_match_reference(model, reference, name):
    case = reference(name)
    assert_decode_steps_match(model, case, name, TOL)
    assert greedy(model, case, len(case["greedy_ids"])) == case["greedy_ids"].tolist()


def test_chunk_boundary_inside_image_pads_equals_one_shot(model, reference):
    case = reference("img_middle")
    types = case["mm_token_type_ids"][0]
    first = int(np.argmax(types == 1))
    chunk = first + 5  # the first chunk ends five pads into the image
    assert types[chunk - 1] == 1 and types[chunk] == 1
    one = prefill(model, case)
    assert mx.abs(one - chunked_prefill(model, case, chunk)).max().item() < 1e-5


def test_zeroed_deepstack_changes_logits(model, reference):
    case = reference("img_448")
    kw = image_kwargs(case)
    ids = mx.array(case["input_ids"])
    enc = model.encode_image(kw.pop("pixel_values"), kw["image_grid_thw"])
    D = model.config.text_config.hidden_size
    zeroed = mx.concatenate([enc[:, :D], mx.zeros_like(enc[:, D:])], axis=-1)

    def logits(features):
        out = model(ids, None, cache=model.language_model.make_cache(), cached_image_features=features, **kw)
        return out.logits[0]

    assert mx.abs(logits(enc) - logits(zeroed)).max().item() > 1e-3


def test_dropping_an_image_raises_the_count_error(model, reference):
    case = reference("img_two")
    grid = case["image_grid_thw"]
    per_image = [int(t * (h // 2) * (w // 2)) for t, h, w in grid]
    pv = mx.array(case["pixel_values"][: int(grid[0].prod())])
    with pytest.raises(
        ValueError, match=f"{sum(per_image)} image tokens but the image features cover {per_image[0]} tokens"
    ):
        model(
            mx.array(case["input_ids"]), pv, cache=model.language_model.make_cache(), image_grid_thw=mx.array(grid[:1])
        )
