"""The caller contract (docs/model-contract.md), item by item, against the one-shot reference.

Each driver (tests/support/contract.py) calls the model the way one kind of caller does (mlx-vlm's
generate, batch and server paths; LM Studio's engine, Rapid-MLX, vMLX, oMLX) and returns the
logits of the prompt's last token and of each teacher-forced decode step. Ours is compared with
the recorded transformers fixtures (prefill and step logits within 1e-4, greedy ids exact),
never with another run of our code. What mlx-vlm's own ``qwen3_vl`` (the control) did under the
same drivers: docs/model-contract.md.
"""

from __future__ import annotations

from typing import Dict

import mlx.core as mx
import numpy as np
import pytest

from tests.support.contract import (
    DECODES,
    KEPT,
    STEPS,
    SUFFIX_MODES,
    TOL,
    Case,
    check,
    decode_plain,
    has_batch_caches,
    item_interleaved,
    item_lm_chunks,
    item_merged,
    item_merged_after_a_restored_text_prefix,
    item_model_chunks,
    item_one_row_batch,
    item_rebuilt_after_its_prefill,
    item_restored,
    item_restored_text_after_a_picture,
    item_whole,
    last,
    make_cache,
    make_cache_class,
    prefill_whole,
    reference_case,
    run_decode,
)
from tests.support.vendored import vendored

vendored()  # upstream's own package, where live, is measured by the checklist, not here

# --------------------------------------------------------------------------------- tests

ALL = ["text_short", "text_long", "img_448", "img_two"]
TEXT = ["text_short", "text_long"]


@pytest.fixture(scope="module")
def cases(reference) -> Dict[str, Case]:
    return {name: reference_case(reference, name) for name in ALL}


@pytest.mark.parametrize("style", sorted(DECODES))
@pytest.mark.parametrize("name", ALL)
def test_whole_prefill_then_decode(model, cases, name, style):
    """Decode with no positions, with the request's delta, with absolute positions, as vMLX."""
    item_whole(model, cases[name], style)


@pytest.mark.parametrize("name", TEXT)
def test_text_prefill_in_chunks_through_model_call(model, cases, name):
    """Rapid-MLX: each chunk continues from the cache offset (it used to restart at 0)."""
    item_model_chunks(model, cases[name])


@pytest.mark.parametrize("name", ALL)
def test_prefill_in_chunks_with_the_whole_prompts_kwargs(model, cases, name):
    item_lm_chunks(model, cases[name])


