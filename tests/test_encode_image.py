"""Public encode_image and exact replay of cached vision features (host feature caches)."""

import mlx.core as mx
import numpy as np
import pytest

from tests.support.mlx_vlm_run import greedy_ids
from tests.support.parity import greedy, image_kwargs
from tests.support.vendored import vendored

compass = vendored("cohere_compass")


def logits(model, case, **kw):
    kw = {**image_kwargs(case), **kw}
    pixel_values = kw.pop("pixel_values") if "cached_image_features" not in kw else None
    kw.pop("pixel_values", None)
    out = model(mx.array(case["input_ids"]), pixel_values, cache=model.language_model.make_cache(), **kw)
    return out.logits


def encode(model, case):
    return model.encode_image(mx.array(case["pixel_values"]), case["image_grid_thw"])


@pytest.mark.parametrize("name", ["img_448", "img_two"])
def test_replay_gives_bit_identical_logits(model, reference, name):
    case = reference(name)
    assert mx.array_equal(logits(model, case), logits(model, case, cached_image_features=encode(model, case)))


def test_images_encoded_separately_then_concatenated(model, reference):
    case = reference("img_two")
    grid = case["image_grid_thw"]
    patches = [int(np.prod(g)) for g in grid]
    pv = case["pixel_values"]
    parts = [
        model.encode_image(mx.array(pv[: patches[0]]), grid[:1]),
        model.encode_image(mx.array(pv[patches[0] :]), grid[1:]),
    ]
    joined = mx.concatenate(parts, axis=0)
    assert mx.array_equal(logits(model, case), logits(model, case, cached_image_features=joined))
    # what hosts do with the array: per-image rows, then mx.concatenate on axis 0
    split = compass.split_image_features(joined, grid, merge_size=2)
    assert [p.shape[0] for p in split] == [int(np.prod(g)) // 4 for g in grid]
    assert all(mx.array_equal(a, b) for a, b in zip(split, parts))
    assert mx.array_equal(mx.concatenate(split, axis=0), joined)


def test_features_are_one_array_a_host_can_cache(model, reference):
    """First axis = image tokens; the row width carries the K deepstack features too."""
    case = reference("img_two")
    enc = encode(model, case)
    cfg = model.config
    tokens = int(np.sum(np.asarray(case["input_ids"]) == cfg.image_token_id))
    D, K = cfg.text_config.hidden_size, len(cfg.vision_config.deepstack_visual_indexes)
    assert isinstance(enc, mx.array) and enc.shape == (tokens, (1 + K) * D)
    assert enc.nbytes == tokens * (1 + K) * D * enc.dtype.size


def test_features_of_the_wrong_width_are_refused(model, reference):
    case = reference("img_448")
    enc = encode(model, case)
    with pytest.raises(ValueError, match="Re-encode the images"):
        logits(model, case, cached_image_features=enc[:, : model.config.text_config.hidden_size])


@pytest.mark.parametrize(
    "form, words",
    [
        ("dict", r"must be the mx.array returned by Model.encode_image, got dict$"),
        ("list of arrays", r"got list \(join per-image arrays: mx.concatenate\(parts, axis=0\)\)"),
        ("numpy array", "must be the mx.array returned by Model.encode_image, got ndarray"),
    ],
)
def test_replay_forms_it_cannot_read_are_refused(model, reference, form, words):
    case = reference("img_448")
    enc = encode(model, case)
    D = model.config.text_config.hidden_size
    given = {
        "dict": {"image_features": enc[:, :D]},
        "list of arrays": [enc],
        "numpy array": np.asarray(enc),
    }[form]
    with pytest.raises(ValueError, match=words):
        logits(model, case, cached_image_features=given)


def test_deepstack_is_part_of_the_replay(model, reference):
    """Dropping the deepstack features from a replay changes the logits (so the test above has teeth)."""
    case = reference("img_448")
    enc = encode(model, case)
    D = model.config.text_config.hidden_size
    dropped = mx.concatenate([enc[:, :D], mx.zeros_like(enc[:, D:])], axis=-1)
    assert not mx.array_equal(logits(model, case), logits(model, case, cached_image_features=dropped))


def test_replay_after_safetensors_round_trip(model, reference, tmp_path):
    case = reference("img_two")
    enc = encode(model, case)
    path = str(tmp_path / "features.safetensors")
    mx.save_safetensors(path, {"features": enc})
    loaded = mx.load(path)["features"]
    assert mx.array_equal(logits(model, case), logits(model, case, cached_image_features=loaded))


def test_greedy_generation_with_replayed_features(model, reference):
    case = reference("img_501x379")
    enc = encode(model, case)

    uncached = greedy(model, case, 32)
    assert (
        uncached == greedy(model, case, 32, pixel_values=None, cached_image_features=enc) == case["greedy_ids"].tolist()
    )


def test_mismatched_replay_raises_the_count_error(model, reference):
    small, big = reference("img_448"), reference("img_640x480")
    with pytest.raises(ValueError, match="the prompt has 300 image tokens but the image features cover 196"):
        logits(model, big, cached_image_features=encode(model, small))


def test_encode_image_without_grid_uses_the_processors_memo(model, reference, tiny_ckpt_original, fixture_images):
    """mlx-vlm 0.4.x-0.6.x call encode_image(pixel_values) with no grid."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(tiny_ckpt_original))
    out = processor.image_processor([str(fixture_images["synth_640x480.png"])])
    with_grid = model.encode_image(mx.array(out["pixel_values"]), out["image_grid_thw"])
    without = model.encode_image(mx.array(out["pixel_values"]))
    assert mx.array_equal(with_grid, without)
    with pytest.raises(ValueError, match="needs image_grid_thw"):
        model.encode_image(mx.array(out["pixel_values"]) + 1.0)


def test_mlx_vlm_vision_cache_path(tiny_ckpt_original, reference, fixture_images):
    """Through the pin's own vision-feature cache (mlx-vlm >= 0.4): a repeated image is replayed."""
    import mlx_vlm

    if not hasattr(mlx_vlm, "VisionFeatureCache"):
        pytest.skip(f"mlx-vlm {mlx_vlm.__version__} has no VisionFeatureCache (added in 0.4)")
    from mlx_vlm import load

    model, processor = load(str(tiny_ckpt_original))
    case = reference("img_448")
    image = str(fixture_images["synth_448x448.png"])
    cache = mlx_vlm.VisionFeatureCache()
    calls = []
    original = model.vision_tower.__call__

    class Counting(type(model.vision_tower)):
        def __call__(self, *a, **k):
            calls.append(1)
            return original(*a, **k)

    model.vision_tower.__class__ = Counting
    runs = [greedy_ids((model, processor), case["meta"]["prompt"], [image], 16, vision_cache=cache) for _ in range(2)]
    assert runs[0] == runs[1] == case["greedy_ids"].tolist()[:16]
    assert len(calls) == 1, "the second run should replay cached features, not run the tower"
