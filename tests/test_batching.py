"""The decoder under host engines' batch caches: every row equals the reference.

Continuous-batching hosts (mlx-lm's and mlx-vlm's BatchGenerator, oMLX) decode several
sequences at once with ``BatchKVCache`` / ``BatchRotatingKVCache``: rows left-padded, a
per-row ``offset`` array that the cache updates in place, rows merged in, filtered out,
extended and extracted while the others keep decoding. Each row here is a recorded reference
case (text of three lengths, one image, two images, videos); its prefill logits and every
teacher-forced decode step are compared with transformers' on the same weights, so a row that
borrows another row's rope delta, or rotates with a stale offset, fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Dict, List

import mlx.core as mx
import numpy as np
import pytest

from tests.support.cases import case_inputs
from tests.support.parity import image_kwargs
from tests.support.recorded import video_case
from tests.support.vendored import vendored

vendored()  # upstream's own package, where live, is measured by the checklist, not here
TOL = 1e-4
STEPS = 12  # decode steps per row; the short text row wraps its sliding window (8 tokens)


def _batch_cache_modules():
    out = []
    for name in ("mlx_lm.models.cache", "mlx_vlm.models.cache"):
        module = importlib.import_module(name)
        if hasattr(module, "BatchKVCache") and hasattr(module, "BatchRotatingKVCache"):
            out.append(pytest.param(module, id=name.split(".")[0]))
    return out


CACHE_MODULES = _batch_cache_modules()
needs_batch_caches = pytest.mark.skipif(not CACHE_MODULES, reason="no batch caches in this pin's mlx-lm / mlx-vlm")


def batch_cache(model, module, left_padding: List[int]):
    return [
        module.BatchRotatingKVCache(layer.self_attn.window, left_padding)
        if layer.layer_type == "sliding_attention"
        else module.BatchKVCache(left_padding)
        for layer in model.language_model.layers
    ]


class Row:
    """One sequence: its reference case, prompt inputs, and how far it has decoded."""

    def __init__(self, model, case: Dict):
        self.case = case
        ids, pixels, extra = case_inputs(case)
        self.length = ids.shape[1]
        if extra:  # an image or video prompt
            emb = model.get_input_embeddings(ids, pixels, **extra)
            self.embeds, self.positions = emb.inputs_embeds, emb.position_ids
            self.deepstack = emb.deepstack_visual_embeds
            self.delta = int(np.asarray(case["rope_deltas"]).reshape(-1)[0])
        else:
            self.embeds = model.language_model.model.embed_tokens(ids)
            self.positions = mx.broadcast_to(mx.arange(self.length)[None, None], (3, 1, self.length))
            K = len(model.config.vision_config.deepstack_visual_indexes)
            self.deepstack = mx.zeros((1, self.length, K, self.embeds.shape[-1]), self.embeds.dtype)
            self.delta = 0
        self.step = 0  # the next reference greedy step whose logits this row produces

    def token(self) -> int:
        return int(self.case["greedy_ids"][self.step])

    def check(self, logits: mx.array, where: str) -> None:
        want = self.case["greedy_logits"][self.step + 1]
        diff = np.abs(np.array(logits) - want).max()
        assert diff < TOL, f"{where}: step {self.step + 1} off by {diff:.3g}"
        self.step += 1


def left_pad(arrays: List[mx.array], axis: int, width: int) -> mx.array:
    out = []
    for a in arrays:
        pad = width - a.shape[axis]
        if pad:
            shape = list(a.shape)
            shape[axis] = pad
            a = mx.concatenate([mx.zeros(shape, a.dtype), a], axis=axis)
        out.append(a)
    return out


def merged_prompt(rows: List[Row]):
    """The rows' prompt inputs left-padded and stacked, as mlx-vlm's BatchGenerator merges them:
    (embeds [B, W, D], position_ids [3, B, W], deepstack [B, W, K, D])."""
    width = max(r.length for r in rows)
    embeds = mx.concatenate(left_pad([r.embeds for r in rows], 1, width), axis=0)
    positions = mx.concatenate(left_pad([r.positions for r in rows], 2, width), axis=1)
    deepstack = mx.concatenate(left_pad([r.deepstack for r in rows], 1, width), axis=0)
    return embeds, positions, deepstack


def check_prefill(rows: List[Row], logits: mx.array, names: List[str], what: str) -> None:
    width = logits.shape[1]
    for b, r in enumerate(rows):
        diff = np.abs(np.array(logits[b, width - r.length :]) - r.case["prefill_logits"]).max()
        assert diff < TOL, f"{names[b]}: {what} off by {diff:.3g}"


def batched_prefill(model, rows: List[Row], cache, names: List[str]) -> mx.array:
    """Left-padded prefill of all rows at once."""
    embeds, positions, deepstack = merged_prompt(rows)
    logits = model.language_model(
        None, inputs_embeds=embeds, cache=cache, position_ids=positions, deepstack_visual_embeds=deepstack
    ).logits
    check_prefill(rows, logits, names, "batched prefill")
    return logits


def decode_step(model, rows: List[Row], cache, style: str, names: List[str]) -> None:
    tokens = mx.array([[r.token()] for r in rows])
    kwargs = {}
    if style == "rope_deltas":  # mlx-vlm 0.6+'s BatchGenerator: per-row deltas every step
        kwargs["rope_deltas"] = mx.array([[r.delta] for r in rows])
    elif style == "position_ids":  # oMLX: positions = cache offset + per-row delta
        offset = cache[0].offset + mx.array([r.delta for r in rows])
        kwargs["position_ids"] = mx.broadcast_to(offset[None, :, None], (3, len(rows), 1))
    logits = model.language_model(tokens, cache=cache, **kwargs).logits
    for b, r in enumerate(rows):
        r.check(logits[b, -1], f"{names[b]} ({style})")


MIXED = ["text_short", "img_448", "text_long", "img_two"]
# A video row among text and image rows (video cases: tests/fixtures/video_model).
WITH_VIDEO = ["text_short", "video_4f", "img_448", "video_and_image"]


def case_of(reference, name: str) -> Dict:
    return video_case("tiny", name) if name.startswith("video") else reference(name)


@needs_batch_caches
@pytest.mark.parametrize("module", CACHE_MODULES)
@pytest.mark.parametrize("style", ["rope_deltas", "position_ids"])
@pytest.mark.parametrize("names", [MIXED, WITH_VIDEO], ids=["text+image", "text+image+video"])
def test_left_padded_batch_of_mixed_rows_matches_the_reference(model, reference, module, style, names):
    rows = [Row(model, case_of(reference, n)) for n in names]
    width = max(r.length for r in rows)
    cache = batch_cache(model, module, [width - r.length for r in rows])
    batched_prefill(model, rows, cache, names)
    for r in rows:
        r.step = 0
        # The prefill's last logits are greedy step 0; decoding feeds greedy token 0 onwards.
    for _ in range(STEPS):
        decode_step(model, rows, cache, style, names)


@needs_batch_caches
@pytest.mark.parametrize("module", CACHE_MODULES)
@pytest.mark.parametrize("names", [["text_medium"], ["text_short", "text_medium", "text_long"]], ids=["1row", "3rows"])
def test_text_rows_through_token_ids_alone(model, reference, module, names):
    """mlx-lm's own BatchGenerator: left-padded token ids, no positions or deltas passed.

    One row is enough to catch a rotary offset aliased to the cache's (updated in layer 0).
    """
    rows = [Row(model, reference(n)) for n in names]
    width = max(r.length for r in rows)
    ids = mx.array([[0] * (width - r.length) + r.case["input_ids"][0].tolist() for r in rows])
    cache = batch_cache(model, module, [width - r.length for r in rows])
    check_prefill(rows, model.language_model(ids, cache=cache).logits, names, "prefill")
    for _ in range(STEPS):
        decode_step(model, rows, cache, "none", names)


def single_prefill(model, row: Row):
    """One row alone, with the model's own single-sequence caches (as hosts prefill)."""
    cache = model.language_model.make_cache()
    model.language_model(
        None,
        inputs_embeds=row.embeds,
        cache=cache,
        position_ids=row.positions,
        deepstack_visual_embeds=row.deepstack,
    )
    return cache


