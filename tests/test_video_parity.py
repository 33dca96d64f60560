"""Video path against transformers' recorded outputs (scripts/reference/video_model.py): positions,
vision features, prefill logits and greedy ids on the tiny checkpoint and the default toy, from
the reference processor's own inputs; feature replay; chunked prefill; the count errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.support.cases import case_inputs
from tests.support.parity import assert_decode_steps_match, assert_prefill_matches, chunked_prefill, greedy, prefill
from tests.support.recorded import VIDEO_INDEX, video_case
from tests.support.vendored import vendored

positions = vendored("positions")

TINY_CASES = list(VIDEO_INDEX["checkpoints"]["tiny"])
TOY_CASES = list(VIDEO_INDEX["checkpoints"]["toy"])
TOL = 1e-4


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    from mlx_vlm.utils import load_model

    from compass_data.toy import build_toy_checkpoint

    return load_model(build_toy_checkpoint(tmp_path_factory.mktemp("toy")))


def test_fixtures_cover_the_rules():
    """The cases hold what the issue names: an odd frame count, an image with a video, two videos."""
    grids = {name: video_case("tiny", name)["video_grid_thw"].tolist() for name in TINY_CASES}
    assert grids["video_5f_odd"][0][0] == 3  # 5 frames padded to 3 temporal patches
    assert len(grids["video_two"]) == 2
    assert "pixel_values" in video_case("tiny", "video_and_image")


@pytest.mark.parametrize("name", TINY_CASES)
def test_position_ids_and_rope_delta_match_reference(model, name):
    case = video_case("tiny", name)
    pos, deltas = positions.get_rope_index(
        case["input_ids"],
        case.get("image_grid_thw"),
        model.config.image_token_id,
        model.config.vision_config.spatial_merge_size,
        video_grid_thw=case["video_grid_thw"],
        video_token_id=model.config.video_token_id,
    )
    np.testing.assert_array_equal(pos, case["position_ids"])
    np.testing.assert_array_equal(deltas.reshape(-1), case["rope_deltas"].reshape(-1))
    # The language model's method (mlx-vlm 0.7.x primes positions with it) finds the same.
    pos2, deltas2 = model.language_model.get_rope_index(
        mx.array(case["input_ids"]), case.get("image_grid_thw"), case["video_grid_thw"]
    )
    np.testing.assert_array_equal(np.array(pos2), case["position_ids"])
    np.testing.assert_array_equal(np.array(deltas2).reshape(-1), case["rope_deltas"].reshape(-1))


@pytest.mark.parametrize("name", TINY_CASES)
def test_video_features_match_reference(model, name):
    case = video_case("tiny", name)
    enc = model.encode_video(mx.array(case["pixel_values_videos"]), case["video_grid_thw"])
    ref_ds = case["video_deepstack_features"]
    parts = np.split(np.array(enc), 1 + ref_ds.shape[0], axis=-1)
    assert np.abs(parts[0] - case["video_features"]).max() < TOL
    for k in range(ref_ds.shape[0]):
        assert np.abs(parts[1 + k] - ref_ds[k]).max() < TOL, f"deepstack {k}"


@pytest.mark.parametrize("name", TINY_CASES)
def test_prefill_logits_match_reference(model, name):
    assert_prefill_matches(model, video_case("tiny", name), name, TOL)


@pytest.mark.parametrize("name", TINY_CASES)
def test_decode_steps_and_greedy_ids_match_reference(model, name):
    case = video_case("tiny", name)
    assert_decode_steps_match(model, case, name, TOL)
    assert greedy(model, case, len(case["greedy_ids"])) == case["greedy_ids"].tolist()


@pytest.mark.parametrize("name", TOY_CASES)
def test_toy_prefill_and_greedy_ids_match_reference(toy_model, name):
    case = video_case("toy", name)
    assert_prefill_matches(toy_model, case, name, TOL)
    assert greedy(toy_model, case, len(case["greedy_ids"])) == case["greedy_ids"].tolist()


def _cached_kwargs(model, case: dict) -> dict:
    """The case's inputs with every modality's features replayed from encode_image / encode_video."""
    _, pixels, extra = case_inputs(case)
    out = {k: v for k, v in extra.items() if k not in ("pixel_values_videos",)}
    out["cached_video_features"] = model.encode_video(extra["pixel_values_videos"], extra["video_grid_thw"])
    if pixels is not None:
        out["cached_image_features"] = model.encode_image(pixels, extra["image_grid_thw"])
    return out


@pytest.mark.parametrize("name", ["video_4f", "video_and_image", "video_two"])
def test_replayed_video_features_give_identical_logits(model, name):
    case = video_case("tiny", name)
    ids, pixels, extra = case_inputs(case)
    fresh = model(ids, pixels, cache=model.language_model.make_cache(), **extra).logits
    replay = model(ids, None, cache=model.language_model.make_cache(), **_cached_kwargs(model, case)).logits
    assert mx.array_equal(fresh, replay).item()


def test_per_video_features_joined_replay_identically(model):
    """Two videos encoded one at a time and joined (as a host caches them) give the same logits."""
    case = video_case("tiny", "video_two")
    ids, _, extra = case_inputs(case)
    grid = case["video_grid_thw"]
    rows = [int(t * h * w) for t, h, w in grid]
    pv = extra["pixel_values_videos"]
    parts = [
        model.encode_video(pv[: rows[0]], grid[:1]),
        model.encode_video(pv[rows[0] :], grid[1:]),
    ]
    fresh = model(ids, None, cache=model.language_model.make_cache(), **extra).logits
    kw = {k: v for k, v in extra.items() if k != "pixel_values_videos"}
    joined = mx.concatenate(parts, axis=0)
    replay = model(ids, None, cache=model.language_model.make_cache(), cached_video_features=joined, **kw).logits
    assert mx.array_equal(fresh, replay).item()


def test_chunk_boundary_inside_video_pads_equals_one_shot(model):
    case = video_case("tiny", "video_5f_odd")
    types = case["mm_token_type_ids"][0]
    chunk = int(np.argmax(types == 2)) + 5  # the first chunk ends five pads into the first patch
    assert types[chunk - 1] == 2 and types[chunk] == 2
    assert mx.abs(prefill(model, case) - chunked_prefill(model, case, chunk)).max().item() < 1e-5


def test_video_tokens_without_video_input_are_refused(model):
    case = video_case("tiny", "video_and_image")
    ids, pixels, extra = case_inputs(case)
    extra = {k: v for k, v in extra.items() if k not in ("pixel_values_videos", "video_grid_thw")}
    with pytest.raises(ValueError, match=r"video tokens but no video input: pass pixel_values_videos"):
        model(ids, pixels, cache=model.language_model.make_cache(), **extra)


def test_dropping_a_video_raises_the_count_error(model):
    case = video_case("tiny", "video_two")
    ids, _, extra = case_inputs(case)
    grid = case["video_grid_thw"]
    first = int(np.prod(grid[0]))
    tokens = [int(t * (h // 2) * (w // 2)) for t, h, w in grid]
    extra["pixel_values_videos"] = extra["pixel_values_videos"][:first]
    extra["video_grid_thw"] = mx.array(grid[:1])
    with pytest.raises(ValueError, match=f"{sum(tokens)} video tokens but the video features cover {tokens[0]}"):
        model(ids, None, cache=model.language_model.make_cache(), **extra)


def test_rope_index_refuses_a_grid_without_its_video_tokens(model):
    case = video_case("tiny", "video_4f")
    grid = np.concatenate([case["video_grid_thw"], case["video_grid_thw"]])
    with pytest.raises(ValueError, match="video_grid_thw describes 4 temporal patch"):
        positions.get_rope_index(
            case["input_ids"],
            None,
            model.config.image_token_id,
            2,
            video_grid_thw=grid,
            video_token_id=model.config.video_token_id,
        )
