"""The one reader of the recorded transformers reference: the tiny checkpoint's cases
(tests/fixtures/reference, written by scripts/reference/model_outputs.py), its video cases
(tests/fixtures/video_model, scripts/reference/video_model.py) and the video processor's cases
(tests/fixtures/video, scripts/reference/video_processor.py). Arrays are read-only, pixel values
unpacked (``pixels.py``).
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Dict

import numpy as np

from tests.support.pixels import unpack_levels, unpack_pixel_values

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures"
REFERENCE_DIR = FIXTURES / "reference"
VIDEO_MODEL_DIR = FIXTURES / "video_model"
VIDEO_INDEX = json.loads((VIDEO_MODEL_DIR / "index.json").read_text(encoding="utf-8"))
VIDEO_PROCESSOR_DIR = FIXTURES / "video"
VIDEO_PROCESSOR_INDEX = json.loads((VIDEO_PROCESSOR_DIR / "index.json").read_text(encoding="utf-8"))


def read_case_arrays(path: pathlib.Path) -> Dict[str, np.ndarray]:
    """The arrays of one reference case file, pixel values unpacked."""
    from safetensors.numpy import load_file

    arrays = load_file(str(path))
    if "pixel_values_codes" in arrays:
        arrays["pixel_values"] = unpack_pixel_values(
            arrays.pop("pixel_values_codes"), arrays.pop("pixel_values_levels")
        )
    return arrays


def read_video_case(path: pathlib.Path) -> Dict[str, np.ndarray]:
    """The arrays of one video reference case file, pixel values unpacked."""
    from safetensors.numpy import load_file

    arrays = load_file(str(path))
    for key in ("pixel_values_videos", "pixel_values"):
        if f"{key}_codes" in arrays:
            arrays[key] = unpack_levels(arrays.pop(f"{key}_codes"), arrays.pop(f"{key}_levels"))
    return arrays


def _read_only(arrays: dict) -> dict:
    for value in arrays.values():
        value.flags.writeable = False
    return arrays


class ReferenceFixtures:
    """``reference("img_448")`` -> dict of read-only numpy arrays plus ``"meta"`` (its index entry).

    Arrays: input_ids, prefill_logits, greedy_ids, greedy_logits; image cases also pixel_values,
    image_grid_thw, mm_token_type_ids, position_ids, rope_deltas, image_features,
    deepstack_features. ``reference.index`` is index.json; ``reference.cases`` the case names.
    """

    def __init__(self, directory: pathlib.Path = REFERENCE_DIR):
        self.directory = directory
        self.index = json.loads((directory / "index.json").read_text(encoding="utf-8"))
        self.cases = list(self.index["cases"])

    @functools.lru_cache(maxsize=None)
    def _arrays(self, name: str) -> dict:
        return _read_only(read_case_arrays(self.directory / self.index["cases"][name]["file"]))

    def __call__(self, name: str) -> dict:
        return {**self._arrays(name), "meta": self.index["cases"][name]}


@functools.lru_cache(maxsize=None)
def _video_arrays(checkpoint: str, name: str) -> dict:
    entry = VIDEO_INDEX["checkpoints"][checkpoint][name]
    return _read_only(read_video_case(VIDEO_MODEL_DIR / checkpoint / entry["file"]))


def video_case(checkpoint: str, name: str) -> dict:
    """Video case ``name`` of ``checkpoint`` ("tiny" or "toy"): read-only arrays plus ``"meta"``."""
    return {**_video_arrays(checkpoint, name), "meta": VIDEO_INDEX["checkpoints"][checkpoint][name]}


@functools.lru_cache(maxsize=None)
def video_processor_case(name: str) -> Dict[str, np.ndarray]:
    """The recorded arrays of the video processor's case ``name`` (its index entry is
    ``VIDEO_PROCESSOR_INDEX["cases"][name]``), read-only, pixel values unpacked."""
    with np.load(VIDEO_PROCESSOR_DIR / VIDEO_PROCESSOR_INDEX["cases"][name]["file"], allow_pickle=False) as archive:
        arrays = dict(archive)
    for key, stored in (("pixel_values_videos", "pixel"), ("pixel_values", "image")):
        if f"{stored}_codes" in arrays:
            arrays[key] = unpack_levels(arrays.pop(f"{stored}_codes"), arrays.pop(f"{stored}_levels"))
    return _read_only(arrays)