@pytest.mark.parametrize("mode", SUFFIX_MODES)
@pytest.mark.parametrize("name", TEXT)
def test_text_suffix_after_a_restored_prefix(model, cases, name, mode):
    """LM Studio: the suffix's own ``get_input_embeddings`` output, passed on unchanged."""
    item_restored(model, cases[name], cases[name].length // 2, mode)


@pytest.mark.parametrize("mode", ["model-call", "primed"])
@pytest.mark.parametrize("name", ["img_448", "img_two"])
def test_text_suffix_after_a_restored_image_prefix(model, cases, name, mode):
    """The suffix follows the delta kept with the cache: the image's, not zero."""
    item_restored(model, cases[name], cases[name].vision_end + 2, mode)


def test_text_embeddings_carry_no_positions_and_leave_no_state(model, cases):
    """As upstream's text prompts: no positions (the caller's cache decides), one zero delta
    per row (batching hosts concatenate deltas over rows), nothing left on the language model."""
    lm = model.language_model
    image = cases["img_448"]
    model.get_input_embeddings(image.ids, image.pixels, **image.extra)
    before = (lm._rope_deltas, lm._position_ids)
    emb = model.get_input_embeddings(cases["text_short"].ids)
    assert emb.position_ids is None
    assert np.array(emb.rope_deltas).tolist() == [[0]]
    assert (lm._rope_deltas, lm._position_ids) == before


@pytest.mark.skipif(not has_batch_caches(), reason="this pin's mlx-lm has no batch caches")
@pytest.mark.parametrize("rebuilt", [False, True], ids=["same-cache", "host-installed-delta"])
@pytest.mark.parametrize("name", ALL)
def test_decode_in_a_one_row_batch_cache_with_nothing_passed(model, cases, name, rebuilt):
    """Rapid-MLX: a request prefilled and decoded alone in a one-row batch cache, nothing
    passed at decode. Its media lane restores caches and installs the request's delta on the
    language model (``_media_mrope_install``): a cache that kept no delta of its own uses it."""
    item_one_row_batch(model, cases[name], installed_delta=rebuilt)


@pytest.mark.parametrize("name", ["img_448", "img_two"])
def test_decode_on_a_cache_rebuilt_after_its_own_prefill(model, cases, name):
    """Rapid-MLX merges caches of its own class into the pin's batch cache (nothing of ours kept):
    the delta the request's prefill published on the language model is its own."""
    item_rebuilt_after_its_prefill(model, cases[name])


@pytest.mark.parametrize("picture", ["img_448", "img_two"])
@pytest.mark.parametrize("name", TEXT)
def test_restored_text_prefix_after_a_picture_request(model, cases, name, picture):
    """Rapid-MLX's exact prefix cache: a text prompt's start restored from a snapshot saved by an
    earlier server (nothing of ours kept with it) right after a picture request was served; the
    suffix and decode must not take the picture's delta from the language model (it answered
    another text, HTTP 200, in its one-at-a-time lane)."""
    item_restored_text_after_a_picture(model, cases[name], cases[picture], cases[name].length // 2)


@pytest.mark.parametrize("style", ["neither", "rope_deltas"])
def test_two_requests_decoded_in_turn_keep_their_own_delta(model, cases, style):
    """Hosts serving concurrent streams on one event loop: a text request prefilled and decoded
    between a picture request's steps must not change the picture's tokens (or the reverse)."""
    item_interleaved(model, cases["img_448"], cases["text_long"], style)


def test_the_kept_delta_is_where_the_drivers_look(model):
    assert vendored("positions").KEPT == KEPT


def test_vmlx_marker_is_declared(model):
    """vMLX adds a request's own MRoPE delta to its decode positions only for language models
    that declare this (vmlx_engine/mllm_batch_generator.py, _request_rope_delta_rows)."""
    assert model.language_model.decode_positions_add_request_rope_delta is True


# ------------------------------------------------------------------ processor attributes


@pytest.fixture(scope="module")
def processor(tiny_ckpt_original):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_ckpt_original))


@pytest.mark.parametrize("bounds", [(64 * 64, 128 * 128), (32 * 32, 96 * 96)])
def test_assigned_pixel_bounds_take_effect(processor, tiny_ckpt_original, fixture_images, bounds):
    """Rapid-MLX sets ``image_processor.min_pixels`` / ``max_pixels`` around each request; the
    next call resizes exactly as a processor built with those bounds (tests/test_pixel_bounds.py
    ties that one to transformers')."""
    from transformers import AutoProcessor

    low, high = bounds
    image = fixture_images["synth_640x480.png"]
    ip = processor.image_processor
    saved = (ip.min_pixels, ip.max_pixels)
    try:
        ip.min_pixels, ip.max_pixels = low, high
        got = ip(image)
    finally:
        ip.min_pixels, ip.max_pixels = saved
    built = AutoProcessor.from_pretrained(str(tiny_ckpt_original), min_pixels=low, max_pixels=high).image_processor
    want = built(image)
    np.testing.assert_array_equal(np.asarray(got["image_grid_thw"]), np.asarray(want["image_grid_thw"]))
    np.testing.assert_array_equal(np.asarray(got["pixel_values"]), np.asarray(want["pixel_values"]))
    assert np.asarray(got["image_grid_thw"]).tolist() != np.asarray(ip(image)["image_grid_thw"]).tolist()


def test_pixel_bounds_that_cross_are_refused_by_name(processor, fixture_images):
    ip = processor.image_processor
    saved = (ip.min_pixels, ip.max_pixels)
    try:
        ip.min_pixels = ip.max_pixels + 1
        with pytest.raises(ValueError, match="min_pixels .* exceeds max_pixels"):
            ip(fixture_images["synth_448x448.png"])
        with pytest.raises(ValueError, match="min_pixels"):
            ip.min_pixels = 0
    finally:
        ip.min_pixels, ip.max_pixels = saved


# ------------------------------------------------------------------- vision-feature cache