def merged(module, per_row_caches):
    """Per layer, the batch cache the BatchGenerator builds from single-sequence caches."""
    out = []
    for layer_caches in zip(*per_row_caches):
        rotating = hasattr(layer_caches[0], "max_size")
        cls = module.BatchRotatingKVCache if rotating else module.BatchKVCache
        out.append(cls.merge(list(layer_caches)))
    return out


def rotating_merge_fails_past_the_window(module) -> bool:
    """Whether ``module``'s BatchRotatingKVCache.merge refuses a RotatingKVCache prefilled past its
    window (the hook looked for: that ValueError, on a 4-slot cache fed 6 positions)."""
    cache = module.RotatingKVCache(max_size=4)
    keys = mx.zeros((1, 1, 6, 2))
    cache.update_and_fetch(keys, keys)
    try:
        module.BatchRotatingKVCache.merge([cache])
    except ValueError:
        return True
    return False


@needs_batch_caches
@pytest.mark.parametrize("module", CACHE_MODULES)
def test_merge_filter_extend_extract_keep_every_row_right(model, reference, module, request):
    if module.__name__.startswith("mlx_lm") and rotating_merge_fails_past_the_window(module):
        # mlx-lm 0.28's BatchRotatingKVCache.merge slices by offset, not by the buffer it holds:
        # a cache prefilled past its window cannot be merged (the pin's bug, fixed by 0.31).
        request.applymarker(
            pytest.mark.xfail(
                raises=ValueError, strict=True, reason="mlx-lm 0.28 cannot merge a rotating cache past its window"
            )
        )
    names = ["img_448", "text_medium", "text_long"]
    rows = [Row(model, reference(n)) for n in names]
    cache = merged(module, [single_prefill(model, r) for r in rows])
    for _ in range(3):
        decode_step(model, rows, cache, "rope_deltas", names)
    # The text row finishes: filter it out; the others go on.
    for c in cache:
        c.filter([0, 2])
    rows, names = [rows[0], rows[2]], [names[0], names[2]]
    for _ in range(2):
        decode_step(model, rows, cache, "rope_deltas", names)
    # A new request joins: prefilled alone, merged, then extended into the running batch.
    newcomers = [Row(model, reference("img_two")), Row(model, video_case("tiny", "video_two"))]
    joined = merged(module, [single_prefill(model, r) for r in newcomers])
    for c, j in zip(cache, joined):
        c.extend(j)
    rows, names = rows + newcomers, names + ["img_two", "video_two"]
    for _ in range(4):
        decode_step(model, rows, cache, "rope_deltas", names)
    # One row leaves the batch as a single-sequence cache and decodes alone (its delta as an int).
    if not all(hasattr(c, "extract") for c in cache):
        return
    alone = [c.extract(0) for c in cache]
    row = rows[0]
    for _ in range(3):
        out = model.language_model(mx.array([[row.token()]]), cache=alone, rope_deltas=row.delta).logits
        row.check(out[0, -1], f"{names[0]} extracted")


