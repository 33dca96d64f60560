"""Bad requests: unreadable, huge, too wide or miscounted images, empty and very long prompts,
features replayed for the wrong image. Each asserts the exact error class and message: what
mlx-vlm's own generate raises on this pin, and what the vendored processor raises when called
directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
from PIL import Image

from tests.support.host_calls import MAX_TOKENS, generate, load
from tests.support.images import png_claiming
from tests.support.mlx_vlm_run import chat_prompt as prompt_for
from tests.support.vendored import vendored

vendored()

import mlx.core as mx  # noqa: E402

from compass_data.tiny import special_token_ids  # noqa: E402

IDS = special_token_ids()


@pytest.fixture(scope="module")
def loaded(tiny_ckpt_original):
    return load(tiny_ckpt_original)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Dict[str, Path]:
    folder = tmp_path_factory.mktemp("request_images")
    Image.effect_noise((300, 300), 60).convert("RGB").save(folder / "noise.png")
    out = {"noise": folder / "noise.png"}
    data = (folder / "noise.png").read_bytes()
    (folder / "truncated.png").write_bytes(data[: len(data) // 2])
    out["truncated"] = folder / "truncated.png"
    (folder / "text.png").write_text("this is not an image", encoding="utf-8")
    out["not_an_image"] = folder / "text.png"
    Image.new("RGB", (1, 1), (200, 30, 90)).save(folder / "one.png")
    out["one_pixel"] = folder / "one.png"
    Image.new("RGB", (4020, 20), (10, 20, 30)).save(folder / "wide.png")
    out["too_wide"] = folder / "wide.png"
    Image.new("RGB", (4000, 20), (10, 20, 30)).save(folder / "wide_ok.png")
    out["wide_ok"] = folder / "wide_ok.png"
    out["huge"] = png_claiming(folder / "huge.png", 20000, 20000)
    return out


def test_truncated_image_file(loaded, images):
    prompt = prompt_for(loaded, "Describe.", 1)
    # mlx-vlm's load_image opens the file lazily and converts outside its try block: PIL's
    # OSError reaches the caller unwrapped, on every pin.
    with pytest.raises(OSError, match=r"^image file is truncated") as info:
        generate(loaded, prompt, [str(images["truncated"])])
    assert type(info.value) is OSError
    with pytest.raises(ValueError, match=r"cannot read image file '.*truncated\.png': image file is truncated"):
        loaded[1](text=prompt, images=[str(images["truncated"])])


def test_file_that_is_not_an_image(loaded, images):
    prompt = prompt_for(loaded, "Describe.", 1)
    with pytest.raises(ValueError, match=r"^Failed to load image from .*text\.png.*cannot identify image file"):
        generate(loaded, prompt, [str(images["not_an_image"])])
    with pytest.raises(ValueError, match=r"cannot read image file '.*text\.png': cannot identify image file"):
        loaded[1](text=prompt, images=[str(images["not_an_image"])])


def test_one_pixel_image_is_scaled_up_to_min_pixels_and_generates(loaded, images, tiny_ckpt_original):
    processor = loaded[1]
    prompt = prompt_for(loaded, "Describe.", 1)
    out = processor(text=prompt, images=[str(images["one_pixel"])], return_tensors="np")
    # smart_resize by exact arithmetic: round(1/32)*32 = 0 < min pixels 16384, so both sides
    # grow by sqrt(16384) = 128 and round up to 128: grid [1, 8, 8], 16 image tokens.
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert int(np.sum(np.asarray(out["input_ids"]) == IDS["<|IMAGE_PAD|>"])) == 16
    assert out["pixel_values"].shape == (64, 3 * 2 * 16 * 16)
    reference = _reference_image_processor(tiny_ckpt_original)
    if reference is not None:  # transformers >= 5.21: compare with its own processor, bit for bit
        want = reference(images=[Image.open(images["one_pixel"]).convert("RGB")], return_tensors="np")
        np.testing.assert_array_equal(np.asarray(want["image_grid_thw"]), out["image_grid_thw"])
        np.testing.assert_array_equal(np.asarray(want["pixel_values"]), out["pixel_values"])
    fed: list = []
    ids = generate(loaded, prompt, [str(images["one_pixel"])], fed=fed)
    assert len(ids) == MAX_TOKENS or ids[-1] == IDS["<|END_OF_TURN_TOKEN|>"]
    assert fed[0]["input_ids"][0].tolist().count(IDS["<|IMAGE_PAD|>"]) == 16


def _reference_image_processor(folder: Path):
    try:
        from transformers.models.cohere_compass.image_processing_pil_cohere_compass import (
            CohereCompassImageProcessorPil,
        )
    except ImportError:
        return None  # transformers < 5.21 (pins before 0.7.10): the exact-arithmetic checks above stand alone
    config = json.loads((folder / "preprocessor_config.json").read_text())
    keys = (
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "size",
        "resample",
        "do_convert_rgb",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
    )
    settings = {k: config[k] for k in keys}
    # transformers' processor merges tokenizer_config.json's bounds over the file's size.
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    settings["size"] = {"shortest_edge": tokenizer["min_pixels"], "longest_edge": tokenizer["max_pixels"]}
    return CohereCompassImageProcessorPil(**settings)


def test_huge_image_file_is_refused_before_decoding(loaded, images):
    prompt = prompt_for(loaded, "Describe.", 1)
    bomb = r"Image size \(400000000 pixels\) exceeds limit of \d+ pixels, could be decompression bomb"
    # PIL's guard fires in Image.open, on the header alone; mlx-vlm's load_image wraps it in ValueError.
    with pytest.raises(ValueError, match=r"^Failed to load image from .*huge\.png.*" + bomb) as info:
        generate(loaded, prompt, [str(images["huge"])])
    assert type(info.value) is ValueError
    with pytest.raises(ValueError, match=r"cannot read image file '.*huge\.png': " + bomb):
        loaded[1](text=prompt, images=[str(images["huge"])])


def _measure_rss(*args: str) -> dict:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "preprocess_rss.py"
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_huge_in_memory_image_is_bounded_by_max_pixels_in_tokens_and_memory():
    """20000x20000 RGB (1.5 GiB as a PIL image) with the tiny checkpoint's pixel bounds."""
    result = _measure_rss("--side", "20000", "--min-pixels", "16384", "--max-pixels", "602112")
    assert result["grid_thw"] == [1, 48, 48] and result["image_tokens"] == 576
    assert 48 * 48 * 256 <= 602112
    # Growth over the image itself: PIL's two-pass resize keeps one 768 x 20000 band, plus
    # the 768x768 output and its float copies. Nothing scales with the 20000x20000 area.
    assert result["peak_over_image_mib"] < 128, result


