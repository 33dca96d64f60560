"""The pixel-bounds cases (folders with the files that decide the bounds, from_pretrained and call
keywords, two images) and transformers' processor run on them: what
scripts/reference/pixel_bounds.py records into tests/fixtures/pixel_bounds.json and
tests/test_pixel_bounds.py compares the vendored processor with (the fixture on every pin, the
live reference where it is installed).
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import shutil
from typing import Any, Dict, Optional

import numpy as np

from compass_data import tiny

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "pixel_bounds.json"
IMAGES = {"224x224": (224, 224), "4032x3024": (3024, 4032)}  # name -> (height, width)
# Sampled pixel_values entries recorded per image: fixed flat indices spread over the array.
SAMPLES = 16


# The published preprocessor_config.json (the default tiny checkpoint writes it as published).
PUBLISHED_PREPROCESSOR = tiny.tiny_preprocessor_config()
PUBLISHED_TOKENIZER_BOUNDS = {"min_pixels": 16384, "max_pixels": 3868706}
# The image_processor block of processor_config.json as mlx-vlm 0.7.10's converter writes it
# (tests/fixtures/quantized_0710/*/processor_config.json), with the published mean/std.
CONVERTED_BLOCK = {
    **{k: v for k, v in PUBLISHED_PREPROCESSOR.items() if k != "processor_class"},
    "size": {"shortest_edge": 16384, "longest_edge": 3868706},
    "min_pixels": 16384,
    "max_pixels": 3868706,
}
S = {"shortest_edge": 200704, "longest_edge": 1003520}  # another pair of bounds (784 / 3920 patches)


def processing_module():
    """The vendored processing_cohere_compass module (its pixel-bound resolution is the one the
    processor and these tests share), live or by path."""
    from tests.support.vendored import vendored_module  # imports compass_compat: not for the reference's recorder

    return vendored_module("processing_cohere_compass")


def pixel_bounds(
    folder: Any, load_kwargs: Optional[Dict[str, Any]] = None, call_kwargs: Optional[Dict[str, Any]] = None
):
    """The min / max pixels a cohere_compass processor built from ``folder`` resizes within,
    with their sources (``PixelBounds``; the precedence table is in the vendored image processor's
    "pixel bounds" section). Values are validated by the image processor itself."""
    return processing_module().read_pixel_bounds(pathlib.Path(os.fspath(folder)), load_kwargs, call_kwargs)


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


# name -> files: tokenizer_config.json keys added to the tiny tokenizer's, preprocessor_config.json
# (None: no file), processor_config.json (None: no file).
FOLDERS: Dict[str, Dict[str, Any]] = {
    "cohere_original": dict(tokenizer=PUBLISHED_TOKENIZER_BOUNDS, preprocessor=PUBLISHED_PREPROCESSOR, processor=None),
    "mlx_conversion": dict(
        tokenizer=PUBLISHED_TOKENIZER_BOUNDS,
        preprocessor=PUBLISHED_PREPROCESSOR,
        processor={"image_processor": CONVERTED_BLOCK, "processor_class": "CohereCompassProcessor"},
    ),
    # No bounds in tokenizer_config.json, so preprocessor_config.json's.
    "no_tokenizer_bounds": dict(tokenizer={}, preprocessor=PUBLISHED_PREPROCESSOR, processor=None),
    "tokenizer_min_only": dict(tokenizer={"min_pixels": 16384}, preprocessor=PUBLISHED_PREPROCESSOR, processor=None),
    "tokenizer_max_only": dict(tokenizer={"max_pixels": 3868706}, preprocessor=PUBLISHED_PREPROCESSOR, processor=None),
    "tokenizer_size_and_min": dict(
        tokenizer={"size": S, "min_pixels": 16384}, preprocessor=PUBLISHED_PREPROCESSOR, processor=None
    ),
    # processor_config.json's block beats preprocessor_config.json, with nothing else to say.
    "block_beats_preprocessor": dict(
        tokenizer={}, preprocessor=PUBLISHED_PREPROCESSOR, processor={"image_processor": CONVERTED_BLOCK}
    ),
    # ... and tokenizer_config.json beats the block.
    "tokenizer_beats_block": dict(
        tokenizer=PUBLISHED_TOKENIZER_BOUNDS,
        preprocessor=PUBLISHED_PREPROCESSOR,
        processor={"image_processor": {**_without(CONVERTED_BLOCK, "min_pixels", "max_pixels"), "size": S}},
    ),
    "block_without_preprocessor": dict(tokenizer={}, preprocessor=None, processor={"image_processor": CONVERTED_BLOCK}),
    # A processor_config.json without the block: preprocessor_config.json is read.
    "processor_config_without_block": dict(
        tokenizer={}, preprocessor=PUBLISHED_PREPROCESSOR, processor={"processor_class": "CohereCompassProcessor"}
    ),
    # Legacy keys beside size in one file: the legacy keys win.
    "legacy_keys_beat_size": dict(
        tokenizer={},
        processor=None,
        preprocessor={**PUBLISHED_PREPROCESSOR, "min_pixels": 200704, "max_pixels": 1003520},
    ),
    "legacy_min_beside_size": dict(
        tokenizer={}, processor=None, preprocessor={**PUBLISHED_PREPROCESSOR, "min_pixels": 3136}
    ),
}

# case id -> (folder, from_pretrained kwargs, call kwargs)
CASES: Dict[str, tuple] = {name: (name, {}, {}) for name in FOLDERS}
CASES.update(
    {
        "original/call_min": ("cohere_original", {}, {"min_pixels": 200704}),
        "original/call_max": ("cohere_original", {}, {"max_pixels": 1003520}),
        "original/call_size": ("cohere_original", {}, {"size": S}),  # loses to tokenizer_config.json
        "original/call_size_and_max": ("cohere_original", {}, {"size": S, "max_pixels": 1003520}),
        "original/call_size_one_edge": ("cohere_original", {}, {"size": {"longest_edge": 1003520}}),
        "original/load_min": ("cohere_original", {"min_pixels": 200704}, {}),
        "original/load_size": ("cohere_original", {"size": S}, {}),  # loses to tokenizer_config.json
        "original/load_min_call_min": ("cohere_original", {"min_pixels": 200704}, {"min_pixels": 65536}),
        "mlx_conversion/call_min_max": ("mlx_conversion", {}, {"min_pixels": 200704, "max_pixels": 1003520}),
        "mlx_conversion/load_max": ("mlx_conversion", {"max_pixels": 1003520}, {}),
        "no_tokenizer_bounds/call_size": ("no_tokenizer_bounds", {}, {"size": S}),
        "no_tokenizer_bounds/load_size": ("no_tokenizer_bounds", {"size": S}, {}),
        "no_tokenizer_bounds/load_size_call_size": (
            "no_tokenizer_bounds",
            {"size": S},
            {"size": {"shortest_edge": 16384, "longest_edge": 3868706}},
        ),
        "no_tokenizer_bounds/load_min_call_size": (
            "no_tokenizer_bounds",
            {"min_pixels": 200704},
            {"size": {"shortest_edge": 16384, "longest_edge": 3868706}},
        ),
        "no_tokenizer_bounds/load_max": ("no_tokenizer_bounds", {"max_pixels": 1003520}, {}),
        "legacy_min_beside_size/load_size": ("legacy_min_beside_size", {"size": S}, {}),
        "tokenizer_min_only/load_size_call_max": ("tokenizer_min_only", {"size": S}, {"max_pixels": 1003520}),
    }
)
# Cases where the reference raises and the vendored processor, on purpose, does not (see the
# image processor's "pixel bounds" notes): not recorded.
LENIENT = {
    "no_tokenizer_bounds/call_size_one_edge": ("no_tokenizer_bounds", {}, {"size": {"longest_edge": 1003520}}),
}


def build_folder(name: str, path: pathlib.Path, base: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Folder ``name`` of FOLDERS at ``path``: a copy of ``base`` (a checkpoint folder) or the
    tiny tokenizer files alone, with that case's three files written over it."""
    from compass_data.tiny import TOKENIZER_DIR, TOKENIZER_FILES

    spec = FOLDERS[name]
    path.mkdir(parents=True, exist_ok=True)
    if base is not None:
        for entry in base.iterdir():
            shutil.copyfile(entry, path / entry.name)
    else:
        for file in TOKENIZER_FILES:
            shutil.copyfile(TOKENIZER_DIR / file, path / file)
    tokenizer = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    # Each case says all of its bounds: none carried over from the copied files.
    for key in ("min_pixels", "max_pixels", "size"):
        tokenizer.pop(key, None)
    tokenizer.update(copy.deepcopy(spec["tokenizer"]))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2), encoding="utf-8")
    for file, key in (("preprocessor_config.json", "preprocessor"), ("processor_config.json", "processor")):
        if spec[key] is None:
            (path / file).unlink(missing_ok=True)
        else:
            (path / file).write_text(json.dumps(spec[key], indent=2), encoding="utf-8")
    return path