@needs_batch_caches
@pytest.mark.parametrize("module", CACHE_MODULES)
def test_batch_decode_does_not_use_the_last_prefills_delta(model, reference, module):
    """The module-level delta is one sequence's; a batch row without a delta gets its own (0)."""
    names = ["text_medium", "text_short"]
    image = Row(model, reference("img_640x480"))
    single_prefill(model, image)  # leaves _rope_deltas = this image's delta on the module
    assert model.language_model._rope_deltas is not None
    rows = [Row(model, reference(n)) for n in names]
    width = max(r.length for r in rows)
    cache = batch_cache(model, module, [width - r.length for r in rows])
    batched_prefill(model, rows, cache, names)
    model.language_model._rope_deltas = mx.array([[image.delta]])  # as a host that prefilled it last
    for _ in range(4):
        decode_step(model, rows, cache, "none", names)


@needs_batch_caches
@pytest.mark.parametrize("module", CACHE_MODULES)
def test_batch_decode_builds_its_graph_without_host_sync(model, reference, module):
    from tests.support.host_sync import HostSyncGuard

    names = ["img_448", "text_long"]
    rows = [Row(model, reference(n)) for n in names]
    width = max(r.length for r in rows)
    cache = batch_cache(model, module, [width - r.length for r in rows])
    batched_prefill(model, rows, cache, names)
    deltas = mx.array([[r.delta] for r in rows])
    tokens = mx.array([[r.token()] for r in rows])
    mx.eval(deltas, tokens)
    for style in ("rope_deltas", "none"):
        with HostSyncGuard("raise"):
            out = model.language_model(tokens, cache=cache, **({"rope_deltas": deltas} if style != "none" else {}))
        mx.eval(out.logits)


