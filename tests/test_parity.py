"""The model against transformers' recorded outputs on the same tiny weights: text prompts (on
both key layouts) and image prompts (positions, vision features, logits, greedy ids)."""

import mlx.core as mx
import numpy as np
import pytest

from tests.support.parity import (
    assert_decode_steps_match,
    assert_prefill_matches,
    chunked_prefill,
    greedy,
    image_kwargs,
    prefill,
)
from tests.support.vendored import vendored

compass = vendored("cohere_compass")
positions = vendored("positions")

TEXT_CASES = ["text_short", "text_medium", "text_long"]
IMAGE_CASES = ["img_448", "img_640x480", "img_501x379", "img_two", "img_middle"]
LAYOUTS = ["original", "mlx"]
# (checkpoint layout, case): text cases on both key layouts, image cases on the original one.
LOGIT_CASES = [(layout, name) for layout in LAYOUTS for name in TEXT_CASES] + [("original", n) for n in IMAGE_CASES]
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_ckpt_original, tiny_ckpt_mlx):
    """The tiny checkpoint loaded per key layout (each once)."""
    from mlx_vlm.utils import load_model

    paths = {"original": tiny_ckpt_original, "mlx": tiny_ckpt_mlx}
    loaded = {}

    def get(layout: str):
        if layout not in loaded:
            loaded[layout] = load_model(paths[layout])
        return loaded[layout]

    return get


@pytest.fixture(scope="module")
def model(models):
    return models("original")


@pytest.mark.parametrize("layout, name", LOGIT_CASES)
def test_prefill_logits_match_reference(models, reference, layout, name):
    assert_prefill_matches(models(layout), reference(name), name, TOL)


@pytest.mark.parametrize("layout, name", LOGIT_CASES)
def test_decode_steps_match_reference(models, reference, layout, name):
    assert_decode_steps_match(models(layout), reference(name), name, TOL)


@pytest.mark.parametrize("layout, name", LOGIT_CASES)
def test_free_running_greedy_ids_match_reference(models, reference, layout, name):
    case = reference(name)
    assert greedy(models(layout), case, len(case["greedy_ids"])) == case["greedy_ids"].tolist()


@pytest.mark.parametrize("chunk", [7, 24])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prefill_equals_one_shot(models, reference, layout, chunk):
    case = reference("text_long")
    one = prefill(models(layout), case)
    chunked = chunked_prefill(models(layout), case, chunk)
    assert mx.abs(one - chunked).max().item() < 1e-5


def test_long_prompt_exceeds_three_windows(reference, tiny_ckpt_original):
    import json

    window = json.loads((tiny_ckpt_original / "config.json").read_text())["text_config"]["sliding_window"]
    assert reference("text_long")["input_ids"].shape[1] >= 3 * window


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