class TowerCount:
    """Counts vision-tower runs of one model."""

    def __init__(self, model, monkeypatch):
        self.runs = 0
        tower = model.vision_tower
        original = type(tower).__call__

        def counted(this, *args, **kwargs):
            if this is tower:
                self.runs += 1
            return original(this, *args, **kwargs)

        monkeypatch.setattr(type(tower), "__call__", counted)


def vision_cache():
    try:
        from mlx_vlm.vision_cache import VisionFeatureCache
    except ImportError:
        pytest.skip("this pin has no mlx_vlm.vision_cache")
    return VisionFeatureCache()


def prefill_with(model, case: Case, **kwargs) -> np.ndarray:
    cache = make_cache(model)
    return last(model(case.ids, case.pixels, cache=cache, **case.extra, **kwargs))


def test_vision_cache_miss_puts_and_hit_runs_no_tower(model, cases, monkeypatch):
    """mlx-vlm's batched server, LM Studio's engine and Rapid-MLX pass ``vision_cache`` and
    ``_image_key``: a miss runs the tower once and stores it, a hit runs none, same logits."""
    store = vision_cache()
    towers = TowerCount(model, monkeypatch)
    case = cases["img_two"]
    first = prefill_with(model, case, vision_cache=store, _image_key=["a.png", "b.png"])
    assert towers.runs == 1 and len(store) == 1
    again = prefill_with(model, case, vision_cache=store, _image_key=["a.png", "b.png"])
    assert towers.runs == 1
    np.testing.assert_array_equal(again, first)
    assert float(np.abs(first - case.prefill_last).max()) < TOL


def other_picture_same_grid(model, cases) -> mx.array:
    """Features of img_two's first picture (synth_448x448_b): the same grid as img_448's
    picture (1, 28, 28), other pixels."""
    two = cases["img_two"]
    t, h, w = (int(v) for v in np.asarray(two.extra["image_grid_thw"])[0])
    assert [t, h, w] == np.asarray(cases["img_448"].extra["image_grid_thw"])[0].tolist()
    return model.encode_image(two.pixels[: t * h * w], mx.array([[t, h, w]]))


def test_vision_cache_never_serves_another_picture_under_the_same_key(model, cases, monkeypatch):
    """A file changed at the same path: the key and the grid match, the pixels do not."""
    store = vision_cache()
    store.put("photo.png", other_picture_same_grid(model, cases))
    towers = TowerCount(model, monkeypatch)
    case = cases["img_448"]
    got = prefill_with(model, case, vision_cache=store, _image_key="photo.png")
    assert towers.runs == 1
    assert float(np.abs(got - case.prefill_last).max()) < TOL
    again = prefill_with(model, case, vision_cache=store, _image_key="photo.png")  # now its own
    assert towers.runs == 1
    np.testing.assert_array_equal(again, got)


def test_replayed_features_of_other_pixels_are_not_used(model, cases):
    """mlx-vlm's stream_generate caches ``encode_image`` by path and passes it back next to the
    new pixels; features this model encoded from other pixels are re-encoded, not replayed."""
    case = cases["img_448"]
    got = prefill_with(model, case, cached_image_features=other_picture_same_grid(model, cases))
    assert float(np.abs(got - case.prefill_last).max()) < TOL


# ------------------------------------------------------- mlx-vlm's own generators, in turn


@pytest.fixture(scope="module")
def loaded(tiny_ckpt_original):
    from mlx_vlm import load

    return load(str(tiny_ckpt_original))


def test_two_stream_generate_generators_advanced_in_turn(loaded, reference, fixture_images):
    """Hosts that serve concurrent streams on one event loop advance one ``stream_generate``
    generator per request in turn: a text request started in the middle of a picture's stream
    must not change either stream's tokens."""
    from mlx_vlm import stream_generate

    model, processor = loaded
    streams, got = {}, {}  # not cases.stream_ids: two generators advanced in turn, not one drained
    for name in ("img_448", "text_long"):
        meta = reference(name)["meta"]
        images = [str(fixture_images[f]) for f in meta["images"]] or None
        streams[name] = stream_generate(
            model, processor, meta["prompt"], image=images, max_tokens=STEPS, temperature=0.0
        )
        got[name] = {}
    live = list(streams)
    while live:
        for name in list(live):
            result = next(streams[name], None)
            if result is None:
                live.remove(name)
                continue
            got[name].setdefault(int(result.generation_tokens), int(result.token))
    eos = model.config.eos_token_id
    for name in streams:
        want = reference(name)["greedy_ids"].tolist()[:STEPS]
        if eos in want:
            want = want[: want.index(eos) + 1]
        ids = [got[name][k] for k in sorted(got[name])]
        assert ids[: len(want)] == want, f"{name}: {ids} != reference {want}"