def test_hosts_see_an_mrope_model(model):
    """oMLX and servers on mlx-vlm key their per-request rope-delta bookkeeping on this test."""
    text = model.config.text_config
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None)
    assert isinstance(rope, dict) and "mrope_section" in rope
    sliding = text.rope_parameters["sliding_attention"]
    assert rope["mrope_section"] == list(sliding["mrope_section"])
    assert rope["rope_theta"] == sliding["rope_theta"]
    # The view does not change what the config means: full-attention layers stay unrotated.
    assert text.rope_for("full_attention") is None


def test_get_input_embeddings_leaves_the_prompt_state_hosts_read(model, reference):
    case = reference("img_501x379")
    kw = image_kwargs(case)
    model.get_input_embeddings(mx.array(case["input_ids"]), kw.pop("pixel_values"), **kw)
    lm = model.language_model
    np.testing.assert_array_equal(np.array(lm._position_ids), case["position_ids"])
    assert np.array(lm._rope_deltas).reshape(-1).tolist() == np.asarray(case["rope_deltas"]).reshape(-1).tolist()


@pytest.mark.parametrize("name", ["img_two", "text_medium"])
def test_get_rope_index_method_matches_the_reference(model, reference, name):
    """``language_model.get_rope_index`` (mlx-vlm 0.7.x primes prefix-cache trims with it)."""
    case = reference(name)
    grid = mx.array(case["image_grid_thw"]) if "image_grid_thw" in case else None
    position_ids, deltas = model.language_model.get_rope_index(mx.array(case["input_ids"]), grid, None, None)
    L = case["input_ids"].shape[1]
    want = case["position_ids"] if "position_ids" in case else np.broadcast_to(np.arange(L), (3, 1, L))
    want_delta = np.asarray(case["rope_deltas"]).reshape(-1) if "rope_deltas" in case else np.zeros(1)
    np.testing.assert_array_equal(np.array(position_ids), want)
    assert np.array(deltas).shape == (1, 1) and np.array(deltas).reshape(-1).tolist() == want_delta.tolist()
    # A video grid for a prompt without video tokens is named, not ignored.
    with pytest.raises(ValueError, match=r"video_grid_thw describes 2 temporal patch\(es\) but the prompt has video"):
        model.language_model.get_rope_index(mx.array(case["input_ids"]), grid, mx.array([[2, 4, 4]]), None)