def test_aspect_ratio_over_200(loaded, images):
    prompt = prompt_for(loaded, "Describe.", 1)
    with pytest.raises(
        ValueError,
        match=r"^Failed to process inputs with error: image of 4020x20 pixels has aspect "
        r"ratio 201\.0; cohere_compass accepts at most 200\. Crop or pad the image first\.",
    ):
        generate(loaded, prompt, [str(images["too_wide"])])
    assert len(generate(loaded, prompt, [str(images["wide_ok"])], max_tokens=2)) == 2  # exactly 200 is fine


@pytest.mark.parametrize("placeholders, given", [(1, 2), (2, 1), (0, 1)])
def test_images_and_placeholders_must_match(loaded, images, placeholders, given):
    prompt = prompt_for(loaded, "Describe.", placeholders)
    with pytest.raises(
        ValueError,
        match=rf"^Failed to process inputs with error: the text has {placeholders} "
        rf"<\|IMAGE_PAD\|> placeholder\(s\) but {given} image\(s\) were passed; they must match",
    ):
        generate(loaded, prompt, [str(images["noise"])] * given)


def test_placeholder_without_any_image_runs_as_text_like_the_reference(loaded):
    """No image at all: mlx-vlm tokenizes the prompt itself and never calls the processor, so
    the pad token goes in as an ordinary token, as in transformers (which checks placeholders
    only when pixel_values are given). Recorded here as the current behaviour."""
    fed: list = []
    ids = generate(loaded, prompt_for(loaded, "Describe.", 1), None, fed=fed)
    assert len(ids) == MAX_TOKENS and fed[0]["input_ids"][0].tolist().count(IDS["<|IMAGE_PAD|>"]) == 1


def test_empty_prompt_generates_from_bos(loaded):
    fed: list = []
    ids = generate(loaded, "", None, fed=fed)
    assert fed[0]["input_ids"].tolist() == [[IDS["<BOS_TOKEN>"]]]
    assert len(ids) == MAX_TOKENS
    with pytest.raises(ValueError, match=r"the text has 0 <\|IMAGE_PAD\|> placeholder\(s\) but 1 image\(s\)"):
        generate(loaded, "", [str(Path(__file__).parent / "fixtures" / "images" / "synth_448x448.png")])


def test_prompt_longer_than_several_sliding_windows(loaded, reference):
    from tests.support.parity import greedy

    case = reference("text_long")  # 132 tokens: more than 8 windows of 16
    want = case["greedy_ids"].tolist()[:MAX_TOKENS]
    assert generate(loaded, case["meta"]["prompt"]) == want
    # ~60 windows: mlx-vlm's generation equals one full prefill plus plain decode steps.
    text = " ".join(["the keeper walked along the shore counting boats"] * 80)
    prompt = prompt_for(loaded, text, 0)
    ids = loaded[1].tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert len(ids) > 60 * 16
    assert generate(loaded, prompt) == greedy(loaded[0], {"input_ids": np.array([ids])}, MAX_TOKENS)


def test_cached_features_replayed_for_the_wrong_image(loaded, reference):
    model = loaded[0]
    a, b = reference("img_448"), reference("img_501x379")  # grids [1, 28, 28] and [1, 24, 32]
    cached = model.encode_image(mx.array(a["pixel_values"]), a["image_grid_thw"])
    with pytest.raises(
        ValueError,
        match=r"the prompt has 192 image tokens but the image features cover 196 tokens\."
        r" Each image needs exactly one image placeholder, .* replayed features must come "
        r"from the same images",
    ):
        model.get_input_embeddings(
            mx.array(b["input_ids"]), cached_image_features=cached, image_grid_thw=b["image_grid_thw"]
        )
