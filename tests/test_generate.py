"""Greedy ids out of mlx-vlm's own load + stream_generate, after ``import compass_compat``."""

import pytest

from tests.support.mlx_vlm_run import greedy_ids
from tests.support.vendored import vendored

vendored()

CASES = ["text_short", "text_medium", "text_long", "img_448", "img_640x480", "img_501x379", "img_two", "img_middle"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def loaded(tiny_ckpt_original):
    from mlx_vlm import load

    return load(str(tiny_ckpt_original))


@pytest.mark.parametrize("name", CASES)
def test_stream_generate_matches_reference(loaded, reference, fixture_images, name):
    case = reference(name)
    meta = case["meta"]
    images = [str(fixture_images[f]) for f in meta["images"]]
    fed = []
    got = greedy_ids(loaded, meta["prompt"], images, MAX_TOKENS, fed=fed)
    # The ids mlx-vlm feeds the model are the reference's (one BOS, same expansion).
    assert fed and fed[0]["input_ids"].tolist() == case["input_ids"].tolist()
    want = case["greedy_ids"].tolist()
    eos = loaded[0].config.eos_token_id
    if eos in want:
        want = want[: want.index(eos) + 1]
    assert got[: len(want)] == want


def test_chat_template_path_renders_the_reference_prompt(loaded, reference):
    """mlx_vlm.prompt_utils.apply_chat_template (what the CLI uses) gives the reference prompt."""
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded
    for name in ("text_short", "img_448", "img_two"):
        meta = reference(name)["meta"]
        user = meta["messages"][0]["content"]
        text = user if isinstance(user, str) else next(p["text"] for p in user if p["type"] == "text")
        prompt = apply_chat_template(processor, model.config, text, num_images=len(meta["images"]))
        assert prompt == meta["prompt"], name


def test_loaded_processor_honours_the_image_files(loaded, tiny_ckpt_original):
    """mlx-vlm's load keeps the checkpoint's image settings: mean/std from preprocessor_config.json,
    pixel bounds from tokenizer_config.json (which overrides the preprocessor's size, as in
    transformers)."""
    import json

    want = json.loads((tiny_ckpt_original / "preprocessor_config.json").read_text())
    tokenizer_config = json.loads((tiny_ckpt_original / "tokenizer_config.json").read_text())
    ip = loaded[1].image_processor
    assert list(ip.image_mean) == want["image_mean"] and list(ip.image_std) == want["image_std"]
    assert (ip.min_pixels, ip.max_pixels) == (tokenizer_config["min_pixels"], tokenizer_config["max_pixels"])
    assert (ip.min_pixels, ip.max_pixels) != (want["size"]["shortest_edge"], want["size"]["longest_edge"])