def test_primed_delta_positions_a_cached_prefix_suffix(model, reference):
    """A prefix-cache hit: the cached prefix is replayed, only the suffix is prefilled with
    positions offset + the delta primed from the whole prompt (mlx-vlm 0.7.x's APC)."""
    case = reference("img_448")
    ids = mx.array(case["input_ids"])
    kw = image_kwargs(case)
    emb = model.get_input_embeddings(ids, kw.pop("pixel_values"), **kw)
    cache = model.language_model.make_cache()
    cut = case["input_ids"].shape[1] - 6  # the suffix is the last six (text) tokens
    model.language_model(
        None,
        inputs_embeds=emb.inputs_embeds[:, :cut],
        cache=cache,
        position_ids=emb.position_ids[..., :cut],
        deepstack_visual_embeds=emb.deepstack_visual_embeds[:, :cut],
    )
    _, deltas = model.language_model.get_rope_index(ids, mx.array(case["image_grid_thw"]))
    out = model.language_model(ids[:, cut:], cache=cache, rope_deltas=deltas).logits
    diff = np.abs(np.array(out[0]) - case["prefill_logits"][cut:]).max()
    assert diff < TOL, f"suffix after a cached prefix off by {diff:.3g}"


@needs_batch_caches
@pytest.mark.parametrize("module", CACHE_MODULES)
@pytest.mark.parametrize("chunk", [16, 37])
def test_chunked_batched_prefill_matches_the_reference(model, reference, module, chunk):
    """mlx-vlm 0.6+'s BatchGenerator prefills a left-padded batch in column chunks (its prefix
    cache checkpoints every block), slicing the sequence-aligned kwargs itself."""
    names = ["img_448", "text_long", "img_448", "text_short"]
    rows = [Row(model, reference(n)) for n in names]
    width = max(r.length for r in rows)
    cache = batch_cache(model, module, [width - r.length for r in rows])
    embeds, positions, deepstack = merged_prompt(rows)
    deltas = mx.array([[r.delta] for r in rows])
    pieces = []
    for s in range(0, width, chunk):
        out = model.language_model(
            None,
            inputs_embeds=embeds[:, s : s + chunk],
            cache=cache,
            position_ids=positions[..., s : s + chunk],
            deepstack_visual_embeds=deepstack[:, s : s + chunk],
            rope_deltas=deltas,
        ).logits
        pieces.append(out)
    check_prefill(rows, mx.concatenate(pieces, axis=1), names, "chunked batched prefill")
    for _ in range(4):
        decode_step(model, rows, cache, "rope_deltas", names)


@needs_batch_caches
@pytest.mark.parametrize("module", CACHE_MODULES)
@pytest.mark.xfail(
    strict=True,
    reason="mlx-lm/mlx-vlm BatchRotatingKVCache: a one-column chunk in a left-padded "
    "prefill gives wrong attention to a row whose padding exceeds the window (not ours; documented)",
)
def test_known_upstream_bug_one_column_prefill_chunk_in_a_rotating_batch_cache(module):
    """Plain attention, no model of ours: the chunking of a prefill must not change a row's output.

    mlx-vlm 0.6+'s server, with its prefix cache on, cuts a batch's prefill at each row's
    checkpoint column, which can make such a one-column chunk; a row of that batch then
    answers differently from the same request alone (seen with this model's tiny checkpoint).
    """
    window, dims, lengths = 8, 4, [211, 42]
    width = max(lengths)
    pads = [width - n for n in lengths]
    q, k, v = (mx.array(np.random.default_rng(i).standard_normal((2, 1, width, dims)), mx.float32) for i in range(3))

    def attend(cuts):
        cache = module.BatchRotatingKVCache(window, pads)
        bounds, outs = [0, *cuts, width], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            mask = cache.make_mask(b - a, window_size=window, return_array=True)
            keys, values = cache.update_and_fetch(k[..., a:b, :], v[..., a:b, :])
            outs.append(mx.fast.scaled_dot_product_attention(q[..., a:b, :], keys, values, scale=1.0, mask=mask))
        return mx.concatenate(outs, axis=2)

    whole, cut = attend([]), attend([134, 135])
    for b in range(2):
        assert mx.allclose(whole[b, :, pads[b] :], cut[b, :, pads[b] :], atol=1e-5), f"row {b} depends on the chunking"
