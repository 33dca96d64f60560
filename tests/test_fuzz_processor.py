"""Fuzz the torch-free processor: consistent outputs or ValueError, nothing else, no hang.

Hypothesis draws images (1..3000 px a side, extreme aspect ratios, modes L / LA / RGB /
RGBA / P / CMYK / I;16) and prompts with image parts anywhere among text parts, through the
chat template or as bare ``<|IMAGE_PAD|>`` placeholders, sometimes with as many
placeholders as images and sometimes not. Every call must either return outputs where, per
image, the pad tokens equal the features the model will produce (t * h/2 * w/2) and the
grid lies within the min / max pixel bounds, or raise ValueError for a reason the inputs
explain (aspect ratio over 200, placeholders != images). Bounded: a fixed example budget,
a per-example deadline and an alarm against hangs keep it well under a minute.

The module is loaded by path, without mlx or the shim (as tests/test_processor.py does), so
it runs in every pass of the matrix, including the one where upstream's package is live.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.support.vendored import by_path, default_run_only

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "compass_data" / "tiny_tokenizer"

MIN_PIXELS, MAX_PIXELS = 16384, 602112  # the tiny checkpoint's bounds (the published ones cost 30x more)
PATCH, MERGE = 16, 2
MODES = ("L", "LA", "RGB", "RGBA", "P", "CMYK", "I;16")
EXAMPLE_SECONDS = 20  # alarm: a call that takes this long is a hang


pc = by_path("processing_cohere_compass", "compass_processing_fuzzed")
pytestmark = default_run_only


@pytest.fixture(scope="module")
def processor():
    proc = pc.CohereCompassProcessor.from_pretrained(TOKENIZER_DIR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert (proc.image_processor.min_pixels, proc.image_processor.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    return proc


# ---------------------------------------------------------------- strategies


def _color(mode: str, value: int):
    if mode in ("L", "P"):
        return value % 256
    if mode == "I;16":
        return value * 257 % 65536
    bands = {"LA": 2, "RGB": 3, "RGBA": 4, "CMYK": 4}[mode]
    return tuple((value * (i + 7)) % 256 for i in range(bands))


@st.composite
def images(draw):
    mode = draw(st.sampled_from(MODES))
    shape = draw(st.sampled_from(("any", "long", "tiny")))
    if shape == "any":
        width, height = draw(st.integers(1, 3000)), draw(st.integers(1, 3000))
    elif shape == "long":  # aspect ratios around and beyond the limit of 200
        long_side = draw(st.integers(100, 3000))
        ratio = draw(st.floats(150.0, 400.0))
        short = max(1, int(long_side / ratio))
        width, height = (long_side, short) if draw(st.booleans()) else (short, long_side)
    else:
        width, height = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    image = Image.new(mode, (width, height), _color(mode, draw(st.integers(0, 255))))
    if mode == "P":
        image.putpalette([(i * 37) % 256 for i in range(768)])
    return image


TEXTS = st.text(alphabet="abcdefghij ,.?!\n", min_size=0, max_size=30)


@st.composite
def requests(draw):
    """(prompt, images, placeholders, via_template)."""
    n_images = draw(st.integers(0, 3))
    imgs = [draw(images()) for _ in range(n_images)]
    placeholders = n_images if draw(st.integers(0, 4)) else draw(st.integers(0, 4))
    if draw(st.booleans()):
        # Chat messages: image parts anywhere among text parts, rendered by the template.
        parts = [{"type": "text", "text": draw(TEXTS)} for _ in range(draw(st.integers(0, 3)))]
        for _ in range(placeholders):
            parts.insert(draw(st.integers(0, len(parts))), {"type": "image"})
        return [{"role": "user", "content": parts}], imgs, placeholders, True
    # A bare prompt: placeholders anywhere in the text, even back to back.
    pieces = [draw(TEXTS) for _ in range(placeholders + 1)]
    prompt = "<BOS_TOKEN>" + pc.CohereCompassProcessor.image_token.join(pieces)
    return prompt, imgs, placeholders, False


# ---------------------------------------------------------------- the invariant


def _expected_failure(images_, placeholders: int) -> bool:
    if placeholders != len(images_):
        return True
    return any(max(im.size) / min(im.size) > 200 for im in images_)


def _event(text: str) -> None:
    if currently_in_test_context():  # statistics for --hypothesis-show-statistics
        event(text)


def _check(processor, prompt, images_, placeholders, via_template):
    if via_template:
        prompt = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    try:
        out = processor(text=prompt, images=images_ or None, return_tensors="np")
    except ValueError as err:
        assert _expected_failure(images_, placeholders), f"unexpected ValueError: {err}"
        _event("ValueError: " + ("placeholders != images" if placeholders != len(images_) else "aspect ratio"))
        return
    assert not _expected_failure(images_, placeholders), "accepted inputs that must be refused"
    _event(f"processed {len(images_)} image(s)")
    for image in images_:
        _event(f"mode {image.mode}")
    ids = np.asarray(out["input_ids"])[0]
    pads = ids == processor.image_token_id
    assert int(pads.sum()) == int(np.sum(np.asarray(out["mm_token_type_ids"])[0] == 1))
    if not images_:
        assert "pixel_values" not in out and int(pads.sum()) == 0
        return
    grids = np.asarray(out["image_grid_thw"]).tolist()
    assert len(grids) == len(images_)
    features = []
    for t, h, w in grids:
        assert t == 1 and h % MERGE == 0 and w % MERGE == 0
        assert MIN_PIXELS <= h * w * PATCH * PATCH <= MAX_PIXELS, (h, w)
        features.append(t * (h // MERGE) * (w // MERGE))
    assert np.asarray(out["pixel_values"]).shape == (sum(t * h * w for t, h, w in grids), 3 * 2 * PATCH * PATCH)
    assert np.isfinite(np.asarray(out["pixel_values"])).all()
    assert int(pads.sum()) == sum(features)
    if via_template:
        # <|VISION_START|> pads <|VISION_END|> per image part: runs of pads, in image order.
        edges = np.flatnonzero(np.diff(np.concatenate([[0], pads.astype(np.int8), [0]])))
        runs = (edges[1::2] - edges[::2]).tolist()
        assert runs == features


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang(f"one processor call took over {EXAMPLE_SECONDS} s")


@settings(
    max_examples=300,
    deadline=None,  # the alarm below bounds each example; timing jitter on a loaded CI box is no bug
    derandomize=True,  # the same examples on every run: CI stays reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(request=requests())
def test_processor_is_consistent_or_raises_value_error(processor, request):
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(EXAMPLE_SECONDS)
    try:
        _check(processor, *request)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [(1, 1), (1, 200), (201, 1), (3000, 15), (2999, 3000)])
def test_every_mode_at_the_edges(processor, mode, size):
    """The corners hypothesis may not draw: each mode at 1x1, ratio exactly 200 and 201, 3000 px."""
    image = Image.new(mode, size, _color(mode, 77))
    _check(processor, "<BOS_TOKEN>look: " + processor.image_token, [image], 1, False)