def test_vmlx_finds_a_full_attention_layer(model):
    """vMLX reads per-row cache offsets at ``language_model.model.fa_idx`` (without it, every row
    of a batch takes row 0's offset); it must name a full-attention layer."""
    index = model.language_model.model.fa_idx
    assert isinstance(index, int)
    assert model.language_model.layers[index].layer_type == "full_attention"
    assert all(layer.layer_type != "full_attention" for layer in model.language_model.layers[:index])


@pytest.mark.skipif(not hasattr(make_cache_class(), "merge"), reason="this pin's caches have no merge")
def test_requests_merged_into_one_batch_cache_keep_their_own_delta(model, cases):
    """Rapid-MLX's default batching: requests prefilled alone, their caches merged into one batch
    cache and decoded with nothing but the cache; a row finishes (filter), another is taken
    out and decoded alone (extract). Each row's delta travels with its row."""
    item_merged(model, [cases["text_long"], cases["img_448"], cases["img_two"], cases["text_short"]])


@pytest.mark.skipif(not hasattr(make_cache_class(), "merge"), reason="this pin's caches have no merge")
def test_merged_batch_led_by_a_restored_text_prefix_keeps_each_rows_delta(model, cases):
    """Rapid-MLX after a restart with its saved prefix snapshot: a restored text prompt (the pin's
    own cache classes) first in the batch, so its class's ``merge`` builds the batch cache; the
    picture rows still decode with their own deltas (f1 answered "Blue blue9, 409,")."""
    text = cases["text_long"]
    item_merged_after_a_restored_text_prefix(model, text, [cases["img_448"], cases["img_two"]], text.length // 2)


@pytest.mark.parametrize("given", ["text zeros", "nothing"])
@pytest.mark.parametrize("name", TEXT)
def test_text_suffix_on_a_cache_trimmed_back_from_a_picture_request(model, cases, name, given):
    """LM Studio's prompt cache: a cache that served a picture request is trimmed back to the
    tokens a text prompt shares with it, and the text prompt's suffix is embedded alone, its
    zero deltas passed on ("text zeros"), or fed with nothing but the cache ("nothing"). The
    picture's delta, still kept with the cache's first layer, holds only past the picture: here
    the text's own positions do, either way (positions.py's table). Before the room, "nothing"
    took the kept delta anyway. (The tiny sliding window cannot be trimmed, so the trimmed cache
    is the shared tokens plus what the served cache kept.)"""
    picture, text = cases["img_448"], cases[name]
    served = make_cache(model)
    prefill_whole(model, picture, served)
    split = 3  # BOS and the user turn's opening tokens: every prompt of the template shares them
    assert np.array(picture.ids[0, :split]).tolist() == np.array(text.ids[0, :split]).tolist()
    cache = make_cache(model)
    mx.eval(model(text.ids[:, :split], cache=cache).logits)
    mine, theirs = getattr(cache[0], KEPT), getattr(served[0], KEPT)
    mine.delta, mine.since = theirs.delta, theirs.since  # the served cache's delta and where it holds
    mine.reached = cache[0].max_size  # set back: it held more than it holds now (never past its window)
    suffix = text.ids[:, split:]
    emb = model.get_input_embeddings(suffix, None)
    kwargs = {k: v for k, v in emb.to_dict().items() if v is not None and k != "inputs_embeds"}
    if given == "nothing":
        kwargs = {}
    first = last(model.language_model(suffix, inputs_embeds=emb.inputs_embeds, cache=cache, **kwargs))
    check(text, run_decode(model, cache, text, first, decode_plain), f"text suffix on a trimmed picture cache, {given}")
