"""The torch-free processor: pixels and token ids equal to transformers' cohere_compass.

The reference (transformers >= 5.21: ``CohereCompassImageProcessorPil`` and
``CohereCompassProcessor``) runs live; tests that need it skip, saying so, where it is
absent (transformers < 5.21 pins). The rest is checked by exact arithmetic and runs everywhere.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from compass_data import tiny
from tests.support.reference_probe import reference_problem
from tests.support.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from tests.support.vendored import VENDORED_DIR, by_path, default_run_only

ROOT = Path(__file__).resolve().parents[1]

# By path, not through the shim: these modules need neither mlx nor the patch, and must be
# tested even on pins where upstream's cohere_compass shadows the vendored package.
pc = by_path("processing_cohere_compass", "compass_processing_under_test")
pytestmark = default_run_only
ipc = by_path("image_processing_cohere_compass", "compass_processing_under_test")

# The published preprocessor_config.json values, without the keys that name classes.
CONFIG = dict(tiny.PUBLISHED_IMAGE_PROCESSOR)
REFERENCE_REASON = "the reference is transformers' native cohere_compass (transformers >= 5.21); not installed here"
USER_IMAGE = {"type": "image"}


def reference_module(name: str):
    # transformers ships cohere_compass before 5.21, but its image processor differs there
    # (measured with 5.17: LA/RGBA/palette/colour-key/1-channel images give other pixels, and
    # call-time min/max_pixels apply only as a pair); such a one is skipped like a missing one
    # (tests/support/reference_probe.py looks for the behaviour).
    problem = reference_problem()
    if problem is not None:
        pytest.skip(f"{REFERENCE_REASON}: {problem}")
    try:
        return importlib.import_module(f"transformers.models.cohere_compass.{name}")
    except ImportError:
        pytest.skip(REFERENCE_REASON)


def reference_image_processor(**overrides):
    cls = reference_module("image_processing_pil_cohere_compass").CohereCompassImageProcessorPil
    return cls(**{**CONFIG, **overrides})


def ours(**overrides):
    return pc.CohereCompassImageProcessor(**{**CONFIG, **overrides})


# ---------------------------------------------------------------- synthetic images


def noise(width, height, channels=3, seed=0):
    shape = (height, width) if channels == 1 else (height, width, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def rgb(width, height, seed=0):
    return Image.fromarray(noise(width, height, 3, seed), mode="RGB")


def palette(width, height, seed=0, transparency=False):
    image = rgb(width, height, seed).quantize(colors=48)
    if transparency:
        image.info["transparency"] = 5
    return image


def uint16_image(width, height, seed=0):
    values = np.random.default_rng(seed).integers(0, 65536, (height, width), dtype=np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    return image


def rgb_with_colour_key(width, height, seed=0):
    image = Image.fromarray(noise(width, height, 3, seed) // 64 * 64, mode="RGB")
    image.info["transparency"] = (64, 128, 192)
    return image


# (image factory, config overrides) per case; every image is deterministic.
PIXEL_CASES = {
    "448x448": (lambda: rgb(448, 448, 1), {}),
    "640x480": (lambda: rgb(640, 480, 2), {}),
    "501x379": (lambda: rgb(501, 379, 3), {}),
    "20x20-upscaled-to-min-pixels": (lambda: rgb(20, 20, 4), {}),
    "above-max-pixels": (lambda: rgb(1200, 900, 5), {"size": {"shortest_edge": 4096, "longest_edge": 262144}}),
    "grayscale-L": (lambda: Image.fromarray(noise(333, 250, 1, 6), mode="L"), {}),
    "LA": (lambda: Image.fromarray(noise(300, 200, 2, 7), mode="LA"), {}),
    "RGBA": (lambda: Image.fromarray(noise(320, 240, 4, 8), mode="RGBA"), {}),
    "palette-P": (lambda: palette(280, 210, 9), {}),
    "palette-P-with-transparency": (lambda: palette(280, 210, 10, transparency=True), {}),
    "RGB-with-colour-key": (lambda: rgb_with_colour_key(256, 256, 11), {}),
    "CMYK": (lambda: Image.fromarray(noise(260, 300, 4, 12), mode="CMYK"), {}),
    "I;16": (lambda: uint16_image(256, 300, 13), {}),
    "bilevel-1": (lambda: Image.fromarray(noise(300, 260, 1, 14) > 127), {}),
    "numpy-HWC-uint8": (lambda: noise(300, 220, 3, 15), {}),
    "numpy-CHW-uint8": (lambda: noise(300, 220, 3, 16).transpose(2, 0, 1).copy(), {}),
    "numpy-HWC-RGBA-uint8": (lambda: noise(300, 220, 4, 17), {}),
    "numpy-HW1-gray": (lambda: noise(300, 220, 1, 18)[..., None], {}),
    "numpy-float-0-255": (lambda: noise(300, 220, 3, 19).astype(np.float32), {}),
    # The reference scales [0, 1] floats up for PIL and back after resizing, and rescales
    # once more with do_rescale; do_rescale=False is the way to pass them.
    "numpy-float-0-1": (lambda: noise(300, 220, 3, 20) / 255.0, {"do_rescale": False}),
    "numpy-float-0-1-rescaled-twice": (lambda: noise(300, 220, 3, 20) / 255.0, {}),
    "no-resize-224x160": (lambda: rgb(224, 160, 21), {"do_resize": False}),
    "numpy-float-no-resize": (lambda: noise(192, 128, 3, 22).astype(np.float32), {"do_resize": False}),
}


@pytest.mark.parametrize("case", list(PIXEL_CASES))
def test_pixels_match_the_reference(case):
    make, overrides = PIXEL_CASES[case]
    expected = reference_image_processor(**overrides)(make(), return_tensors="np")
    got = ours(**overrides)(make(), return_tensors="np")
    np.testing.assert_array_equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert got["pixel_values"].dtype == np.float32
    assert got["pixel_values"].shape == expected["pixel_values"].shape
    assert np.max(np.abs(got["pixel_values"] - expected["pixel_values"])) <= 1e-6


def test_several_images_in_one_call_match_the_reference():
    images = [rgb(448, 448, 1), rgb(501, 379, 3), Image.fromarray(noise(64, 40, 1, 2), mode="L")]
    expected = reference_image_processor()(images, return_tensors="np")
    got = ours()(images)
    np.testing.assert_array_equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert np.max(np.abs(got["pixel_values"] - expected["pixel_values"])) <= 1e-6


@pytest.mark.parametrize("as_path", [False, True], ids=["str", "pathlib.Path"])
@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_image_files_match_the_reference(tmp_path, mode, as_path):
    channels = {"RGB": 3, "RGBA": 4}[mode]
    file = tmp_path / f"image-{mode}.png"
    Image.fromarray(noise(310, 230, channels, 21), mode=mode).save(file)
    expected = reference_image_processor()(str(file), return_tensors="np")  # the reference takes str only
    got = ours()(file if as_path else str(file))
    np.testing.assert_array_equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert np.max(np.abs(got["pixel_values"] - expected["pixel_values"])) <= 1e-6


# ---------------------------------------------------------------- large non-RGB images


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_large_non_rgb_image_matches_the_reference(mode):
    """A 2100x2050 non-RGB picture, end to end against the reference processor."""
    base = noise(2100, 2050, {"L": 1, "RGBA": 4, "P": 3}[mode], 30)
    image = Image.fromarray(base).quantize(colors=64) if mode == "P" else Image.fromarray(base, mode=mode)
    bounds = {"size": {"shortest_edge": 65536, "longest_edge": 1048576}}
    got = ours(**bounds)(image)
    expected = reference_image_processor(**bounds)(image, return_tensors="np")
    np.testing.assert_array_equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert np.max(np.abs(got["pixel_values"] - expected["pixel_values"])) <= 1e-6


# ---------------------------------------------------------------- exact arithmetic


@pytest.mark.parametrize(
    "height, width, max_pixels, expected",
    [
        (448, 448, 16777216, (448, 448)),
        (480, 640, 16777216, (480, 640)),
        (379, 501, 16777216, (384, 512)),  # rounded to the nearest multiple of 32
        (20, 20, 16777216, (256, 256)),  # scaled up to 65536 pixels, rounded up
        (900, 1200, 262144, (416, 576)),  # scaled down under max, rounded down
        (20, 4000, 16777216, (32, 4000)),  # aspect ratio exactly 200 is accepted
    ],
)
def test_smart_resize_table(height, width, max_pixels, expected):
    assert ipc.smart_resize(height, width, 32, 65536, max_pixels) == expected


def test_grid_and_token_count_of_the_published_example():
    out = ours()(rgb(448, 448))
    np.testing.assert_array_equal(out["image_grid_thw"], [[1, 28, 28]])
    assert out["pixel_values"].shape == (784, 3 * 2 * 16 * 16)
    assert ours().num_image_tokens(448, 448) == 196
    assert ours().num_image_tokens(900, 1200, max_pixels=262144) == (416 // 32) * (576 // 32)


def test_patches_are_in_merge_window_order():
    # Channel 0 holds the row, channel 1 the column: every patch value says where it came from.
    ys, xs = np.mgrid[0:64, 0:96]
    image = np.stack([ys, xs, np.full_like(ys, 7)], axis=-1).astype(np.uint8)
    ip = ours(do_resize=False, do_rescale=False, do_normalize=False)
    out = ip(image)
    np.testing.assert_array_equal(out["image_grid_thw"], [[1, 4, 6]])
    rows = out["pixel_values"].reshape(-1, 3, 2, 16, 16)
    k = 0
    for block_row in range(2):
        for block_col in range(3):
            for in_row in range(2):
                for in_col in range(2):
                    top, left = (2 * block_row + in_row) * 16, (2 * block_col + in_col) * 16
                    for frame in range(2):  # a still image is repeated over both frames
                        np.testing.assert_array_equal(rows[k, 0, frame], ys[top : top + 16, left : left + 16])
                        np.testing.assert_array_equal(rows[k, 1, frame], xs[top : top + 16, left : left + 16])
                        assert np.all(rows[k, 2, frame] == 7)
                    k += 1


def test_rescale_and_normalize_values():
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    image[..., 1] = 255
    out = ours(do_resize=False)(image)["pixel_values"].reshape(-1, 3, 2, 16, 16)
    assert np.all(out[:, 0] == -1.0) and np.all(out[:, 1] == 1.0)


# ---------------------------------------------------------------- errors


def test_aspect_ratio_over_200_is_refused():
    with pytest.raises(ValueError, match="aspect ratio 201.0.*at most 200"):
        ours()(Image.new("RGB", (4020, 20)))
    with pytest.raises(ValueError, match="aspect ratio"):
        ours().num_image_tokens(1, 300)


def test_reference_refuses_the_same_aspect_ratio():
    with pytest.raises(ValueError, match="aspect ratio"):
        reference_image_processor()(Image.new("RGB", (4020, 20)))


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"patch_size": 0}, "patch_size"),
        ({"merge_size": -2}, "merge_size"),
        ({"temporal_patch_size": 0}, "temporal_patch_size"),
        ({"patch_size": 16.0}, "patch_size"),
        ({"size": {"shortest_edge": 0, "longest_edge": 1000}}, "size.shortest_edge"),
        ({"size": {"shortest_edge": 100, "longest_edge": -1}}, "size.longest_edge"),
        ({"size": {"shortest_edge": 5000, "longest_edge": 4000}}, "exceeds `size.longest_edge`"),
        ({"min_pixels": 0}, "min_pixels"),
        ({"max_pixels": 10, "min_pixels": 20}, "exceeds"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"rescale_factor": 0}, "rescale_factor"),
        ({"resample": 99}, "resample"),
    ],
)
def test_bad_preprocessor_values_name_the_key(overrides, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        ours(**overrides)
    config = {k: v for k, v in CONFIG.items() if k not in overrides}
    with pytest.raises(ValueError):  # the same through preprocessor_config.json
        pc.CohereCompassImageProcessor.from_dict({**config, **overrides})


def test_legacy_pixel_keys_override_size():
    ip = pc.CohereCompassImageProcessor.from_dict({**CONFIG, "min_pixels": 1024, "max_pixels": 8192})
    assert ip.size == {"shortest_edge": 1024, "longest_edge": 8192}
    assert (ip.min_pixels, ip.max_pixels) == (1024, 8192)


def test_unreadable_files_raise_value_error_naming_the_file(tmp_path):
    good = io.BytesIO()
    rgb(200, 200).save(good, format="PNG")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("this is text")
    for path in (truncated, not_an_image, tmp_path / "missing.jpg", tmp_path):
        with pytest.raises(ValueError, match=path.name):
            ours()(path)
        with pytest.raises(ValueError, match=path.name):
            ours()(str(path))


def test_non_images_raise_value_error():
    for bad in (42, {"image": 1}, np.zeros((5, 5, 7), np.uint8)):
        with pytest.raises(ValueError):
            ours()(bad)
    with pytest.raises(ValueError, match="URL"):
        ours()("https://example.invalid/cat.png")


@pytest.mark.parametrize(
    "array, overrides, words",
    [
        (np.zeros(40, np.uint8), {}, r"image array must have 2 or 3 dimensions, got shape \(40,\)"),
        (np.full((40, 40, 4), 2.0, np.float32), {}, r"a float RGBA image must hold values in \[0, 1\]"),
        (np.zeros((40, 40, 4), np.uint8), {"do_convert_rgb": False}, r"expected an RGB image, got 4 channel\(s\)"),
    ],
    ids=["1-d", "float-rgba-above-1", "rgba-without-convert"],
)
def test_arrays_it_cannot_read_are_refused_by_name(array, overrides, words):
    with pytest.raises(ValueError, match=words):
        ours(**overrides)(array)


@pytest.mark.parametrize(
    "array, words",
    [
        (np.zeros((40, 40, 7), np.uint8), r"^Unable to infer channel dimension format$"),
        (np.full((40, 40, 3), 300.0, np.float32), r"outside the range \[0, 255\], got \[300\.0, 300\.0\]"),
        (np.full((40, 40, 3), 1.5, np.float32), r"outside the range \[0, 1\], got \[1\.5, 1\.5\]"),
    ],
    ids=["7-channels", "above-255", "fractions-above-1"],
)
def test_transformers_own_refusal_of_an_array_reaches_the_caller_in_one_line(array, words):
    """transformers' channel inference and PIL conversion (the reference's own) refuse these."""
    with pytest.raises(ValueError, match=words) as err:
        ours()(array)
    assert "\n" not in str(err.value)


def test_huge_inputs_are_resized_before_any_float_copy():
    # A full-resolution float32 copy of this image is 324 MB and a uint8 numpy one 81 MB;
    # everything numpy allocates here must stay near the size of the output.
    width, height = 6000, 4500
    image = Image.effect_noise((width, height), 64).convert("RGB")
    array = np.asarray(image)
    ip = ours(size={"shortest_edge": 4096, "longest_edge": 262144})
    for source in (image, array):
        tracemalloc.start()
        try:
            out = ip(source)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert out["pixel_values"].shape[0] * 256 <= 262144
        assert peak < 40e6, f"numpy peaked at {peak / 1e6:.0f} MB for a {width}x{height} input"


# ---------------------------------------------------------------- the processor


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def processor(tokenizer):
    return pc.CohereCompassProcessor(image_processor=ours(), tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def reference_processor(tokenizer):
    base = reference_module("processing_cohere_compass").CohereCompassProcessor

    class ReferenceWithoutVideo(base):
        # No torchvision here, so no video processor: let the reference accept None for it.
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ReferenceWithoutVideo(image_processor=reference_image_processor(), tokenizer=tokenizer, video_processor=None)


def render(processor, *parts):
    content = [USER_IMAGE if p is USER_IMAGE else {"type": "text", "text": p} for p in parts]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


PROMPTS = {
    "one-image": (("describe this image",), [USER_IMAGE, "describe this image"], [(448, 448)]),
    "two-images-of-different-sizes": (
        ("compare two images",),
        [USER_IMAGE, USER_IMAGE, "compare two images"],
        [(640, 480), (501, 379)],
    ),
    "image-in-the-middle": (("what is in",), ["what is in", USER_IMAGE, "the picture ?"], [(300, 200)]),
}


def _prompt(processor, case, seed=0):
    _, parts, sizes = PROMPTS[case]
    images = [rgb(w, h, seed + i) for i, (w, h) in enumerate(sizes)]
    return render(processor, *parts), images


def _as_lists(batch):
    return {k: np.asarray(v).tolist() for k, v in batch.items()}


@pytest.mark.parametrize("case", list(PROMPTS))
def test_expanded_ids_match_the_reference_processor(processor, reference_processor, case):
    text, images = _prompt(processor, case)
    assert text.startswith("<BOS_TOKEN>")
    expected = reference_processor(text=[text], images=images, add_special_tokens=False, return_tensors="np")
    # mlx-vlm always passes add_special_tokens=True: the template's BOS must stay the only one.
    for add_special_tokens in (True, False):
        got = processor(text=[text], images=images, add_special_tokens=add_special_tokens, return_tensors="np")
        for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
        assert np.max(np.abs(got["pixel_values"] - expected["pixel_values"])) <= 1e-6


@pytest.mark.parametrize("case", list(PROMPTS))
def test_expanded_ids_match_tokenizer_plus_reference_grid(processor, tokenizer, case):
    text, images = _prompt(processor, case)
    grid = reference_image_processor()(images, return_tensors="np")["image_grid_thw"]
    pieces = text.split("<|IMAGE_PAD|>")
    expanded = pieces[0] + "".join(
        "<|IMAGE_PAD|>" * (int(np.prod(g)) // 4) + piece for g, piece in zip(grid, pieces[1:])
    )
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    pad_id = tokenizer.convert_tokens_to_ids("<|IMAGE_PAD|>")
    got = processor(text=text, images=images, add_special_tokens=True)
    assert got["input_ids"] == [ids]
    assert got["mm_token_type_ids"] == [[int(i == pad_id) for i in ids]]


def test_padded_batch_matches_the_reference(processor, reference_processor):
    text_a, images_a = _prompt(processor, "one-image", seed=1)
    text_b, images_b = _prompt(processor, "image-in-the-middle", seed=2)
    kwargs = dict(text=[text_a, text_b], images=images_a + images_b, padding=True, padding_side="left")
    expected = reference_processor(**kwargs, add_special_tokens=False, return_tensors="np")
    got = processor(**kwargs, add_special_tokens=True, return_tensors="np")
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


def test_token_counts_follow_the_grid(processor, tokenizer):
    text, images = _prompt(processor, "two-images-of-different-sizes")
    out = processor(text=text, images=images)
    # 640x480 -> 20x15 merged tokens, 501x379 -> 384x512 -> 16x12 merged tokens
    assert sum(out["mm_token_type_ids"][0]) == 20 * 15 + 16 * 12
    ids = out["input_ids"][0]
    assert ids.count(processor.image_token_id) == 20 * 15 + 16 * 12
    start, end = processor.vision_start_token_id, processor.vision_end_token_id
    assert ids[ids.index(start) + 1 : ids.index(end)] == [processor.image_token_id] * 300


def test_no_double_bos(processor, tokenizer):
    bos = tokenizer.bos_token_id
    text, images = _prompt(processor, "one-image")
    for add_special_tokens in (True, False):
        ids = processor(text=text, images=images, add_special_tokens=add_special_tokens)["input_ids"][0]
        assert ids[0] == bos and ids.count(bos) == 1
    plain = "describe this image"
    assert (
        processor(text=plain, add_special_tokens=True)["input_ids"][0]
        == [bos] + tokenizer(plain, add_special_tokens=False)["input_ids"]
    )
    assert bos not in processor(text=plain, add_special_tokens=False)["input_ids"][0]


@pytest.mark.parametrize("placeholders, n_images", [(2, 1), (1, 2), (0, 1), (1, 0)])
def test_placeholder_and_image_counts_must_match(processor, placeholders, n_images):
    text = "describe " + "<|IMAGE_PAD|> " * placeholders
    images = [rgb(64, 64, i) for i in range(n_images)] or None
    with pytest.raises(ValueError, match=f"{placeholders} <\\|IMAGE_PAD\\|> placeholder.*{n_images} image"):
        processor(text=text, images=images)


def test_truncation_that_cuts_image_tokens_is_refused(processor):
    text, images = _prompt(processor, "one-image")
    with pytest.raises(ValueError, match="image tokens"):
        processor(text=text, images=images, truncation=True, max_length=50)


def test_return_tensors(processor):
    text, images = _prompt(processor, "one-image")
    out = processor(text=[text], images=images, padding=True, return_tensors="np")
    assert out["input_ids"].dtype == np.int64 and out["input_ids"].shape == out["mm_token_type_ids"].shape
    assert out["pixel_values"].dtype == np.float32 and out["image_grid_thw"].dtype == np.int64
    try:
        import mlx.core as mx
    except ImportError:
        pytest.skip("mlx is not installed; return_tensors='mlx' cannot be checked")
    out = processor(text=[text], images=images, padding=True, return_tensors="mlx")
    # attention_mask stays numpy: mlx-vlm 0.6.3's server copies it across threads (see _batch).
    assert all(isinstance(v, mx.array) for k, v in out.items() if k != "attention_mask")
    assert isinstance(out["attention_mask"], np.ndarray)
    assert out["pixel_values"].dtype == mx.float32


def test_mlx_vlm_call_convention(processor):
    # prepare_inputs forwards add_special_tokens / padding_side only when the signature names them,
    # and 0.7.10 forwards min_pixels/max_pixels only when it has **kwargs.
    params = inspect.signature(processor.__call__).parameters
    assert {"text", "images", "padding", "padding_side", "add_special_tokens", "return_tensors"} <= set(params)
    assert any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert not hasattr(processor, "process")  # mlx-vlm would call that instead
    text, images = _prompt(processor, "one-image")
    out = processor(
        text=[text],
        images=images,
        padding=True,
        padding_side="left",
        return_tensors="np",
        add_special_tokens=True,
        max_pixels=65536,
    )
    np.testing.assert_array_equal(out["image_grid_thw"], [[1, 16, 16]])
    assert set(out) == {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"}


def test_mlx_vlm_prepare_inputs_takes_the_processor_unmodified(processor):
    utils = pytest.importorskip("mlx_vlm.utils", reason="mlx-vlm is not installed in this environment")
    prompt_utils = pytest.importorskip("mlx_vlm.prompt_utils", reason="mlx-vlm is not installed in this environment")
    import mlx.core as mx

    messages = [{"role": "user", "content": [USER_IMAGE, {"type": "text", "text": "describe this image"}]}]
    text = prompt_utils.get_chat_template(processor, messages, True)
    image = rgb(448, 448)
    # generate() passes add_special_tokens=True for this model type on every pin.
    inputs = utils.prepare_inputs(processor, images=[image], prompts=text, add_special_tokens=True)
    direct = processor(text=[text], images=[image], add_special_tokens=True, return_tensors="np")
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
        assert isinstance(inputs[key], mx.array), key
        np.testing.assert_array_equal(np.array(inputs[key]), direct[key], err_msg=key)
    assert np.array(inputs["input_ids"])[0, :2].tolist().count(processor.tokenizer.bos_token_id) == 1


def test_apply_chat_template_and_decode(processor, tokenizer):
    messages = [{"role": "user", "content": [USER_IMAGE, {"type": "text", "text": "describe this image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|><|VISION_START|><|IMAGE_PAD|><|VISION_END|>"
        "describe this image<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )
    image = rgb(448, 448)
    with_image = [{"role": "user", "content": [{"type": "image", "image": image}, messages[0]["content"][1]]}]
    ids = processor.apply_chat_template(with_image, add_generation_prompt=True, tokenize=True)
    assert ids == processor(text=text, images=[image])["input_ids"]
    assert processor.decode(ids[0][:2]) == tokenizer.decode(ids[0][:2])
    assert processor.batch_decode(ids) == tokenizer.batch_decode(ids)


@pytest.mark.parametrize(
    "conversation, words",
    [
        (
            [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello"}]],
            "tokenize=True takes one conversation",
        ),
        ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], "carries no image"),
        ([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}], "carries no frames"),
    ],
    ids=["a-batch", "image-part-without-image", "video-part-without-frames"],
)
def test_tokenized_chat_template_refuses_what_it_cannot_process(processor, conversation, words):
    with pytest.raises(ValueError, match=words):
        processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)


# ---------------------------------------------------------------- loading from a folder


def make_checkpoint(folder: Path, *, preprocessor=None, template_in_config=False) -> Path:
    build_tiny_tokenizer(folder, chat_template_in_config=template_in_config)
    (folder / "config.json").write_text(json.dumps({"model_type": "cohere_compass"}))
    preprocessor = (
        preprocessor
        if preprocessor is not None
        else {
            **CONFIG,
            "processor_class": "CohereCompassProcessor",
            "image_processor_type": "CohereCompassImageProcessor",
        }
    )
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return folder


@pytest.mark.parametrize("template_in_config", [False, True], ids=["chat_template.jinja", "tokenizer_config.json"])
def test_from_pretrained_builds_everything_from_the_folder(tmp_path, template_in_config):
    folder = make_checkpoint(tmp_path, template_in_config=template_in_config)
    proc = pc.CohereCompassProcessor.from_pretrained(folder, trust_remote_code=True, use_fast=True, revision="x")
    assert proc.chat_template == CHAT_TEMPLATE
    assert proc.image_processor.size == CONFIG["size"] and proc.image_processor.patch_size == 16
    assert proc.image_token == "<|IMAGE_PAD|>"
    assert proc.image_token_id == proc.tokenizer.convert_tokens_to_ids("<|IMAGE_PAD|>") == 11  # tiny vocab
    text, images = _prompt(proc, "one-image")
    assert sum(proc(text=text, images=images)["mm_token_type_ids"][0]) == 196


def test_a_tokenizer_config_without_tokenizer_class_loads_the_same_tokenizer(tmp_path):
    folder = make_checkpoint(tmp_path)
    original = pc.CohereCompassProcessor.from_pretrained(folder)
    text, images = _prompt(original, "one-image")
    expected = original(text=text, images=images)["input_ids"]
    edit_config = json.loads((folder / "tokenizer_config.json").read_text())
    edit_config.pop("tokenizer_class", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(edit_config))
    proc = pc.CohereCompassProcessor.from_pretrained(folder)
    assert proc(text=text, images=images)["input_ids"] == expected
    assert proc.tokenizer.convert_ids_to_tokens(expected[0][:2]).count("<BOS_TOKEN>") == 1


def test_from_pretrained_reads_legacy_keys_and_takes_overrides(tmp_path):
    legacy = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 4096, "max_pixels": 65536}
    folder = make_checkpoint(tmp_path, preprocessor=legacy)
    proc = pc.CohereCompassProcessor.from_pretrained(str(folder))
    assert (proc.image_processor.min_pixels, proc.image_processor.max_pixels) == (4096, 65536)
    proc = pc.CohereCompassProcessor.from_pretrained(str(folder), max_pixels=16384)
    assert proc.image_processor.max_pixels == 16384
    bad = make_checkpoint(tmp_path / "bad", preprocessor={**legacy, "max_pixels": 0})
    with pytest.raises(ValueError, match="max_pixels"):
        pc.CohereCompassProcessor.from_pretrained(bad)


def test_image_processor_from_pretrained_validates_the_file(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**CONFIG, "min_pixels": 4096}))
    ip = pc.CohereCompassImageProcessor.from_pretrained(str(tmp_path), max_pixels=8192)
    assert ip.size == {"shortest_edge": 4096, "longest_edge": 8192}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**CONFIG, "patch_size": 0}))
    with pytest.raises(ValueError, match="patch_size"):
        pc.CohereCompassImageProcessor.from_pretrained(str(tmp_path))


def test_from_pretrained_needs_a_local_folder(tmp_path):
    with pytest.raises(OSError, match="not a local checkpoint folder"):
        pc.CohereCompassProcessor.from_pretrained("CohereLabs/North-Micro-Vision-Instruct")


def test_save_pretrained_round_trips(tmp_path, processor):
    processor.save_pretrained(tmp_path / "saved")
    again = pc.CohereCompassProcessor.from_pretrained(tmp_path / "saved")
    assert again.chat_template == processor.chat_template
    assert again.image_processor.to_dict() == processor.image_processor.to_dict()
    text, images = _prompt(processor, "image-in-the-middle")
    assert _as_lists(again(text=text, images=images, return_tensors="np")) == _as_lists(
        processor(text=text, images=images, return_tensors="np")
    )


# ---------------------------------------------------------------- no torch, no side effects

TORCH_FREE_SCRIPT = r"""
import importlib, sys, types
sys.modules["torch"] = None  # any import of torch or torchvision now fails
sys.modules["torchvision"] = None
package = sys.modules["compass_processing"] = types.ModuleType("compass_processing")
package.__path__ = [sys.argv[1]]  # the vendored folder, without its __init__ (mlx)
module = importlib.import_module("compass_processing.processing_cohere_compass")
from transformers.models.auto import processing_auto
registered = list(processing_auto.PROCESSOR_MAPPING._extra_content.values())
assert module.CohereCompassProcessor not in registered, "import registered the processor"
from PIL import Image
proc = module.CohereCompassProcessor.from_pretrained(sys.argv[2])
out = proc(text="<BOS_TOKEN>describe <|IMAGE_PAD|>", images=[Image.new("RGB", (448, 448))], return_tensors="np")
assert out["pixel_values"].shape == (784, 1536), out["pixel_values"].shape
print("ok")
"""


def test_works_with_torch_unimportable_and_registers_nothing(tmp_path):
    folder = make_checkpoint(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_SCRIPT, str(VENDORED_DIR), str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