def make_image(name: str):
    """A deterministic RGB image: a colour gradient plus seeded noise."""
    from PIL import Image

    height, width = IMAGES[name]
    ys, xs = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(height * 7919 + width).integers(0, 64, (height, width, 3))
    base = np.stack([xs * 191 // width, ys * 191 // height, (xs + ys) * 95 // (width + height)], axis=-1)
    return Image.fromarray((base + noise).astype(np.uint8), mode="RGB")


def summarize(pixel_values) -> dict:
    """Shape, sums and fixed samples of pixel_values (the full array is megabytes)."""
    values = np.asarray(pixel_values, dtype=np.float32)
    flat = values.reshape(-1)
    picks = np.linspace(0, flat.size - 1, SAMPLES).astype(np.int64)
    return {
        "shape": list(values.shape),
        "sum": float(values.astype(np.float64).sum()),
        "sum_of_squares": float(np.square(values.astype(np.float64)).sum()),
        "samples": [float(v) for v in flat[picks]],
    }


# ------------------------------------------------------------------ the reference


def reference_processor(folder: pathlib.Path, load_kwargs: dict):
    """transformers' CohereCompassProcessor for ``folder``, built as AutoProcessor would build
    it (kwargs to both the tokenizer and the image processor), without a video processor."""
    from transformers import AutoTokenizer
    from transformers.models.cohere_compass.image_processing_pil_cohere_compass import CohereCompassImageProcessorPil
    from transformers.models.cohere_compass.processing_cohere_compass import CohereCompassProcessor

    class WithoutVideo(CohereCompassProcessor):
        # No torchvision here, so no video processor: let the reference accept None for it.
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    # deepcopy: transformers writes min/max_pixels into a `size` kwarg it is given.
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **copy.deepcopy(load_kwargs))
    image_processor = CohereCompassImageProcessorPil.from_pretrained(str(folder), **copy.deepcopy(load_kwargs))
    return WithoutVideo(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def reference_bounds(processor, call_kwargs: dict) -> list:
    """[min, max] pixels the reference resizes within for this call: its merged image kwargs
    (ProcessorMixin._merge_kwargs, tokenizer init kwargs included), completed from the image
    processor and standardized as its ``preprocess`` does."""
    from transformers.models.cohere_compass.processing_cohere_compass import CohereCompassProcessorKwargs

    merged = processor._merge_kwargs(
        CohereCompassProcessorKwargs,
        tokenizer_init_kwargs=processor.tokenizer.init_kwargs,
        **copy.deepcopy(call_kwargs),
    )["images_kwargs"]
    image_processor = processor.image_processor
    for key in image_processor._valid_kwargs_names:
        merged.setdefault(key, getattr(image_processor, key, None))
    size = image_processor._standardize_kwargs(**merged)["size"]
    return [int(size.shortest_edge), int(size.longest_edge)]


def reference_run(processor, image, call_kwargs: dict) -> dict:
    out = processor(
        text=["<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"],
        images=[image],
        return_tensors="np",
        **copy.deepcopy(call_kwargs),
    )
    return {
        "tokens": int(np.sum(np.asarray(out["input_ids"]) == processor.image_token_id)),
        "grid": np.asarray(out["image_grid_thw"]).tolist(),
        "pixel_values": np.asarray(out["pixel_values"], dtype=np.float32),
    }
